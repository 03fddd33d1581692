"""Bad input: each kind raises one exception type, before any model runs, with a message that names
the fix. Generation cases run on SmolLM2 (OpenVINO fp32); model-folder cases on tiny models."""

import json
import logging
import os
import shutil

import pytest
import torch

from xpuspec import (AutoModelForCausalLM, AutoTokenizer, DeviceNotFoundError, DraftMismatchError,
                     GenerationConfigError, InvalidInputError, LowBitConfigError, ModelSourceError, PromptTooLongError,
                     SpeculativeConfigError, UnsupportedArchitectureError, export)
from xpuspec.devices import resolve_device

from tiny import tiny_model

IDS = torch.tensor([[1, 1604, 3987, 46477, 24, 94, 727]])  # "def fibonacci(n):" in SmolLM2's tokenizer


@pytest.mark.parametrize("kwargs, error, phrase", [
    (dict(input_ids=torch.zeros((1, 0), dtype=torch.long)), InvalidInputError, "The prompt is empty"),
    (dict(input_ids=torch.tensor([[1, 49152]])), InvalidInputError,
     r"token id 49152, outside this model's vocabulary \(0..49151\); encode the prompt with this model's own"),
    (dict(input_ids=torch.tensor([[1, -1]])), InvalidInputError, "token id -1, outside"),
    (dict(input_ids=IDS.float()), InvalidInputError, "must be integer token ids, got dtype torch.float32"),
    (dict(input_ids="def fibonacci(n):"), InvalidInputError, "tokenize the text first"),
    (dict(input_ids=IDS, attention_mask=torch.ones((1, 3))), InvalidInputError,
     r"attention_mask has shape \(1, 3\) but input_ids has \(1, 7\); pass the mask the tokenizer returned"),
    (dict(input_ids=IDS, max_new_tokens=0), GenerationConfigError, "max_new_tokens must be at least 1, got 0"),
    (dict(input_ids=IDS, max_new_tokens=-5), GenerationConfigError, "max_new_tokens must be at least 1, got -5"),
    (dict(input_ids=IDS, do_sample=True, temperature=0.0), GenerationConfigError,
     "needs temperature > 0, got 0.0. For greedy decoding pass do_sample=False"),
    (dict(input_ids=IDS, do_sample=True, temperature="hot"), GenerationConfigError, "temperature must be a number, got 'hot'"),
    (dict(input_ids=IDS, top_p="0.9"), GenerationConfigError, "top_p must be a number"),
    (dict(input_ids=torch.ones((1, 8192), dtype=torch.long)), PromptTooLongError,
     r"8192 tokens but the model's context is 8192 \(and one token must fit after it\); shorten the prompt"),
])
def test_bad_generate_input(ov_fp32, kwargs, error, phrase):
    with pytest.raises(error, match=phrase):
        ov_fp32.generate(**{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize("kwargs, error, phrase", [
    (dict(max_length=7), GenerationConfigError, "Input length of input_ids is 7, but max_length is set to 7; increase"),
    (dict(max_length=0), GenerationConfigError, "max_length is set to 0"),
    (dict(max_new_tokens=4, logits_processor=[lambda ids, scores: scores]), NotImplementedError,
     "does not implement logits_processor; leave them out"),
    (dict(max_new_tokens=4, stopping_criteria=[object()]), NotImplementedError, "does not implement stopping_criteria"),
    (dict(max_new_tokens=4, negative_prompt_ids=torch.tensor([[1, 2]])), NotImplementedError,
     "does not implement negative_prompt_ids"),
    (dict(max_new_tokens=4, speculative=True), SpeculativeConfigError,
     "on a model loaded without speculation has nothing to draft with"),
    (dict(max_new_tokens=4, speculative="yes"), TypeError, "speculative must be True, False or None, got 'yes'"),
])
def test_generate_options_that_cannot_apply_are_refused(ov_fp32, kwargs, error, phrase):
    """Options whose meaning xpuspec cannot honour raise instead of being ignored (transformers raises for the
    max_length case too); an empty logits_processor list changes nothing and is accepted."""
    with pytest.raises(error, match=phrase):
        ov_fp32.generate(input_ids=IDS, **kwargs)
    assert ov_fp32.generate(input_ids=IDS, max_new_tokens=2, logits_processor=[], stopping_criteria=None).shape == (1, 9)


def test_torch_module_idioms_and_cache_flags(ov_fp32):
    """eval() and to(the model's own device) are no-ops for code written for torch modules; another device, a
    dtype, or asking for a KV cache back from model(...) (which returns none) is refused."""
    assert ov_fp32.eval() is ov_fp32 and ov_fp32.to("cpu") is ov_fp32 and ov_fp32.to(ov_fp32.device) is ov_fp32
    assert ov_fp32.to("cpu:0", non_blocking=False) is ov_fp32 and ov_fp32.to(device=torch.device("cpu", 0)) is ov_fp32
    for bad in ("cuda", torch.float16):
        with pytest.raises(NotImplementedError, match="places a model when it loads it"):
            ov_fp32.to(bad)
    with pytest.raises(NotImplementedError, match="use_cache=True are not supported"):
        ov_fp32(IDS, use_cache=True)
    assert ov_fp32(IDS, use_cache=False).logits.shape == (1, 7, 49152)


@pytest.mark.parametrize("kwargs, error, phrase", [
    (dict(load_in_low_bit="int4_asym", group_size=64.0), LowBitConfigError, "group_size must be an integer"),
    (dict(load_in_low_bit="int4_asym", group_size="64"), LowBitConfigError, "group_size must be an integer"),
    (dict(load_in_low_bit="int4_asym", group_size=True), LowBitConfigError, "group_size must be an integer"),
    (dict(load_in_low_bit="int4_asym", ratio="0.8"), LowBitConfigError, "ratio must be a number in"),
    (dict(load_in_low_bit="int4_asym", awq="yes"), LowBitConfigError, "awq must be True or False"),
    (dict(speculative="self", draft_low_bit="int3"), LowBitConfigError, "Unknown low-bit format 'int3'"),
    (dict(speculative="self", draft_device="foo"), DeviceNotFoundError, "foo"),
    (dict(speculative="prompt-lookup"), SpeculativeConfigError, "did you mean 'prompt_lookup'"),
    (dict(speculative="draft"), SpeculativeConfigError, "a draft model drafts when speculative= names it"),
    (dict(ov_config="PERFORMANCE_HINT=LATENCY"), TypeError, "ov_config must be a dict of OpenVINO properties"),
    (dict(draft_backend="torch"), SpeculativeConfigError, "draft_backend='torch' given without a draft model"),
    (dict(speculative="prompt_lookup", draft_backend="torch"), SpeculativeConfigError, "without a draft model"),
])
def test_bad_load_options_are_refused_before_the_model_loads(kwargs, error, phrase, monkeypatch):
    """The draft's settings are checked with the target's, before any model is read or compressed."""
    import xpuspec.loading

    def no_load(*args, **kwargs):
        raise AssertionError("the model source was resolved before the options were checked")

    monkeypatch.setattr(xpuspec.loading, "resolve_source", no_load)
    with pytest.raises(error, match=phrase):
        AutoModelForCausalLM.from_pretrained("smollm2-135m-instruct", device="cpu", **kwargs)


def test_bad_forward_input(ov_fp32):
    with pytest.raises(InvalidInputError, match="token id 49152"):
        ov_fp32(torch.tensor([[1, 49152]]))
    with pytest.raises(PromptTooLongError, match="8193 tokens but the model's context is 8192; shorten"):
        ov_fp32(torch.ones((1, 8193), dtype=torch.long))


def test_prompt_longer_than_the_npu_window(ov_fp32, monkeypatch):
    monkeypatch.setattr(ov_fp32.runner, "max_prompt_len", 4)  # what an NPU runner sets (NPUW_LLM_MAX_PROMPT_LEN)
    with pytest.raises(PromptTooLongError, match=r"7 tokens but cpu takes at most 4 .*NPUW_LLM_MAX_PROMPT_LEN"):
        ov_fp32.generate(IDS, max_new_tokens=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=1)


@pytest.fixture(scope="module")
def tiny_torch(tiny):
    return AutoModelForCausalLM.from_pretrained(tiny, device=torch.device("cpu"), backend="torch")


def test_generation_stops_exactly_at_the_context_with_one_warning(tiny_torch, caplog):
    prompt = torch.randint(3, 16, (1, 120), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="xpuspec"):
        out = tiny_torch.generate(prompt, max_new_tokens=20, min_new_tokens=20)
    assert out.shape == (1, 128)  # context 128: 8 new tokens, not 20
    assert [r.getMessage() for r in caplog.records] == [
        "The prompt (120 tokens) plus max_new_tokens (20) exceed the model's context (128 tokens); "
        "generation stops at the context, after at most 8 new tokens."]


def test_torch_device_objects_are_accepted(tiny_torch):
    assert tiny_torch.device_name == "cpu"  # loaded with device=torch.device("cpu")
    assert resolve_device(torch.device("cpu"))[1] == "cpu"
    with pytest.raises(DeviceNotFoundError, match="Unknown device 'cuda'"):
        resolve_device(torch.device("cuda"))
    with pytest.raises(DeviceNotFoundError, match="device must be a name such as 'cpu'.*or a torch.device; got 0"):
        resolve_device(0)


def test_device_typo_in_the_environment_suggests_the_closest(monkeypatch):
    monkeypatch.setenv("XPUSPEC_DEVICE", "gpuu")
    with pytest.raises(DeviceNotFoundError, match="Unknown device 'gpuu'. Did you mean 'gpu'?"):
        resolve_device()


@pytest.mark.parametrize("field", ["eos_token_id", "bos_token_id"])
def test_draft_with_other_special_tokens_is_refused(tiny_torch, tmp_path, field):
    draft = tiny_model(tmp_path / "draft", seed=2)
    config_file = draft / "generation_config.json"
    config = json.loads(config_file.read_text())
    config[field] = 3
    config_file.write_text(json.dumps(config))
    with pytest.raises(DraftMismatchError, match=f"has {field}=3 but the target has {1 if field[0] == 'b' else 2}"):
        tiny_torch.generate(torch.tensor([[1, 5]]), max_new_tokens=2,
                            assistant_model=AutoModelForCausalLM.from_pretrained(draft, backend="torch"))


def _broken(tiny, tmp_path, damage):
    folder = tmp_path / "broken"
    shutil.copytree(tiny, folder)
    damage(folder)
    return folder


def _truncate(path):
    os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize("damage, phrase", [
    (lambda f: (f / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json has no model_type"),
    (lambda f: (f / "model.safetensors").unlink(), r"has config.json but no weights \(model.safetensors"),
    (lambda f: _truncate(f / "model.safetensors"), r"model.safetensors is truncated: \d+ bytes, \d+ expected"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 4), "model.safetensors is not a safetensors file"),
    (lambda f: (f / "config.json").write_text('{"model_type": "no-such-model"}'),
     "transformers cannot read the config of"),
])
def test_broken_model_folder(tiny, tmp_path, damage, phrase):
    folder = _broken(tiny, tmp_path, damage)
    with pytest.raises(ModelSourceError, match=phrase):
        AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="torch")


def test_ir_folder_without_tokenizer(tmp_path):
    (tmp_path / "openvino_model.xml").write_text("<net/>")
    with pytest.raises(ModelSourceError, match=r"has no tokenizer \(none of tokenizer.json.*Copy tokenizer.json"):
        AutoTokenizer.from_pretrained(tmp_path)


def test_unsupported_architecture_is_refused_on_openvino_and_runs_on_torch(tmp_path, monkeypatch):
    from transformers import HeliumConfig, HeliumForCausalLM

    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    HeliumForCausalLM(HeliumConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64)).save_pretrained(tmp_path / "helium")
    phrase = r"cannot export architecture 'helium' to OpenVINO IR.*backend='torch'"
    with pytest.raises(UnsupportedArchitectureError, match=phrase):
        AutoModelForCausalLM.from_pretrained(tmp_path / "helium", device="cpu")
    with pytest.raises(UnsupportedArchitectureError, match=phrase):
        export(tmp_path / "helium", tmp_path / "out", weight_format="int8_asym")
    assert not (tmp_path / "out").exists()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "helium", device="cpu", backend="torch")
    assert model.generate(torch.tensor([[1, 5]]), max_new_tokens=3).shape == (1, 5)


