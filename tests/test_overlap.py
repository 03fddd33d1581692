"""Overlapped speculation (PEARL-style): the draft drafts ahead in its own thread while the target
verifies. Greedy output stays token-identical to plain greedy decoding on the real SmolLM2, with
the draft on a second device and with the target split into pipeline stages; the worker's
bookkeeping (keep, restart, errors) is checked on a deterministic fake draft."""

import threading
import time

import pytest
import torch

from xpuspec import AutoModelForCausalLM, SpeculativeConfig
from xpuspec.speculative.drafters import DraftRequest, ModelDrafter
from xpuspec.speculative.overlap import OverlappedDrafter
from xpuspec.speculative.policy import Widths

from conftest import MODEL, PROMPTS

VOCAB = 16
ALWAYS = dict(num_assistant_tokens=4, cost_model=False)


class CountingDraft(ModelDrafter):
    """A fake draft whose next token is (last + 1) % VOCAB; optionally fails on a given token."""

    def __init__(self, fail_on=None):
        self.vocab_size, self.fail_on, self.calls, self.context_length = VOCAB, fail_on, 0, 0

    def begin(self, request):
        pass

    def next_logits(self, context):
        self.calls += 1
        if context[-1] == self.fail_on:
            raise ValueError("draft broke")
        logits = torch.zeros(1, VOCAB)
        logits[0, (context[-1] + 1) % VOCAB] = 1.0
        return logits


def _score(prefix, logits):
    return logits


def _begun(drafter, context):
    drafter.begin(DraftRequest(context, _score, False))
    return drafter


def test_worker_keeps_confirmed_drafts_and_restarts_after_a_mismatch():
    context = [1, 2]
    drafter = _begun(OverlappedDrafter(CountingDraft(), max_ahead=4), context)
    try:
        draft = drafter.propose(Widths(3, 0))
        assert draft.tokens[0] == 3 and draft.tokens == [3, 4, 5][:len(draft.tokens)] and draft.probs is None
        # the target accepted 3 and 4 and chose 5 itself: the draft is on track, its next token is 6
        context += [3, 4, 5]
        assert drafter.propose(Widths(2, 0)).tokens[0] == 6
        # the target rejected at once and chose 9: everything drafted ahead is dropped
        context.append(9)
        assert drafter.propose(Widths(2, 0)).tokens[0] == 10
    finally:
        drafter.end()
    assert not any(t.name == "xpuspec-draft" for t in threading.enumerate())


def test_worker_stops_at_max_ahead():
    draft = CountingDraft()
    drafter = _begun(OverlappedDrafter(draft, max_ahead=3), [0])
    drafter.propose(Widths(1, 0))
    for _ in range(100):
        if len(drafter._ahead) >= 3:
            break
        threading.Event().wait(0.01)
    calls = draft.calls
    threading.Event().wait(0.1)
    drafter.end()
    assert draft.calls == calls == 3


def test_worker_failure_reaches_the_decode_loop():
    drafter = _begun(OverlappedDrafter(CountingDraft(fail_on=2)), [1, 2])
    with pytest.raises(RuntimeError, match="draft worker failed") as info:
        drafter.propose(Widths(2, 0))
    assert isinstance(info.value.__cause__, ValueError)
    drafter.end()


@pytest.fixture(scope="module")
def cpu_aliases():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XPUSPEC_CPU_ALIASES", "cpux,cpuy")
        yield


