"""The paged-attention runner on the real SmolLM2: its logits agree with the stateful SDPA model's,
its KV cache grows and rolls back exactly, and openvino_genai's paged-attention engine (its plain
greedy engine) gives the tokens of its own loop."""

import pytest
import torch

from xpuspec import AutoModelForCausalLM, SpeculativeConfig
from xpuspec.errors import GenerationConfigError, PipelineConfigError, PromptTooLongError
from xpuspec.runner import RunnerTraits

from conftest import MODEL, PROMPTS

SDPA = {"ATTENTION_BACKEND": "SDPA"}


@pytest.fixture(scope="module")
def paged(ov_int8):
    assert type(ov_int8.runner).__name__ == "PagedRunner"  # the default for a whole model on the CPU
    return ov_int8.runner


@pytest.fixture(scope="module")
def exact_paged(smollm2_path):
    """Paged, without dynamic quantization (as the stateful model runs)."""
    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                ov_config={"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}).runner


def test_paged_logits_match_the_stateful_model(smollm2_path, tokenizer, exact_paged):
    """Both without dynamic quantization (the stateful model's default): the same computation."""
    paged = exact_paged
    sdpa = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym", ov_config=SDPA)
    assert type(sdpa.runner).__name__ == "OpenVINORunner"
    assert sdpa.runner.configs[0]["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 0
    ids = tokenizer(PROMPTS[2]).input_ids
    for runner in (paged, sdpa.runner):
        runner.reset()
    a, b = paged.forward(ids), sdpa.runner.forward(ids)
    assert a.shape == b.shape == (len(ids), paged.vocab_size)
    assert float((a - b).abs().max()) < 1e-3
    step_a, step_b = paged.forward([int(a[-1].argmax())]), sdpa.runner.forward([int(b[-1].argmax())])
    assert float((step_a - step_b).abs().max()) < 1e-3


def test_single_steps_compute_as_a_wide_pass_does(paged, tokenizer):
    """16 one-token passes give the logits of one 16-token pass over the same tokens: on CPUs where the
    plugin's 1-token kernel differs (dynamic quantization on AVX512-VNNI/AMX: up to 1.03 apart) the runner
    pads them to 2 tokens, and openvino_genai's one-token engine is then not used. With split steps, 16 steps
    (``forward_steps``, each padded to the runner's threads) give one 16-token split pass's logits bit for bit,
    more than 32 tokens (one KV block) into the context."""
    ids = tokenizer(" ".join(PROMPTS * 2)).input_ids
    assert len(ids) > 16 + 32
    paged.reset()
    paged.forward(ids[:-16])
    wide = paged.forward(ids[-16:])
    paged.rollback(16)
    steps = torch.cat([paged.forward([t]) for t in ids[-16:]])
    assert paged.length == len(ids)
    assert float((wide - steps).abs().max()) < 1e-3
    if paged.traits.split_steps:
        paged.rollback(16)
        wide = paged.forward_steps(ids[-16:])
        paged.rollback(16)
        assert torch.equal(torch.cat([paged.forward_steps([t]) for t in ids[-16:]]), wide)
    native_off = paged.traits.single_step_width == 2 or paged.traits.split_steps
    assert (paged.native_greedy(ids, 2, 0, [], lambda t: None) is None) == native_off
    paged.reset()


def test_cache_growth_and_rollback_equal_a_fresh_forward(ov_int8, tokenizer):
    """A one-block cache grows (copying its blocks) across many passes with rollbacks in between."""
    from xpuspec_openvino.paged import PagedRunner

    runner = PagedRunner(ov_int8.backend.core, ov_int8.runner.folder, "cpu", ov_int8.runner.configs[0], capacity=1)
    text = " ".join(PROMPTS) * 3
    ids = tokenizer(text).input_ids
    assert len(ids) > 3 * runner.block_size
    live, pos = [], 0
    for width, keep in ((7, 7), (5, 2), (40, 33), (6, 0), (30, 30), (9, 4)):
        block = ids[pos:pos + width]
        runner.forward(block)
        runner.rollback(width - keep)
        live += block[:keep]
        pos += keep
        assert runner.length == len(live)
    assert runner.capacity >= len(live) + 9 and runner.capacity % runner.block_size == 0
    after = runner.forward(ids[pos:pos + 3])
    runner.reset()
    fresh = runner.forward(live + ids[pos:pos + 3])[-3:]
    assert torch.allclose(after, fresh, atol=1e-3), float((after - fresh).abs().max())
    assert runner.forward(ids[:5], logits_to_keep=1).shape == (1, runner.vocab_size)


def test_native_engine_gives_the_loops_tokens(exact_paged, tokenizer, monkeypatch):
    """openvino_genai's PA engine and xpuspec's loop stepping one token at a time over the same paged model: the
    same 48 tokens (the engine steps one token at a time, so it decodes only for a runner that does)."""
    paged = exact_paged
    monkeypatch.setattr(paged, "traits", RunnerTraits(fixed_verify_width=True))
    for prompt in PROMPTS[:2]:
        ids = tokenizer(prompt).input_ids
        native = paged.native_greedy(ids, 48, 0, [], lambda t: None)  # EOS neither stops nor is masked
        paged.reset()
        logits, loop = paged.forward(ids, logits_to_keep=1), []
        for _ in range(48):
            loop.append(int(logits[-1].argmax()))
            logits = paged.forward(loop[-1:])
        assert native == loop


def test_attention_backend_option_is_checked(smollm2_path):
    from xpuspec_openvino import uses_paged_attention

    assert uses_paged_attention(None, ["cpu", "cpu"]) and uses_paged_attention("pa", ["cpu", "gpu.1"])  # stages too
    assert not uses_paged_attention("SDPA", ["cpu"]) and not uses_paged_attention(None, ["npu"])
    with pytest.raises(PipelineConfigError, match="ATTENTION_BACKEND='PA' cannot run on npu: the NPU runs"):
        uses_paged_attention("PA", ["npu"])
    with pytest.raises(ValueError, match="use 'PA'"):
        AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", ov_config={"ATTENTION_BACKEND": "paged"})


def test_a_kv_cache_precision_the_cpu_refuses_is_named(smollm2_path):
    """An f32 cache under bf16 inference fails to compile in OpenVINO's CPU paged attention (on a Xeon
    with AMX, where bf16 is the plugin's default); xpuspec says so before compiling, on any CPU."""
    with pytest.raises(ValueError, match="KV_CACHE_PRECISION='f32' needs INFERENCE_PRECISION_HINT='f32'"):
        AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                             ov_config={"INFERENCE_PRECISION_HINT": "bf16"})
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                 ov_config={"KV_CACHE_PRECISION": "u8", "ENABLE_CPU_PINNING": True})
    assert model.runner.configs[0]["INFERENCE_PRECISION_HINT"] == "f32"  # xpuspec's default on every CPU
    assert model.runner._wide.get_compiled_model().get_property("ENABLE_CPU_PINNING") is True  # ov_config wins


