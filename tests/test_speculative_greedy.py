"""Greedy speculative decoding on the real SmolLM2 is token-identical to plain greedy decoding
of the same target, for every drafter, and the audit reports no VIOLATION. Rollback leaves the
KV cache exactly as a fresh forward over the accepted prefix would."""

import pytest
import torch

from xpuspec import AutoModelForCausalLM, SpeculativeConfig
from xpuspec.speculative.audit import IDENTICAL, TIE, VIOLATION, audit

from conftest import MODEL

#: 4 code prompts (HumanEval-style) and 4 prose prompts.
PROMPTS_8 = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef normalize(x):",
    'def has_close_elements(numbers, threshold):\n    """Check if any two numbers are closer than threshold."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The history of the printing press begins",
    "Photosynthesis is the process by which plants",
]
#: Speculation always on (no cost model), so that every round really drafts and verifies.
ALWAYS = dict(num_assistant_tokens=4, cost_model=False)


def _audit_all(model, tokenizer, prompts=PROMPTS_8, **kwargs):
    results = [audit(model, tokenizer(p, return_tensors="pt").input_ids, max_new_tokens=64, **kwargs)
               for p in prompts]
    assert not [r for r in results if r.status == VIOLATION], [(r.first_difference, r.margin) for r in results]
    assert sum(r.stats.drafted_tokens for r in results) > 100  # speculation really ran
    return results


@pytest.fixture(scope="module")
def int8_target(smollm2_path):
    spec = SpeculativeConfig(mode="hybrid", **ALWAYS)  # its draft model is the int4_sym self-draft
    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym", speculative=spec)


def test_self_speculation_int4_draft_is_identical(int8_target, tokenizer):
    assert int8_target.draft_model.low_bit.format == "int4_sym"
    results = _audit_all(int8_target, tokenizer, assistant_model=int8_target.draft_model)
    assert all(r.status == IDENTICAL for r in results)
    # acceptance 0.50-0.55 on the AVX2 CPU, 0.497 (334 / 672) on the AMX Xeon with dynamic quantization
    assert sum(r.stats.accepted_tokens for r in results) / sum(r.stats.drafted_tokens for r in results) > 0.45


# Prompt lookup, hybrid and layer-skip speculation of the int8_asym target on these 8 prompts are audited token for
# token in test_exactness.py (test_prompt_lookup_output_is_plain_output[int8_asym-None] and
# test_speculative_output_is_plain_output[int8_asym-None-hybrid / -layer_skip], the same configurations as ALWAYS
# here), which also checks the layer-skip draft's layers and format.


def test_torch_fp32_target_with_openvino_int4_draft_is_identical(smollm2_path, tokenizer):
    spec = SpeculativeConfig(mode="self", **ALWAYS)
    target = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", backend="torch", draft_backend="openvino",
                                                  speculative=spec)
    assert (target.backend_name, target.draft_model.backend_name) == ("torch", "openvino")
    assert target.draft_model.low_bit.format.startswith("int4")
    # 2 code and 2 prose prompts: the torch fp32 target's plain runs are the slowest of the module; what this adds to
    # the OpenVINO audits is the mixed backends, which every round exercises
    results = _audit_all(target, tokenizer, PROMPTS_8[::2])
    assert all(r.status in (IDENTICAL, TIE) for r in results)


def test_audit_flags_a_violation(int8_target, tokenizer, monkeypatch):
    """The audit must be able to fail: a verifier that accepts every draft changes the output."""
    from xpuspec import decode

    monkeypatch.setattr(decode, "greedy_accept", lambda drafts, scores: (len(drafts), int(scores[-1].argmax())))
    ids = tokenizer(PROMPTS_8[4], return_tensors="pt").input_ids
    result = audit(int8_target, ids, max_new_tokens=32, assistant_model=int8_target.draft_model)
    assert result.status == VIOLATION and result.margin > 1e-3


@pytest.mark.parametrize("backend", ["openvino", "torch"])
def test_rollback_equals_a_fresh_forward(smollm2_path, tokenizer, backend):
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", backend=backend)
    runner = model.runner
    prefix = tokenizer(PROMPTS_8[0]).input_ids
    drafts = tokenizer(" return n if n < 2 else", add_special_tokens=False).input_ids[:5]
    probe = tokenizer(" x", add_special_tokens=False).input_ids
    for n in range(len(drafts) + 1):
        runner.reset()
        runner.forward(prefix)
        runner.forward(drafts)
        runner.rollback(len(drafts) - n)
        assert runner.length == len(prefix) + n
        after = runner.forward(probe)[-1]
        runner.reset()
        fresh = runner.forward(prefix + drafts[:n] + probe)[-1]
        assert torch.allclose(after, fresh, atol=1e-3), (n, float((after - fresh).abs().max()))


@pytest.fixture(scope="module")
def sdpa_int8(smollm2_path):
    """The stateful SDPA runner (a paged KV cache rolls back by its length alone), loaded once for the 3 cases."""
    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                ov_config={"ATTENTION_BACKEND": "SDPA"})