def _check_identical(model, tokenizer, prompts, overlapped=True):
    """Identity, and (``overlapped``) the draft's busy time against what the test sees: each token the target was
    offered came from one draft step of the worker thread (counted here), and the worker was busy no longer than the
    call lasted."""
    drafted = 0
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, max_new_tokens=64, do_sample=False, speculative=False)
        worker_steps = []
        next_logits = ModelDrafter.next_logits

        def counted(self, prefix):
            if threading.current_thread().name == "xpuspec-draft":
                worker_steps.append(len(prefix))
            return next_logits(self, prefix)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ModelDrafter, "next_logits", counted)
            start = time.perf_counter()
            assert torch.equal(model.generate(ids, max_new_tokens=64, do_sample=False), expected), prompt
            wall = time.perf_counter() - start
        stats = model.last_generate_stats
        drafted += stats.drafted_tokens
        assert stats.drafted_tokens > 0
        if overlapped:
            assert len(worker_steps) >= stats.drafted_tokens, (len(worker_steps), stats.drafted_tokens)
            assert 0 < stats.draft_busy_s <= wall and all(0 <= f <= 1 for f in stats.idle_fractions.values())
    assert drafted > 12 * len(prompts)  # speculation really ran (a worker's blocks are as long as it kept ahead)


def test_busy_time_is_the_sum_of_the_draft_steps(monkeypatch):
    """On a stand-in clock that advances 0.5 s per reading, each worker step is busy exactly 0.5 s."""
    from xpuspec.speculative import overlap

    readings = iter(range(10**6))
    monkeypatch.setattr(overlap.time, "perf_counter", lambda: 0.5 * next(readings))
    draft = CountingDraft()
    drafter = _begun(OverlappedDrafter(draft, max_ahead=3), [0])
    assert drafter.propose(Widths(1, 0)).tokens[0] == 1
    for _ in range(1000):
        if len(drafter._ahead) >= 3:
            break
        threading.Event().wait(0.01)
    drafter.end()
    assert draft.calls == 3 and drafter.busy_s == 0.5 * draft.calls


def _self_draft_on_cpux():
    spec = SpeculativeConfig(mode="self", draft_device="cpux", **ALWAYS)  # overlap: on by default here
    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym", speculative=spec,
                                                ov_config={"INFERENCE_NUM_THREADS": 1})


def test_overlapped_self_draft_on_another_device_is_identical(smollm2_path, tokenizer, cpu_aliases):
    _check_identical(_self_draft_on_cpux(), tokenizer, PROMPTS, overlapped=False)


def test_overlapped_self_draft_on_another_device_drafts_in_its_own_thread(smollm2_path, tokenizer, cpu_aliases):
    _check_identical(_self_draft_on_cpux(), tokenizer, PROMPTS[:1])


def test_overlapped_rows_of_a_batch_draft_in_workers_of_their_own_and_equal_their_prompts_alone(
        smollm2_path, tokenizer, cpu_aliases):
    """Four rows, four workers drafting at once on the draft model's one compiled model (its runner runs one pass
    at a time): each row's tokens are its prompt's plain greedy tokens alone."""
    model = _self_draft_on_cpux()
    alone = [model.generate(tokenizer(p, return_tensors="pt").input_ids, max_new_tokens=32, do_sample=False,
                            speculative=False)[0].tolist() for p in PROMPTS]
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    workers = set()
    next_logits = ModelDrafter.next_logits

    def counted(self, prefix):
        if threading.current_thread().name == "xpuspec-draft":
            workers.add(threading.get_ident())
        return next_logits(self, prefix)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelDrafter, "next_logits", counted)
        out = model.generate(**batch, max_new_tokens=32, do_sample=False)
    width = batch.input_ids.shape[1]
    for row, want, mask in zip(out.tolist(), alone, batch.attention_mask.tolist()):
        prompt_len = sum(mask)
        new = want[prompt_len:]
        assert row[width:width + len(new)] == new
    assert len(workers) >= 2 and model.last_generate_stats.drafted_tokens > 0


def test_overlap_with_a_split_target_is_identical(smollm2_path, tokenizer, cpu_aliases):
    spec = SpeculativeConfig(mode="self", draft_device="cpuy", overlap=True, **ALWAYS)
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu,cpux", load_in_low_bit="int8_asym",
                                                 speculative=spec)
    assert [s["device"] for s in model.device_map] == ["cpu", "cpux"]
    _check_identical(model, tokenizer, PROMPTS[:2])


def test_overlap_needs_a_draft_model():
    with pytest.raises(ValueError, match="overlap=True needs a draft model"):
        SpeculativeConfig(mode="prompt_lookup", overlap=True)
