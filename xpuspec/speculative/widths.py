"""Draft length from the measured cost of each verify width.

A verify pass of w tokens does not cost w plain steps, nor one: on the 2-core AVX2 CPU (OpenVINO,
paged-attention target, f32 KV cache, context 300, median of 6-16, 2026-12-01) widths 2..6 cost
1.2 / 1.3-1.4 / 1.4-1.6 / 1.8 / 1.9-2.2 plain steps on SmolLM2-135M int8, but 1.2 / 1.4 / 1.7 /
2.3-2.5 / 2.2-2.6 on Qwen2.5-Coder-1.5B int8, whose kernels step up after 4 tokens. A fixed draft
length therefore fits one model and not the other: prompt lookup's k=5 (openvino_genai's) verifies
6 tokens for 2.4 Qwen steps, where k=3 verifies 4 for 1.7 (in-process A/B on 2 code, 2 prose and 2
edit prompts x 32 tokens: 1.09x against 1.19x plain decoding; with the cap below, 1.23x against 1.14x
for k=5 uncapped and 1.15x for k=3, 2 repeats).

So the first speculative request on a target times one pass of each width it may verify, once its
first token is out (:func:`measure_widths`, remembered per target for the process: a single sample per
width, taken at that request's context), and every round drafts at most
:func:`best_draft_length` tokens: the k that maximizes the expected tokens per round over its cost,

    E[tokens](k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k,      cost(k) = k * h + C(k + 1),

with a_j the rate at which draft j is accepted once drafts 1..j-1 were, measured in the request, h the
seconds of a draft step and C(w) the seconds of a w-token verify pass (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding", eq. 1 and section 3.4, where every a_j is one
rate a and E = (1 - a^(k+1)) / (1 - a); here the verify cost is measured per width instead of assumed
constant). Acceptance is not independent: a model draft is right in runs. Qwen2.5-Coder-0.5B drafting
6 tokens for the 1.5B (4 code + 4 prose prompts x 48 tokens, greedy) was accepted at position 1 in 87%
(code) and 73% (prose) of rounds, but at positions 2-6, given the earlier ones, in 92-100% and 64-100%;
21 of 31 code rounds took all 6. One rate for all positions predicts 4.6 tokens for such a code round
of 6 drafts where 5.5 came, and so drafts too few.
"""

import time
import weakref
from typing import Dict, Sequence, Union

#: Timed passes per width after one untimed pass (the first pass at a new width pays the backend's
#: re-preparation); the fastest counts. Measuring widths 1..6 took 4.2 s on Qwen2.5-Coder-1.5B int8 with
#: two timed passes, so one is timed.
TIMED_PASSES = 1

#: Seconds per verify width of each target measured so far in this process: {width: seconds}.
_WIDTH_S = weakref.WeakKeyDictionary()


def measure_widths(target, token: int, max_width: int, fresh: bool = False) -> Dict[int, float]:
    """Seconds of one forward pass of each width 1..``max_width`` on ``target`` (a Runner) at its
    current context, remembered for the target's next requests (widths measured before are not
    measured again, unless ``fresh``). Every pass is rolled back, so the KV cache ends as it began.

    Args:
        target: the target Runner, after its prefill.
        token: the token id fed ``w`` times (its logits are not used).
        max_width: the widest pass to time (>= 1).
        fresh: time every width again at this context (:mod:`xpuspec.bench.bound` times each prompt's).

    Returns:
        ``{width: seconds}`` for every width 1..max_width.
    """
    known = _WIDTH_S.setdefault(target, {})
    for width in range(1, max_width + 1):
        if width in known and not fresh:
            continue
        times = []
        for _ in range(1 + TIMED_PASSES):
            t0 = time.perf_counter()
            target.forward([token] * width)
            times.append(time.perf_counter() - t0)
            target.rollback(width)
        known[width] = min(times[1:])
    return {w: known[w] for w in range(1, max_width + 1)}


def remembered_widths(target) -> Dict[int, float]:
    """The widths measured on ``target`` so far in this process, ``{width: seconds}`` (a copy)."""
    return dict(_WIDTH_S.get(target, {}))


def expected_tokens(acceptance: Union[float, Sequence[float]], k: int) -> float:
    """Tokens a round with ``k`` drafts yields on average, the verify pass's own token included.

    ``acceptance`` is one rate for every draft position (each draft accepted independently with that
    probability until the first rejection: Leviathan et al.'s model, ``(1 - a^(k+1)) / (1 - a)``), or the
    conditional rate of each position 1..k (draft j accepted given drafts 1..j-1 were):
    ``1 + a_1 + a_1 a_2 + ... + a_1 ... a_k``."""
    rates = [acceptance] * k if isinstance(acceptance, (int, float)) else list(acceptance)[:k]
    total = survive = 1.0
    for rate in rates:
        survive *= rate
        total += survive
    return total


def predicted_speedup(acceptance: Union[float, Sequence[float]], draft_step: float, verify: Sequence[float], k: int,
                      plain_step: float) -> float:
    """Expected tokens per second of rounds of ``k`` drafts over those of plain steps of
    ``plain_step`` seconds (arguments as for :func:`best_draft_length`; ``verify[k]`` is the k+1-token pass)."""
    return expected_tokens(acceptance, k) * plain_step / max(k * draft_step + verify[k], 1e-12)


def best_draft_length(acceptance: Union[float, Sequence[float]], draft_step: float, verify: Sequence[float]) -> int:
    """The draft length k >= 1 with the most expected tokens per second of round.

    Args:
        acceptance: measured acceptance rate a in [0, 1], or the conditional rate of each draft position
            1..K (see :func:`expected_tokens`).
        draft_step: seconds to draft one token (0 for prompt lookup).
        verify: ``verify[w - 1]`` is the seconds of a w-token pass, for w = 1..K+1 (K the longest
            draft considered).

    Returns:
        k in 1..len(verify) - 1 (ties go to the shorter draft).
    """
    best, best_rate = 1, -1.0
    for k in range(1, len(verify)):
        rate = predicted_speedup(acceptance, draft_step, verify, k, plain_step=1.0)  # tokens per second of round
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best
