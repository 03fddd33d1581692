"""Drafters (xpuspec.speculative.drafters, overlap): what each proposes, and the begin / propose / accept contract."""

import random

import pytest
import torch

from xpuspec.speculative.drafters import Draft, DraftRequest, HybridDrafter, ModelDrafter, PromptLookupDrafter
from xpuspec.speculative.overlap import OverlappedDrafter
from xpuspec.speculative.policy import Widths
from xpuspec.speculative.verify import rejection_sample

from fakes import Masked, Successor, total_variation


def _raw(prefix, logits):
    return logits


def _begun(drafter, context, sample=False, score=_raw):
    drafter.begin(DraftRequest(context, score, sample))
    return drafter


def _lookup(context, k, max_n=2, min_n=1):
    return _begun(PromptLookupDrafter(max_n, min_n), list(context)).lookup(context, k)


def test_prompt_lookup_finds_the_first_longest_match():
    assert _lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [3, 9, 1]  # the first (1, 2), not the latest
    assert _lookup([9, 2, 5, 1, 2, 6, 3, 1, 2], 2) == [6, 3]  # the 2-gram before an earlier 1-gram
    assert _lookup([7, 8, 9], 3) == []
    assert _lookup([5, 6, 5], 2) == [6, 5]
    assert _lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3, 3, 2) == [3, 9, 1]
    assert _lookup([5, 6, 7, 8, 5], 2, 3, 2) == []  # only a 1-gram matches
    assert _lookup([5, 6, 7, 8, 5], 2, 3, 1) == [6, 7]


def _brute_force(context, k, max_n, min_n):
    """The definition: for n from the longest, the first earlier occurrence of the last n tokens, and what followed."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        for start in range(len(context) - n):
            if context[start:start + n] == context[-n:]:
                return context[start + n:start + n + k]
    return []


def test_the_incremental_index_finds_what_a_rescan_finds():
    """The n-gram index grows with the context (as the loop appends) and agrees with a rescan at every length."""
    rng = random.Random(0)
    for trial in range(40):
        vocab, (max_n, min_n) = rng.choice([3, 5, 20]), rng.choice([(3, 2), (3, 1), (2, 2), (4, 1)])
        context = [rng.randrange(vocab) for _ in range(5)]
        lookup = _begun(PromptLookupDrafter(max_n, min_n), context)
        for _ in range(60):
            k = rng.randint(1, 6)
            assert lookup.propose(Widths(0, k)).tokens == _brute_force(context, k, max_n, min_n), (trial, context)
            context.append(rng.randrange(vocab))


def test_a_lookup_draft_is_free_and_deterministic():
    draft = _begun(PromptLookupDrafter(2, 1), [1, 2, 3, 1, 2]).propose(Widths(model=0, free=2))
    assert draft == Draft([3, 1], None, 2)
    assert _begun(PromptLookupDrafter(2, 1), [1, 2, 3, 1, 2]).propose(Widths(model=4, free=0)).tokens == []


def test_a_draft_whose_scored_tokens_are_all_masked_drafts_nothing():
    """A cut head (xpuspec.speculative.vocab) whose every token the processors mask (e.g. its only token is an EOS
    before min_new_tokens): sampling drafts nothing rather than drawing from a NaN distribution."""
    drafter = _begun(ModelDrafter(Masked(4), vocab_size=4), [1, 2], sample=True)
    assert drafter.propose(Widths(3, 0)) == Draft([], None, 0)


def test_a_hybrid_chain_ends_with_prompt_lookup_once_its_drafts_match():
    """A hybrid's draft model stops as soon as its drafts make an n-gram match, and prompt lookup's continuation
    ends the chain (free, one-hot rows when sampling); without a match it drafts its k tokens."""
    runner = Successor(8)
    lookup = PromptLookupDrafter(3, 2)
    hybrid = HybridDrafter(lookup, ModelDrafter(runner, vocab_size=8, extension=PromptLookupDrafter(3, 3)))
    # no n-gram matches at the end of the context; the draft's 3 makes a 2-gram match ([2, 3]), which is not
    # enough, and its 4 a 3-gram match ([2, 3, 4]), which continues 5, 0, 7
    context = [2, 3, 4, 5, 0, 7, 2]
    _begun(hybrid, context)
    assert hybrid.propose(Widths(5, 5)) == Draft([3, 4, 5, 0, 7], None, 3)
    assert (runner.passes, runner.length) == (2, len(context) + 1)  # prefill, one step; none after the match
    _begun(hybrid, context, sample=True)
    draft = hybrid.propose(Widths(5, 5))
    assert draft.tokens == [3, 4, 5, 0, 7] and draft.free == 3
    assert draft.probs.shape == (5, 8) and float(draft.probs[0, 3]) > 0.99 and float(draft.probs[1, 4]) > 0.99
    assert torch.equal(draft.probs[2:], torch.nn.functional.one_hot(torch.tensor([5, 0, 7]), 8).float())
    _begun(hybrid, context + [3, 4])
    assert hybrid.propose(Widths(2, 3)) == Draft([5, 0, 7], None, 3)  # a lookup round: up to the free width
    assert hybrid.propose(Widths(2, 2)).tokens == [5, 0]
    runner.passes = 0
    _begun(hybrid, [3, 4, 7])
    assert hybrid.propose(Widths(3, 3)) == Draft([0, 1, 2], None, 0)  # never matches: k drafts by the model
    assert runner.passes == 3
    assert hybrid.without_model() is lookup and hybrid.uses_model and lookup.without_model() is lookup


def test_a_model_drafter_prefills_only_when_it_first_proposes():
    """begin() runs before the target's prefill and costs the draft nothing; the first propose() prefills it."""
    runner = Successor(8)
    drafter = _begun(ModelDrafter(runner, 8), [1, 5, 6])
    assert runner.passes == 0 and runner.length == 0
    assert drafter.propose(Widths(2, 0)).tokens == [7, 0]
    assert runner.widths == [3, 1]


