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


# ---- the greedy fast path: argmax without building processed scores ----

from transformers import GenerationConfig  # noqa: E402

from xpuspec.scoring import LengthRuleScorer, Scorer, argmax_rows, scorer_for  # noqa: E402
from xpuspec.generation import logits_processor  # noqa: E402
from xpuspec.speculative.verify import accept_prefix  # noqa: E402


def _adversarial_rows(vocab=7, seed=0):
    """Rows with ties (at EOS and elsewhere, EOS first or last), NaN, all -inf, EOS the only finite value."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(vocab, generator=gen) for _ in range(4)]
    tie = torch.zeros(vocab)
    tie[[2, 5]] = 3.0  # EOS (2) tied with a later token
    tie_late = torch.zeros(vocab)
    tie_late[[1, 2]] = 3.0  # EOS tied with an earlier token
    eos_only = torch.full((vocab,), float("-inf"))
    eos_only[2] = 0.0
    all_inf = torch.full((vocab,), float("-inf"))
    nan = torch.zeros(vocab)
    nan[4] = float("nan")
    two_eos = torch.zeros(vocab)
    two_eos[[2, 6]] = 5.0  # both EOS ids tied at the top
    two_eos[3] = 4.0
    eos_max = torch.zeros(vocab)
    eos_max[2], eos_max[0], eos_max[4] = 9.0, 1.0, 1.0  # after masking: a tie between 0 and 4
    return torch.stack(rows + [tie, tie_late, eos_only, all_inf, nan, two_eos, eos_max])


def test_argmax_rows_is_torch_argmax_on_ties_nan_and_inf():
    rows = _adversarial_rows()
    for t in (rows, rows.to(torch.float16), rows.to(torch.float64), rows.to(torch.bfloat16), rows[2:5], rows[:, 1:]):
        assert argmax_rows(t) == t.argmax(dim=-1).tolist()
    assert argmax_rows(rows[0]) == [int(rows[0].argmax())]


@pytest.mark.parametrize("eos", [2, [2, 6], [2, 99]])
@pytest.mark.parametrize("prompt_len, min_new", [(3, 0), (3, 4), (3, 20), (10, 5)])
def test_length_rule_best_equals_transformers_processors(eos, prompt_len, min_new):
    """The shortcut (argmax first, mask only an EOS argmax that is forbidden) against transformers' own
    processors, row by row across the minimum length."""
    config = GenerationConfig(do_sample=False, eos_token_id=eos, min_new_tokens=min_new, max_new_tokens=50)
    fast = scorer_for(config, prompt_len)
    assert isinstance(fast, LengthRuleScorer)
    reference = Scorer(logits_processor(config, prompt_len))  # transformers' MinNewTokensLengthLogitsProcessor
    rows = _adversarial_rows()
    for seed in range(3):
        rows = torch.cat([rows, _adversarial_rows(seed=seed + 1)[:4]])
    for produced in range(0, 8):
        context = list(range(prompt_len + produced))
        drafts = [1] * (len(rows) - 1)
        expected = reference.rows(context, drafts, rows).argmax(dim=-1).tolist()
        assert fast.best(context, drafts, rows) == expected
        assert fast.rows(context, drafts, rows).argmax(dim=-1).tolist() == expected
        assert reference.best(context, drafts, rows) == expected


def test_accept_prefix_equals_greedy_accept():
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        k = int(torch.randint(0, 6, (), generator=gen))
        scores = torch.randint(0, 3, (k + 1, 4), generator=gen).float()  # many ties
        drafts = torch.randint(0, 4, (k,), generator=gen).tolist()
        best = scores.argmax(dim=-1).tolist()
        n = 0
        while n < k and drafts[n] == best[n]:
            n += 1
        assert accept_prefix(drafts, argmax_rows(scores)) == greedy_accept(drafts, scores) == (n, best[n])
