"""Verification (xpuspec.speculative.verify): rejection sampling keeps the target's distribution whatever the
draft's (and the test catches a broken rule); greedy acceptance takes the longest matching prefix."""

import pytest
import torch

from xpuspec.speculative.verify import greedy_accept, rejection_sample


def tv(counts_a: torch.Tensor, counts_b: torch.Tensor) -> float:
    """Total-variation distance between two count (or probability) vectors."""
    return 0.5 * float((counts_a / counts_a.sum() - counts_b / counts_b.sum()).abs().sum())


def _first_token_counts(sampler, trials, vocab):
    counts = torch.zeros(vocab)
    for _ in range(trials):
        counts[sampler()] += 1
    return counts


def broken_always_accept(drafts, draft_probs, target_probs, generator=None):
    """A wrong acceptance rule (accepts every draft) that the statistical test must catch."""
    return len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1))


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("rule, lossless", [(rejection_sample, True), (broken_always_accept, False)])
def test_rejection_sampling_follows_the_target_distribution(rule, lossless, cut):
    """First token of a 3-token draft round: its distribution must equal p_0 whatever q is, also a q that is 0
    on half the vocabulary (``cut``: a draft head that scores only some tokens, xpuspec.speculative.vocab).

    TV distance between two empirical distributions of N samples over V outcomes is about
    sqrt(V / (2 pi N)) under the null; with V=8, N=20000 that is ~0.008, so 0.03 is a safe bound,
    while the broken rule lands at TV(q_0, p_0) = 0.4 or more by construction.
    """
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 8, 20000
    p = torch.softmax(torch.randn(4, vocab, generator=gen) * 2, dim=-1)
    q_logits = torch.randn(3, vocab, generator=gen) * 2
    if cut:
        q_logits[:, vocab // 2:] = float("-inf")
    q = torch.softmax(q_logits, dim=-1)
    assert tv(p[0], q[0]) > 0.4

    def speculative():
        drafts = [int(torch.multinomial(q[i], 1)) for i in range(3)]
        n, token = rule(drafts, q, p)
        return drafts[0] if n > 0 else token

    observed = _first_token_counts(speculative, trials, vocab)
    direct = _first_token_counts(lambda: int(torch.multinomial(p[0], 1)), trials, vocab)
    assert (tv(observed, direct) < 0.03) == lossless


def test_deterministic_drafts_are_lossless_too():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, 6, generator=gen) * 2, dim=-1)
    counts = _first_token_counts(lambda: (lambda n, t: 3 if n else t)(*rejection_sample([3], None, p)), 20000, 6)
    assert tv(counts, p[0] * 20000) < 0.03


def test_greedy_accept():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert greedy_accept([1, 2], scores) == (2, 0)
    assert greedy_accept([1, 0], scores) == (1, 2)
    assert greedy_accept([], scores[:1]) == (0, 1)
