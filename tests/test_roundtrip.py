"""Round trips: save_low_bit -> load_low_bit and export -> from_pretrained give bit-identical logits
for every format on SmolLM2 (compressed IRs come from the cache); the torch backend refuses to
save or to take NNCF formats, with the fix in the message."""

import os

import pytest
import torch

from xpuspec import FORMATS, AutoModelForCausalLM, LowBitConfigError, OutputExistsError, export
from xpuspec.cache import cache_root

from conftest import MODEL, cpu_computes_bf16
from tiny import tiny_model

#: One short prompt: "def fibonacci(n):" in SmolLM2's tokenizer.
PROMPT_IDS = torch.tensor([[1, 1604, 3987, 46477, 24, 94, 727]])


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_and_export_round_trips_are_bit_identical(smollm2_path, tmp_path, fmt):
    if fmt == "bf16" and not cpu_computes_bf16():  # this CPU exports a bf16 IR for another, and refuses to run it
        exported = export(MODEL, tmp_path / "exported", weight_format=fmt)
        for source in (MODEL, exported):
            with pytest.raises(LowBitConfigError, match="does not compute in bfloat16"):
                AutoModelForCausalLM.from_pretrained(source, device="cpu", load_in_low_bit=fmt)
        with pytest.raises(LowBitConfigError, match="does not compute in bfloat16"):
            AutoModelForCausalLM.from_pretrained(exported, device="cpu")
        return
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit=fmt)
    reference = model(PROMPT_IDS).logits
    saved = AutoModelForCausalLM.load_low_bit(model.save_low_bit(tmp_path / "saved"), device="cpu")
    exported = AutoModelForCausalLM.from_pretrained(export(MODEL, tmp_path / "exported", weight_format=fmt),
                                                    device="cpu")
    for again in (saved, exported):
        assert again.low_bit == model.low_bit
        assert torch.equal(again(PROMPT_IDS).logits, reference)
    assert reference.abs().max() > 1  # real logits, not an empty or zero tensor
    with pytest.raises(OutputExistsError, match="pass force=True"):
        model.save_low_bit(tmp_path / "saved")
    for kept in (tmp_path / "saved", tmp_path, cache_root(), cache_root() / "ov"):  # not the model's folder or cache
        with pytest.raises(OutputExistsError, match="force or not"):
            saved.save_low_bit(kept, force=True)
    if fmt != "fp32":
        other = "int8_asym" if fmt != "int8_asym" else "int4_sym"
        with pytest.raises(LowBitConfigError, match=f"already compressed to {fmt}"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "saved", load_in_low_bit=other)


@pytest.mark.parametrize("mode, extra", [("INT8_ASYM", {}), ("INT4_ASYM", dict(group_size=64, ratio=1.0))])
def test_nncfs_numpy_path_taken_for_small_models_writes_the_same_weights(smollm2_path, tmp_path, monkeypatch,
                                                                         mode, extra):
    """SmolLM2-sized weights are compressed on NNCF's numpy path (xpuspec_openvino.ir._nncf_path_for), which must
    give the bytes of NNCF's default, compiled path; a large model keeps the default."""
    import nncf
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops
    from xpuspec.sources import resolve_source
    from xpuspec_openvino.ir import _nncf_path_for

    monkeypatch.delenv("NNCF_DISABLE_OPTIMIZED_COMPRESSION", raising=False)
    rng = np.random.default_rng(0)
    x = ops.parameter([1, 576], np.float32)
    first = ops.matmul(x, ops.constant(rng.standard_normal((1536, 576), dtype=np.float32)), False, True)
    model = ov.Model([ops.matmul(first, ops.constant(rng.standard_normal((576, 1536), dtype=np.float32)), False,
                                 True)], [x])

    def compressed(name):
        ov.save_model(nncf.compress_weights(model.clone(), mode=nncf.CompressWeightsMode[mode], **extra),
                      tmp_path / f"{name}.xml", compress_to_fp16=False)
        return (tmp_path / f"{name}.bin").read_bytes()

    default = compressed("default")
    with _nncf_path_for(resolve_source(MODEL).config):
        assert os.environ["NNCF_DISABLE_OPTIMIZED_COMPRESSION"] == "1"
        numpy_path = compressed("numpy")
    assert "NNCF_DISABLE_OPTIMIZED_COMPRESSION" not in os.environ
    assert len(default) > 1536 * 576 // 2 and numpy_path == default
    large = type("Config", (), dict(hidden_size=1536, intermediate_size=8960))()
    with _nncf_path_for(large):
        assert "NNCF_DISABLE_OPTIMIZED_COMPRESSION" not in os.environ


@pytest.fixture(scope="module")
def tiny_torch(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=1),
                                                device="cpu", backend="torch")


def test_torch_backend_refuses_to_save_low_bit(tiny_torch, tmp_path):
    with pytest.raises(NotImplementedError, match="does not ship NNCF-compressed torch checkpoints.*backend='openvino'"):
        tiny_torch.save_low_bit(tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["int8_asym", "int4_sym"])
def test_torch_backend_refuses_nncf_formats(tiny_torch, fmt):
    with pytest.raises(LowBitConfigError, match=f"runs fp32, fp16 and bf16 only, not {fmt}.*backend='openvino'"):
        AutoModelForCausalLM.from_pretrained(tiny_torch.source.path, device="cpu", backend="torch",
                                             load_in_low_bit=fmt)


def test_a_saved_model_speculates_with_a_draft_built_from_its_origin(smollm2_path, tmp_path, tokenizer):
    """load_low_bit(..., speculative="self"): the int4 self-draft is compressed from the model the folder was saved
    from (a saved IR cannot be compressed again); output identical to plain greedy. A saved model whose origin is
    gone gets an error naming the way out, before anything loads."""
    import json

    from xpuspec import SpeculativeConfigError
    from xpuspec.cache import METADATA_FILE

    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym")
    saved = model.save_low_bit(tmp_path / "saved")
    spec = AutoModelForCausalLM.load_low_bit(saved, device="cpu", speculative="self")
    assert spec.draft_model.low_bit.format == "int4_sym" and spec.low_bit.format == "int8_asym"
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    plain = spec.generate(ids, max_new_tokens=24, do_sample=False, speculative=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=24, do_sample=False, num_assistant_tokens=3), plain)
    meta = json.loads((saved / METADATA_FILE).read_text())
    (saved / METADATA_FILE).write_text(json.dumps({**meta, "source": str(tmp_path / "gone")}))
    with pytest.raises(SpeculativeConfigError, match="speculative='prompt_lookup' or a separate draft model"):
        AutoModelForCausalLM.from_pretrained(saved, device="cpu", speculative="self")