def test_a_draft_prefills_only_its_context_length():
    """A draft model begun with context_length=4 on a 9-token context prefills its last 4 tokens and follows every
    token after: it proposes what the same draft proposes when the request starts at those 4 tokens."""
    runner = Successor(8)
    context = [1, 5, 6, 7, 5, 6, 2, 3, 4]
    windowed = _begun(ModelDrafter(runner, 8, context_length=4), context)
    context.append(5)
    ahead = windowed.propose(Widths(3, 0)).tokens
    assert windowed.tokens == context[-5:] + ahead[:-1]
    alone = _begun(ModelDrafter(Successor(8), 8), context[-5:])
    assert alone.propose(Widths(3, 0)).tokens == ahead
    _begun(windowed, [1, 5, 6])  # a context shorter than the length: all of it
    windowed.propose(Widths(1, 0))
    assert runner.length == 3


def test_an_overlapped_draft_model_drafts_from_begin_and_follows_the_context():
    """The worker starts drafting at begin() (beside the target's prefill), hands out what it drafted, and
    restarts after a rejection; end() stops it."""
    runner = Successor(8)
    context = [1, 2]
    drafter = _begun(OverlappedDrafter(ModelDrafter(runner, 8), max_ahead=3), context)
    try:
        assert drafter.propose(Widths(2, 0)).tokens[:1] == [3]
        context += [3, 5]  # the target took 3 and then its own 5: the worker restarts after 5
        assert drafter.propose(Widths(2, 0)).tokens[:1] == [6]
    finally:
        drafter.end()
    assert drafter._thread is None


def test_sampling_with_lookup_ended_chains_follows_the_target_distribution():
    """Rejection sampling over hybrid chains that prompt lookup ends (one-hot rows) keeps the target's
    distribution: the first 3 tokens of 4000 sampled requests over a 3-token vocabulary against the exact
    probabilities (TV over 27 sequences: null about sqrt(27 / (2 pi 4000)) = 0.03; uniform rows in place of the
    one-hot ones give 0.079)."""
    vocab, prompt = 3, [0, 1, 2, 0, 1]

    def target(prefix):
        return torch.softmax(torch.tensor([((prefix[-2] * 7 + prefix[-1] * 3 + j * 5) % 11) / 4.0
                                           for j in range(vocab)]), -1)

    class Draft(Successor):
        def forward(self, tokens, logits_to_keep=None, exact=True):
            super().forward(tokens, logits_to_keep, exact)
            return torch.tensor([[((self.held[-1] * 5 + j * 2) % 7) / 3.0 for j in range(vocab)]])

    extension = PromptLookupDrafter(3, 3)
    hybrid = HybridDrafter(PromptLookupDrafter(3, 3), ModelDrafter(Draft(vocab), vocab, extension=extension))
    torch.manual_seed(0)
    counts, trials, ended = {}, 4000, 0
    for _ in range(trials):
        context, out = list(prompt), []
        _begun(hybrid, context, sample=True)
        while len(out) < 3:
            draft = hybrid.propose(Widths(4, 4))
            ended += 0 < draft.free < len(draft.tokens)
            p = torch.stack([target(context + draft.tokens[:i]) for i in range(len(draft.tokens) + 1)])
            n, token = rejection_sample(draft.tokens, draft.probs, p)
            for t in (draft.tokens[:n] + [token])[:3 - len(out)]:
                out.append(t)
                context.append(t)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert ended > trials / 4  # the path under test ran
    assert total_variation(counts, trials, target, prompt, vocab) < 0.06


@pytest.mark.parametrize("sizes", [(0, 1), (2, 3), (1.5, 1)])
def test_bad_ngram_sizes_are_refused(sizes):
    from xpuspec import SpeculativeConfigError

    with pytest.raises(SpeculativeConfigError, match="matching_ngram_size"):
        PromptLookupDrafter(*sizes)
