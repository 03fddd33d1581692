"""What a target's passes cost by width: a profile measured once per compiled model, read as ratios.

Speculative decoding pays when the tokens a round yields outweigh what its passes cost. A w-token verify pass
costs neither w plain steps nor one, and the ratio differs between models and CPUs, so the policy reads it from
a measured profile (:class:`CostProfile`) instead of assuming it. The profile is a sweep of :data:`SWEEP_ROUNDS`
rounds; each round times every width of :data:`SWEEP_WIDTHS` once, after one untimed pass at that width (the
first pass at a new width pays the backend's re-preparation, which a decode loop that keeps one verify width pays
once). A width's cost is the median 1-token pass times the median, over rounds, of its ratio to the 1-token pass
of the same round. The profile is measured once and every later decision reads it, so it must not depend on when
another process took the cores: a load that starts or stops during the sweep changes the ratios of one round
only, and the median leaves that round out. Widths between the measured ones are interpolated linearly.
"""

import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

#: Widths the sweep times; the others are interpolated.
SWEEP_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
#: Rounds of the sweep (the median over them counts); each times every width once.
SWEEP_ROUNDS = 3


@dataclass(frozen=True)
class CostProfile:
    """Median seconds of a target pass by width.

    Attributes:
        seconds: ``{width: seconds}`` for the measured widths (1 among them).
        context: tokens in the KV cache when it was measured.
    """

    seconds: Dict[int, float]
    context: int
    #: Answers already computed (the profile does not change): ``("pass", w)`` and ``("round", longest, pad_to)``.
    _known: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def widest(self) -> int:
        return max(self.seconds)

    def pass_s(self, width: int) -> float:
        """Seconds of a ``width``-token pass (>= 1): measured, interpolated between measured widths, or extended
        past the widest at the slope of the two widest."""
        key = ("pass", width)
        if key not in self._known:
            self._known[key] = self._interpolated(width)
        return self._known[key]

    def round_costs(self, longest: int, pad_to: int = 0) -> Tuple[float, ...]:
        """See :func:`round_costs` (computed once per ``(longest, pad_to)``)."""
        key = ("round", longest, pad_to)
        if key not in self._known:
            self._known[key] = tuple(self.pass_s(w if w == 1 else max(w, pad_to)) for w in range(1, longest + 1))
        return self._known[key]

    def _interpolated(self, width: int) -> float:
        if width in self.seconds:
            return self.seconds[width]
        known = sorted(self.seconds)
        if len(known) == 1:
            return self.seconds[known[0]]
        below = max((w for w in known if w < width), default=known[0])
        above = min((w for w in known if w > width), default=None)
        if above is None:  # past the widest: the slope of the last two
            below, above = known[-2], known[-1]
        slope = (self.seconds[above] - self.seconds[below]) / (above - below)
        return max(self.seconds[below] + slope * (width - below), self.seconds[known[0]])


def measure_profile(target, token: int, widest: int = SWEEP_WIDTHS[-1], widths: Sequence[int] = SWEEP_WIDTHS,
                    clock=time.perf_counter) -> CostProfile:
    """Sweep ``target`` (a Runner, after its prefill) over ``widths`` (1 among them) up to ``widest``, in
    :data:`SWEEP_ROUNDS` rounds (see the module docstring).

    Every pass is rolled back, so the KV cache ends as it began.

    Args:
        target: the target Runner.
        token: the token id fed ``w`` times (its logits are not used).
        widest: the widest pass to time (>= 1).
        widths: the widths to time (the batched engine's sweep goes on to batch widths).
        clock: seconds now (a test passes its own).
    """
    chosen = sorted({1} | {w for w in widths if w <= widest})

    def timed(w: int) -> float:
        t0 = clock()
        target.forward_steps([token] * w)
        elapsed = clock() - t0
        target.rollback(w)
        return elapsed

    ones, ratios = [], {w: [] for w in chosen}
    for _ in range(SWEEP_ROUNDS):
        seconds = {}
        for w in chosen:
            timed(w)  # prepares the width
            seconds[w] = timed(w)
        ones.append(seconds[1])
        for w in chosen:
            ratios[w].append(seconds[w] / max(seconds[1], 1e-12))
    one = statistics.median(ones)
    return CostProfile({w: one * statistics.median(r) for w, r in ratios.items()}, target.length)


def round_costs(profile: CostProfile, longest: int, pad_to: int = 0) -> Sequence[float]:
    """``[C(1), ..., C(longest)]``: seconds of a round's pass of each width 1..``longest``, where a pass of 2 or
    more tokens is padded to ``pad_to`` (a backend that keeps one verify width; 0: no padding)."""
    return profile.round_costs(longest, pad_to)


@dataclass
class TargetCosts:
    """The measured costs of one target, kept on the loaded model across requests.

    Attributes:
        profile: the target's :class:`CostProfile`, once a speculative request measured it.
        native_step_s: seconds per token of the target's native engine, once it decoded a request.
    """

    profile: Optional[CostProfile] = None
    native_step_s: Optional[float] = None

    def hand_over_pays(self, remaining: int, context: int) -> bool:
        """Whether the native engine would finish ``remaining`` tokens sooner than the loop's plain steps, having
        to prefill the ``context`` again; ``False`` while either cost is unmeasured."""
        if self.profile is None or self.native_step_s is None:
            return False
        return remaining * (self.profile.pass_s(1) - self.native_step_s) > self.profile.pass_s(context)