def test_an_export_config_outside_its_transformers_range_is_refused_before_work(tmp_path, monkeypatch):
    """optimum-intel 2.1.0 exports Gemma (1) only with transformers up to 5.0 (a bare ValueError after loading the
    model, before); the range is read from the export config, so the test holds whatever is installed. (Gemma-2
    and Gemma-3 are verified past the cap: tests/test_architectures.py.)"""
    import transformers
    from optimum.exporters.tasks import TasksManager
    from packaging.version import Version
    from transformers import GemmaConfig, GemmaForCausalLM

    config = TasksManager.get_exporter_config_constructor(exporter="openvino", model_type="gemma",
                                                          task="text-generation-with-past", library_name="transformers")
    high = getattr(config.func, "MAX_TRANSFORMERS_VERSION", None)
    if high is None or Version(transformers.__version__) <= Version(str(high)):
        pytest.skip(f"gemma exports with the installed transformers {transformers.__version__}")
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path / "cache"))
    GemmaForCausalLM(GemmaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 max_position_embeddings=64)).save_pretrained(tmp_path / "gemma")
    with pytest.raises(UnsupportedArchitectureError, match=r"exports architecture 'gemma' only with transformers .* "
                                                           r"this environment has .*backend='torch'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "gemma", device="cpu")
    assert not (tmp_path / "cache" / "ov").exists() or not any((tmp_path / "cache" / "ov").rglob("*.xml"))


def test_a_streamer_that_raises_inside_the_native_engine_raises_in_python(smollm2_path):
    """Plain greedy on OpenVINO runs in openvino_genai's C++ loop, which calls the streamer: an exception there
    is raised from generate() (it used to abort the process), and the model decodes again afterwards. Run in a
    subprocess, so that an abort cannot take the test session with it."""
    import subprocess
    import sys

    script = """
import torch
from xpuspec import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("smollm2-135m-instruct", device="cpu", load_in_low_bit="int8_asym")
from xpuspec.runner import RunnerTraits
model.runner.traits = RunnerTraits(fixed_verify_width=True)  # steps one token at a time: openvino_genai's engine decodes
class Failing:
    calls = 0
    def put(self, value):
        Failing.calls += 1
        if Failing.calls == 3:
            raise RuntimeError("streamer failed")
    def end(self):
        pass
ids = torch.tensor([[1, 1604, 3987, 46477, 24, 94, 727]])
try:
    model.generate(input_ids=ids, max_new_tokens=8, streamer=Failing())
except RuntimeError as exc:
    print("raised:", exc)
out = model.generate(input_ids=ids, max_new_tokens=4)
print("again:", tuple(out.shape), model.last_generate_stats.engine)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised: streamer failed" in done.stdout and "again: (1, 11) native" in done.stdout, done.stdout


def test_an_xpuspec_model_as_a_transformers_assistant_is_refused_clearly(tmp_path):
    import transformers

    folder = tiny_model(tmp_path / "m", seed=1)
    target = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ours = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="torch")
    with pytest.raises(TypeError, match="cannot be the assistant_model of a transformers model.*xpuspec too"):
        target.generate(torch.tensor([[1, 4, 5]]), assistant_model=ours, max_new_tokens=4, do_sample=False)
