"""Pipeline-parallel stages on OpenVINO: SmolLM2 split over two real devices (the CPU plugin
registered a second time as ``cpux``) gives the unsplit model's logits and greedy text, each
stage holds only its own layers, and bad plans are refused before any slow work. (2 and 3 stages in int8 and
int4 on every test prompt: tests/test_stage_numerics.py.)"""

import pytest
import torch

from xpuspec import AutoModelForCausalLM
from xpuspec.errors import DeviceNotFoundError, PipelineConfigError
from xpuspec.stages import balanced_split

from conftest import MODEL, PROMPTS

INT8 = dict(load_in_low_bit="int8_asym")


@pytest.fixture(scope="module")
def cpux(monkeypatch_module):
    monkeypatch_module.setenv("XPUSPEC_CPU_ALIASES", "cpux")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def whole(smollm2_path):
    """The whole model with its defaults: the stages run on paged attention with the same compile properties."""
    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", **INT8)


@pytest.fixture(scope="module")
def split(smollm2_path, cpux):
    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu,cpux", **INT8)


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([1] * 30, 0, 0, 2) == [15, 15]
    assert balanced_split([1] * 30, 10, 0, 2) == [10, 20]
    assert balanced_split([1, 1, 1, 1, 1], 0, 0, 5) == [1, 1, 1, 1, 1]
    assert balanced_split([1] * 7, 0, 3, 3) == [3, 3, 1]


def test_split_matches_the_whole_model(whole, split, tokenizer):
    assert split.device_name == "cpu,cpux"
    assert [s["execution_devices"] for s in split.device_map] == [["CPU"], ["CPUX"]]
    for prompt in PROMPTS[:2]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert torch.equal(whole(ids).logits, split(ids).logits)  # the same function, bit for bit
        expected = whole.generate(ids, max_new_tokens=64, do_sample=False)
        assert torch.equal(split.generate(ids, max_new_tokens=64, do_sample=False), expected)


def test_each_stage_holds_only_its_layers(whole, split):
    config = whole.config
    layers = [s["layers"] for s in split.device_map]
    assert layers == [[0, 15], [15, 30]]  # 30 equal layers, embedding and tied head balance out
    total = whole.device_map[0]["weight_bytes"]
    stage_bytes = [s["weight_bytes"] for s in split.device_map]
    embedding = config.vocab_size * config.hidden_size  # int8: one byte per weight
    assert config.tie_word_embeddings  # so both ends hold the embedding matrix
    assert abs(sum(stage_bytes) - total - embedding) < 0.02 * embedding
    for b in stage_bytes:
        assert abs(b - (total + embedding) / 2) < 0.02 * total


def test_speculation_on_a_split_target_stays_identical(split, whole, tokenizer):
    ids = tokenizer(PROMPTS[2], return_tensors="pt").input_ids
    expected = whole.generate(ids, max_new_tokens=48, do_sample=False)
    out = split.generate(ids, max_new_tokens=48, do_sample=False, prompt_lookup_num_tokens=4,
                         num_assistant_tokens_schedule="constant")
    assert torch.equal(out, expected)
    assert split.last_generate_stats.drafted_tokens > 0


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(device="cpu", pipeline_parallel_stages=31), PipelineConfigError, "31 pipeline stages for a model of 30 layers"),
    (dict(device="cpu,cpu", split=[10, 10]), PipelineConfigError, "sum to the model's 30 layers"),
    (dict(device="cpu,cpu", split=[30, 0]), PipelineConfigError, "at least 1 layer"),
    (dict(device="cpu", split=[15, 15]), PipelineConfigError, "one layer count per stage"),
    (dict(device="cpu,cpu", pipeline_parallel_stages=3), PipelineConfigError, "names 2 devices"),
    (dict(device="cpu,cpu", split="15,15"), PipelineConfigError, "list of integer layer counts"),
    (dict(device="cpu,cpu", split=[15.0, 15.0]), PipelineConfigError, "list of integer layer counts"),
    (dict(device="cpu,cpuz"), DeviceNotFoundError, "XPUSPEC_CPU_ALIASES=cpuz"),
    (dict(device="cpu,gpu.3"), DeviceNotFoundError, "'gpu.3' is not available"),
    (dict(device="cpu,,cpu"), DeviceNotFoundError, "empty entry"),
    (dict(device="cpu", pipeline_parallel_stages=0), PipelineConfigError, "integer >= 1"),
])
def test_bad_pipeline_plans_are_refused(smollm2_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        AutoModelForCausalLM.from_pretrained(MODEL, **INT8, **kwargs)
