"""Numerics that fail loudly: NaN logits are an error naming the format (at load and in eval), bf16 is a format
where the device computes in bfloat16, and optimum-intel's transformers range is compared as optimum-intel does."""

from types import SimpleNamespace

import pytest
import torch

from xpuspec import AutoModelForCausalLM, LowBitConfigError, NumericsError, UnsupportedArchitectureError
from xpuspec.cli import main

from conftest import MODEL, PROMPTS, cpu_computes_bf16
from tiny import tiny_model


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    """A tiny Llama whose final norm is NaN: every logit is NaN, in every format."""
    from transformers import AutoModelForCausalLM as HF

    folder = tiny_model(tmp_path_factory.mktemp("nan"), seed=3)
    model = HF.from_pretrained(folder)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("backend,fmt", [("torch", "fp32"), ("torch", "fp16"), ("openvino", "fp32")])
def test_nan_logits_fail_at_load_naming_the_format(nan_model, backend, fmt):
    with pytest.raises(NumericsError, match=rf"in {fmt} on cpu \({backend} backend\) computes \d+ NaN") as err:
        AutoModelForCausalLM.from_pretrained(str(nan_model), device="cpu", backend=backend, load_in_low_bit=fmt)
    advice = str(err.value).split("perplexity nan). ")[1]
    if fmt == "fp32":  # the widest range failed too: no format to suggest
        assert "weights themselves are likely damaged" in advice and "load_in_low_bit" not in advice
    else:
        assert "load_in_low_bit='fp32'" in advice and fmt not in advice


def test_finite_logits_load(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model(tmp_path, seed=3)), device="cpu", backend="torch")
    assert model.runner.length == 0  # the load probe leaves the KV cache empty


def test_eval_with_nan_logits_exits_with_an_error_naming_the_format(nan_model, tmp_path, monkeypatch, capsys):
    import xpuspec.loading

    monkeypatch.setattr(xpuspec.loading, "check_loaded", lambda *a: None)  # as if NaN appeared only on the text
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 13}" for i in range(300)))
    code = main(["eval", str(nan_model), "--low-bit", "fp16", "--backend", "torch", "--device", "cpu",
                 "--text", str(text), "--tokens", "200", "--context", "64", "--stride", "32", "--prompts", "0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "in fp32 on cpu (text" in err and "NaN" in err and "nan |" not in err


class _Config:
    MIN_TRANSFORMERS_VERSION = "4.57"
    MAX_TRANSFORMERS_VERSION = "5.0"


@pytest.mark.parametrize("installed,refused", [("5.0.0", False), ("5.0", False), ("4.57.0", False),
                                               ("5.0.1", True), ("4.56.2", True), ("5.5.4", True)])
def test_transformers_range_boundary(installed, refused, monkeypatch):
    import transformers
    from xpuspec_openvino.ir import _check_transformers_range

    monkeypatch.setattr(transformers, "__version__", installed)
    if refused:
        with pytest.raises(UnsupportedArchitectureError, match="only with transformers 4.57 to 5.0"):
            _check_transformers_range(_Config, "gemma", "")
    else:
        _check_transformers_range(_Config, "gemma", "")


def test_bf16_on_openvino_cpu(smollm2_path, tokenizer, ov_fp32):
    if not cpu_computes_bf16():
        pytest.skip("this CPU does not compute in bf16 (no AVX512-BF16 or AMX)")
    plain = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", dtype=torch.bfloat16)
    assert plain.low_bit.format == "bf16" and plain.runner.configs[0]["INFERENCE_PRECISION_HINT"] == "bf16"
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    # the public forward pass: it runs the whole prompt whatever the shared fixture's runner holds from other tests
    difference = (plain(ids).logits - ov_fp32(ids).logits).abs().max().item()
    assert 1e-3 < difference < 2.0  # computed in bf16 (not fp32), and close to fp32
    spec = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="bf16", speculative="prompt_lookup")
    for prompt in PROMPTS[:2]:
        ids = tokenizer(prompt, return_tensors="pt")
        want = plain.generate(**ids, max_new_tokens=24, do_sample=False)
        assert spec.generate(**ids, max_new_tokens=24, do_sample=False).tolist() == want.tolist()


def test_bf16_is_refused_where_the_device_lacks_it():
    from xpuspec_openvino import check_bf16

    core = SimpleNamespace(get_property=lambda device, key: ["FP32", "FP16", "INT8"])
    with pytest.raises(LowBitConfigError, match="bf16 on OpenVINO cpu: the device does not compute in bfloat16"):
        check_bf16(core, "cpu")
    with pytest.raises(LowBitConfigError, match="bf16 on OpenVINO gpu.0"):
        check_bf16(core, "gpu.0")


def test_bf16_on_torch(tmp_path):
    folder = str(tiny_model(tmp_path, seed=4))
    model = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="torch", load_in_low_bit="bf16")
    assert next(model.runner.model.parameters()).dtype == torch.bfloat16
    ids = torch.tensor([[1, 5, 6, 7]])
    spec = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="torch", load_in_low_bit="bf16",
                                                speculative="prompt_lookup")
    assert spec.generate(ids, max_new_tokens=12, do_sample=False).tolist() == \
        model.generate(ids, max_new_tokens=12, do_sample=False).tolist()