@pytest.mark.parametrize("max_dead_slots", [0, 3, 1000])
def test_masked_rollback_over_many_rounds_equals_a_fresh_forward(sdpa_int8, tokenizer, max_dead_slots):
    """Rejected slots masked out round after round (holes inside the cache), with compaction
    on every rollback (0), now and then (3: it gathers non-contiguous live slots) or never (the
    stateful SDPA runner; a paged KV cache rolls back by its length alone)."""
    runner = sdpa_int8.runner
    runner.max_dead_slots = max_dead_slots
    ids = tokenizer(PROMPTS_8[2] + "    for i in range(len(numbers)):\n        for j in range(i)").input_ids
    prefix, rest = ids[:12], ids[12:]
    runner.reset()
    runner.forward(prefix)
    live, dead_seen = list(prefix), 0
    for keep, block in ((1, rest[0:4]), (3, rest[1:5]), (0, rest[4:6]), (2, rest[4:9])):
        runner.forward(block)
        runner.rollback(len(block) - keep)
        live += block[:keep]
        dead_seen = max(dead_seen, runner.dead_slots)
        assert runner.length == len(live) and runner.dead_slots <= max_dead_slots
    assert dead_seen == min(max_dead_slots, 3 + 1 + 2 + 3)
    after = runner.forward(rest[9:11])
    runner.reset()
    fresh = runner.forward(live + rest[9:11])[-2:]
    assert torch.allclose(after, fresh, atol=1e-3), float((after - fresh).abs().max())


def test_speculation_switched_off_hands_the_rest_to_the_native_engine(smollm2_path, tokenizer, monkeypatch):
    """speculative="self" with the cost model on: where the policy stops the draft model and the handover
    pays (forced here), openvino_genai decodes the rest (min_new_tokens unset, so its remainder must not go
    negative); same tokens. The runner steps one token at a time here, so that the engine may decode."""
    from xpuspec.runner import RunnerTraits
    from xpuspec.speculative import policy
    from xpuspec.speculative.profile import TargetCosts

    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym", speculative="self",
                                                 ov_config={"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    monkeypatch.setattr(model.runner, "traits", RunnerTraits(fixed_verify_width=True))
    monkeypatch.setattr(TargetCosts, "hand_over_pays", lambda self, remaining, context: True)
    monkeypatch.setattr(policy, "SPEEDUP_TO_KEEP", float("inf"))  # the draft model never pays
    engines = []
    for prompt in PROMPTS_8[4:7]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, max_new_tokens=48, do_sample=False, speculative=False)
        assert model.last_generate_stats.engine == "native" and model._costs.native_step_s > 0
        assert torch.equal(model.generate(ids, max_new_tokens=48, do_sample=False), expected), prompt
        engines.append(model.last_generate_stats.engine)
    assert engines[0] == "native after speculation"


def test_paused_prompt_lookup_is_identical(smollm2_path, tokenizer, monkeypatch):
    """With the cost model on, prompt lookup that does not pay is paused and probed again, so plain steps alternate
    with padded verify passes. Every probe judged a failure here (2, 4, 8 ... tokens of pause); the output stays
    the plain greedy output, on real input-grounded prompts."""
    from xpuspec.bench.prompts import select
    from xpuspec.speculative import policy

    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                 speculative="prompt_lookup")
    monkeypatch.setattr(policy, "expected_tokens", lambda rates, k: 0.0)  # no lookup round can pay
    model._policies.step_width = 1  # as if a 1-token lookup round cost more than a plain step (else never paused)
    for prompt in select({"edit": 2})["edit"]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, max_new_tokens=64, min_new_tokens=64, speculative=False)
        got = model.generate(ids, max_new_tokens=64, min_new_tokens=64)
        assert torch.equal(got, expected), prompt[:60]
        stats = model.last_generate_stats
        assert stats.lookup_pauses >= 2 and stats.drafted_tokens > 0, stats.summary()


def test_hybrid_drops_its_draft_model_and_goes_on_with_prompt_lookup(smollm2_path, tokenizer, monkeypatch):
    """Where the policy finds the draft model cannot pay (forced here), a hybrid stops the draft model and keeps
    prompt lookup; after two such requests the next skips the draft model but still looks up. Output identical to
    plain greedy throughout."""
    from xpuspec.bench.prompts import select
    from xpuspec.speculative import policy

    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym", speculative="hybrid")
    monkeypatch.setattr(policy, "SPEEDUP_TO_KEEP", float("inf"))
    monkeypatch.setattr(policy, "MIN_JUDGED_ROUNDS", 1)  # the first model round decides, whatever lookup covered
    ids = tokenizer(select({"edit": 1})["edit"][0], return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=48, min_new_tokens=48, speculative=False)
    runs = []
    for _ in range(3):
        assert torch.equal(model.generate(ids, max_new_tokens=48, min_new_tokens=48), expected)
        runs.append(model.last_generate_stats)
        assert model.last_generate_stats.accepted_tokens > 10  # lookup copies from the function's source
    assert runs[0].draft_model_stopped_after is not None and runs[1].draft_model_stopped_after is not None
    assert runs[2].draft_model_skipped and runs[2].draft_model_stopped_after is None