def test_inference_threads_are_not_pinned(ov_int8):
    """OpenVINO pins its CPU threads by default; a pinned thread whose core also runs other work waits for that
    work's time slices at every parallel region (benchmarks/results/cpu-pinning.md). xpuspec leaves thread
    placement to the operating system, unless ov_config asks for pinning (the test above)."""
    assert ov_int8.runner._wide.get_compiled_model().get_property("ENABLE_CPU_PINNING") is False


def test_a_step_copy_shares_the_kv_cache(ov_int8, tokenizer):
    """One compiled copy until told the widths alternate; the step copy then compiled (and warmed up) reads and
    extends the cache the wide passes wrote, also across a growth of the cache, as a fresh forward computes it."""
    from xpuspec_openvino.paged import PagedRunner

    runner = PagedRunner(ov_int8.backend.core, ov_int8.runner.folder, "cpu", ov_int8.runner.configs[0], capacity=1)
    assert runner.compiled_copies == 1
    ids = tokenizer(" ".join(PROMPTS) * 3).input_ids
    start, end = 40, 40 + runner.block_size + 3  # the steps cross a block boundary: the cache grows
    assert len(ids) >= end
    runner.forward(ids[:start])
    runner.expect_mixed_widths()  # its warm-up passes write past the cache's 40 tokens and keep them
    runner.expect_mixed_widths()  # once
    assert runner.compiled_copies == 2 and runner.length == start
    steps = torch.cat([runner.forward([t]) for t in ids[start:end]])
    assert runner._step is not runner._wide and runner.capacity >= end
    runner.reset()
    fresh = runner.forward(ids[:end])[start:]
    assert torch.allclose(steps, fresh, atol=1e-3), float((steps - fresh).abs().max())


def test_only_alternating_loops_get_a_step_copy(tokenizer):
    """Plain decoding and a target verifying a draft model's rounds keep one compiled copy; a draft model and a
    prompt-lookup target loaded with speculation get the second at load, a target given prompt lookup by generate at
    that request; the output is the plain output."""
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    plain = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym")
    expected = plain.generate(ids, max_new_tokens=24, do_sample=False)
    assert plain.runner.compiled_copies == 1
    lookup = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                  speculative="prompt_lookup")
    assert lookup.runner.compiled_copies == 2  # made at load
    with pytest.raises(NotImplementedError):
        lookup.generate(ids, max_new_tokens=24, num_beams=2)
    assert torch.equal(lookup.generate(ids, max_new_tokens=24, do_sample=False), expected)
    assert lookup.runner.compiled_copies == 2
    drafted = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                   speculative=SpeculativeConfig(mode="self", cost_model=False))
    too_long = torch.full((1, drafted.config.max_position_embeddings + 1), int(ids[0, 0]))
    with pytest.raises(PromptTooLongError):
        drafted.generate(too_long, max_new_tokens=4)
    streamed = []
    with pytest.raises(GenerationConfigError, match="top_k"):  # refused by transformers' processor
        drafted.generate(ids, max_new_tokens=4, do_sample=True, top_k=-1,
                         streamer=type("S", (), {"put": lambda self, x: streamed.append(x), "end": lambda self: 0})())
    assert (drafted.runner.compiled_copies, drafted.draft_model.runner.compiled_copies) == (1, 2) and streamed == []
    assert torch.equal(drafted.generate(ids, max_new_tokens=24, do_sample=False), expected)
    assert (drafted.runner.compiled_copies, drafted.draft_model.runner.compiled_copies) == (1, 2)
    assert torch.equal(plain.generate(ids, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3), expected)
    assert plain.runner.compiled_copies == 2  # generate's own prompt lookup
    del drafted
    hybrid = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                  speculative="hybrid")
    # both at load: the target steps alone whenever the policy leaves the draft model out and lookup drafts
    assert (hybrid.runner.compiled_copies, hybrid.draft_model.runner.compiled_copies) == (2, 2)
    assert torch.equal(hybrid.generate(ids, max_new_tokens=24, do_sample=False), expected)
