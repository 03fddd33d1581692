"""Draft lengths for a batch of requests verified in one pass, chosen by goodput.

At batch B one verify pass holds every row's tokens, ``W = sum_i w_i``, and its cost ``C(W)`` grows with the batch
(the target turns compute-bound), so drafts that pay at batch 1 may not pay in a full batch. Following SmartSpec
(Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large Language Models Using Goodput"), the lengths
k_i maximize the whole step's goodput,

    G(k) = sum_i E_i(k_i) / (C(sum_i w_i(k_i)) + sum_i k_i h_i),

with E_i the expected tokens of row i (:func:`~xpuspec.speculative.policy.expected_tokens` over its rates), h_i
its drafted token's cost (0 when free) and ``C`` the target's measured per-width profile, extended to batch widths
(:func:`~xpuspec.speculative.profile.measure_profile` over :data:`BATCH_SWEEP_WIDTHS`, on one sequence, whose pass of
width W costs about what a batch of total width W does). A greedy ascent adds one draft at a time to the row that
raises G most, and stops when no draft raises it: rows draft less as the batch fills. Lengths are capped by each
row's own policy.
"""

from dataclasses import dataclass
from typing import List, Sequence

from .policy import expected_tokens
from .profile import CostProfile

#: Widths the batch profile times: the single-request sweep's, then batch widths.
BATCH_SWEEP_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class RowChoice:
    """One row's options for the step.

    Attributes:
        rates: conditional acceptance rates of its draft positions 1..``cap``.
        draft_step: seconds per drafted token (0 for free drafts).
        cap: the most drafts (its own policy's width, or the free tokens found).
        base_width: tokens it feeds without drafts (the target's 1-token width).
        base_tokens: tokens it yields without drafts (1, plus a free guess's expectation).
    """

    rates: Sequence[float]
    draft_step: float
    cap: int
    base_width: int = 1
    base_tokens: float = 1.0


def batch_draft_lengths(rows: Sequence[RowChoice], profile: CostProfile) -> List[int]:
    """The drafts per row that maximize the step's goodput (see the module docstring)."""
    k = [0] * len(rows)
    widths = [r.base_width for r in rows]
    tokens = [r.base_tokens for r in rows]
    drafting = 0.0

    def gain(i: int):
        """What one more draft in row i adds: tokens, width, drafting seconds; and the row's tokens then."""
        row, n = rows[i], k[i] + 1
        new_tokens = expected_tokens(row.rates, n)
        return (new_tokens - tokens[i], max(row.base_width, n + 1) - widths[i], row.draft_step, new_tokens)

    best = sum(tokens) / max(profile.pass_s(sum(widths)), 1e-12)
    while True:
        choice, choice_rate = None, best * (1 + 1e-9)
        total_tokens, total_width = sum(tokens), sum(widths)
        for i, row in enumerate(rows):
            if k[i] >= row.cap:
                continue
            d_tokens, d_width, d_draft, _ = gain(i)
            rate = (total_tokens + d_tokens) / max(profile.pass_s(total_width + d_width) + drafting + d_draft, 1e-12)
            if rate > choice_rate:
                choice, choice_rate = i, rate
        if choice is None:
            return k
        d_tokens, d_width, d_draft, new_tokens = gain(choice)
        k[choice] += 1
        tokens[choice], widths[choice] = new_tokens, widths[choice] + d_width
        drafting += d_draft
        best = choice_rate
