"""Verification of draft tokens against the target's scores from one forward pass.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then the target's
own next token. Sampling: modified rejection sampling (Leviathan et al. 2023, Algorithm 1;
Chen et al. 2023): accept draft token d with probability min(1, p(d)/q(d)); at the first
rejection draw from norm(max(0, p - q)); if all are accepted draw a bonus token from p.
The output then follows the target distribution p exactly, whatever the draft q.
"""

from typing import List, Optional, Sequence, Tuple

import torch

from ..scoring import argmax_rows


def greedy_accept(drafts: List[int], scores: torch.Tensor) -> Tuple[int, int]:
    """Args:
        drafts: k proposed tokens.
        scores: processed target scores ``[k+1, vocab]``; row i scores the token after ``drafts[:i]``.

    Returns:
        ``(n_accepted, next_token)``: how many drafts match the target's argmax, and the
        target's own token at the first mismatch (or after the last draft).
    """
    return accept_prefix(drafts, argmax_rows(scores))


def accept_prefix(drafts: Sequence[int], best: Sequence[int]) -> Tuple[int, int]:
    """``(n_accepted, next_token)`` of :func:`greedy_accept` from the target's greedy tokens ``best`` (k+1 ints)."""
    n = 0
    for d, b in zip(drafts, best):
        if d != b:
            break
        n += 1
    return n, best[n]


def rejection_sample(drafts: List[int], draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                     generator: Optional[torch.Generator] = None) -> Tuple[int, int]:
    """Args:
        drafts: k proposed tokens.
        draft_probs: ``[k, vocab]`` float32 draft distributions q_i, or ``None`` for a
            deterministic drafter (each q_i is then one-hot on ``drafts[i]``).
        target_probs: ``[k+1, vocab]`` float32 target distributions p_i after the same processing.
        generator: optional ``torch.Generator`` (default: torch's global RNG).

    Returns:
        ``(n_accepted, next_token)``: accepted drafts and the token drawn after them.
    """
    for i, d in enumerate(drafts):
        p = target_probs[i]
        q_d = float(draft_probs[i, d]) if draft_probs is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if u * q_d < float(p[d]):  # u < p(d) / q(d), without dividing by zero
            continue
        if draft_probs is not None:
            residual = torch.clamp(p - draft_probs[i], min=0.0)
        else:
            residual = p.clone()
            residual[d] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual, total = p, float(p.sum())
        return i, int(torch.multinomial(residual / total, 1, generator=generator))
    return len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))
