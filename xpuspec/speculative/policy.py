"""The speculation policy: how many tokens to draft each round, and when drafting with a model stops paying.

One :class:`SpeculationPolicy` lives per (target, drafter, greedy or sampling) on the loaded model, across requests;
each request gets a :class:`RequestPolicy` from :meth:`SpeculationPolicy.begin`. The decode round asks it for a
:class:`Widths` and reports a :class:`RoundOutcome`; it answers with a :class:`Decision`.

Each round drafts the k that maximizes expected tokens per second of round (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding", eq. 1, with the verify cost measured per width):

    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k,      cost(k) = k * h + C(k + 1),

where a_j is the acceptance rate of draft position j given the drafts before it were accepted (drafts are right in
runs, so one rate for every position drafts too few), h a draft step and C(w) a w-token pass. The rates come from
counts (rounds judged and accepted per position, from a prior and, for a draft model, its earlier requests), C from
the target's :class:`~xpuspec.speculative.profile.CostProfile`, and h from the ratio of each round's draft time to
its verify time, side by side, as a median over rounds: all three are ratios or counts, so a machine that runs
slower for everyone decides alike, and one slow pass does not move a median. Rounds whose drafts cost no model step
(prompt lookup, a hybrid's lookup) have h = 0 and their own rates.

A draft model stops for the rest of the request once its best predicted rate falls below plain decoding's after
:data:`MIN_JUDGED_ROUNDS` rounds of evidence (at once where even a full accept cannot pay); a hybrid then goes on
with prompt lookup. After :data:`FAILURES_BEFORE_SKIPPING` requests in a row that stopped it, later requests do not
start the draft model, probing again after 1, 2, 4 ... :data:`MAX_SKIPPED` requests.
"""

import logging
import statistics
import weakref
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional, Sequence

from ..generation import PositionCounts
from .profile import CostProfile, round_costs
from .schedule import DraftSchedule

log = logging.getLogger("xpuspec")

#: The acceptance rate assumed at draft position 1 before any count, and how many rounds it weighs as.
PRIOR_ACCEPTANCE = 0.7
PRIOR_TRIALS = 3
#: The most rounds an earlier request's rate at a position weighs as in a new request's prior.
REMEMBERED_ROUNDS = 6
#: The weight each new request leaves to the counts of the requests before it.
DECAY = 0.5
#: Model rounds judged before the policy may stop the draft model on its rates (a full accept that cannot pay
#: stops it at once).
MIN_JUDGED_ROUNDS = 3
#: The predicted speed-up over plain decoding a draft model must keep: below it, estimation error could hide a loss.
SPEEDUP_TO_KEEP = 1.05
#: Rounds of draft-to-verify time ratios the median of h is taken over.
DRAFT_RATIO_ROUNDS = 9
#: The draft step assumed before one is measured, as a share of a 1-token target pass.
PRIOR_DRAFT_STEP = 0.3
#: Requests in a row that stopped the draft model before later requests skip it, and the most skipped in a row.
FAILURES_BEFORE_SKIPPING = 2
MAX_SKIPPED = 16
#: A free drafter (prompt lookup) that does not pay is paused for this many new tokens, doubled per pause.
FIRST_PAUSE_TOKENS = 2
MAX_PAUSE_TOKENS = 32
#: Drafts past the optimum after a round that took every draft, to measure the next position's rate.
DRAFTS_PAST_THE_OPTIMUM = 1


class Decision(Enum):
    """What the round does next."""

    GO_ON = "go on"
    DROP_MODEL = "drop the draft model"  # a hybrid goes on with its prompt lookup; a model drafter stops


@dataclass(frozen=True)
class Widths:
    """Drafts to ask for this round: ``model`` tokens where a model drafts, ``free`` where the drafter drafts
    without a model step (0 and 0: no drafts)."""

    model: int
    free: int


@dataclass(frozen=True)
class RoundOutcome:
    """What one round did.

    Attributes:
        drafted: tokens verified after the target's own (drafts, free ones included).
        accepted: how many of them the target accepted.
        free: how many of the drafts cost no model step (all of them in a lookup round).
        draft_s: seconds spent drafting; verify_s: seconds of the target's pass.
        verify_width: tokens in the target's pass (padding included).
    """

    drafted: int
    accepted: int
    free: int
    draft_s: float
    verify_s: float
    verify_width: int

    @property
    def by_model(self) -> bool:
        """A model drafted some of the tokens (else the round was free, or had no drafts)."""
        return self.drafted > self.free


@dataclass
class AcceptanceCounts(PositionCounts):
    """:class:`xpuspec.generation.PositionCounts` as the policy weighs them: floats, since earlier requests weigh
    less (:data:`DECAY`)."""

    def copy(self) -> "AcceptanceCounts":
        return AcceptanceCounts(list(self.judged), list(self.accepted))

    def decayed_plus(self, new: "AcceptanceCounts") -> "AcceptanceCounts":
        """``new`` plus these counts weighed by :data:`DECAY`, position by position."""
        size = max(len(self.judged), len(new.judged))

        def add(old, now):
            return [DECAY * (old[i] if i < len(old) else 0.0) + (now[i] if i < len(now) else 0.0) for i in range(size)]

        return AcceptanceCounts(add(self.judged, new.judged), add(self.accepted, new.accepted))

    def rates(self, positions: int, prior: Optional["AcceptanceCounts"] = None) -> List[float]:
        """The conditional acceptance rate of positions 1..``positions``: each position's counts on top of a prior
        worth :data:`PRIOR_TRIALS` rounds (:data:`PRIOR_ACCEPTANCE` at position 1, the rate of the position before
        further on), or, where ``prior`` (earlier requests) measured the position, that rate, worth its rounds plus
        :data:`PRIOR_TRIALS`, at most :data:`REMEMBERED_ROUNDS`."""
        rates, rate = [], PRIOR_ACCEPTANCE
        for j in range(positions):
            weight = PRIOR_TRIALS
            if prior is not None and j < len(prior.judged) and prior.judged[j] > 0:
                rate = (prior.accepted[j] + rate * PRIOR_TRIALS) / (prior.judged[j] + PRIOR_TRIALS)
                weight = min(prior.judged[j] + PRIOR_TRIALS, REMEMBERED_ROUNDS)
            if j < len(self.judged):
                rate = (self.accepted[j] + rate * weight) / (self.judged[j] + weight)
            rates.append(rate)
        return rates


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Tokens a round with ``k`` drafts yields on average, the target's own token included."""
    total = survive = 1.0
    for rate in list(rates)[:k]:
        survive *= rate
        total += survive
    return total


def best_draft_length(rates: Sequence[float], draft_step: float, pass_s: Sequence[float]) -> int:
    """The k in 1..len(pass_s) - 1 with the most expected tokens per second of round (ties to the shorter);
    ``pass_s[w - 1]`` is a w-token pass, ``draft_step`` the seconds of one drafted token (0: free)."""
    best, best_rate = 1, -1.0
    total = survive = 1.0  # expected_tokens(rates, k), summed as k grows (the same sums in the same order)
    for k in range(1, len(pass_s)):
        if k <= len(rates):
            survive *= rates[k - 1]
            total += survive
        rate = total / max(k * draft_step + pass_s[k], 1e-12)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


class SpeculationPolicy:
    """The policy of one (target, drafter) pair, greedy or sampling, across requests.

    Args:
        uses_model: the drafter drafts with a model (some rounds cost draft steps).
        step_width: the width of the target's 1-token pass (:class:`xpuspec.runner.RunnerTraits`).
        name: how log lines name the drafter.
    """

    def __init__(self, uses_model: bool, step_width: int = 1, name: str = "draft model"):
        self.uses_model, self.step_width, self.name = uses_model, step_width, name
        self.model_counts: Optional[AcceptanceCounts] = None  # earlier requests' model rounds, decayed
        self.draft_ratio: Optional[float] = None  # a draft step over a 1-token target pass, from earlier requests
        self.failures = 0  # requests in a row that stopped the draft model
        self.cannot_pay = 0  # ... of which found that even a full accept would not pay
        self.skipped = 0  # requests not started since the last probe
        self.logged = False

    def starts_model(self, schedule: DraftSchedule, may_probe: bool = True) -> bool:
        """Whether a request drafts with the model (a probe) or leaves it out (counted as skipped).
        ``may_probe=False`` (a released model not yet worth loading again) turns a probe into a skip."""
        if not self.uses_model or not schedule.cost_model or self.failures < FAILURES_BEFORE_SKIPPING:
            return True
        limit = MAX_SKIPPED if self.cannot_pay >= FAILURES_BEFORE_SKIPPING else 2 ** (
            self.failures - FAILURES_BEFORE_SKIPPING)
        if self.skipped < min(limit, MAX_SKIPPED) or not may_probe:
            self.skipped += 1
            return False
        self.skipped = 0
        return True

    def releases_model(self, after: int) -> bool:
        """Whether the draft model has been left out of ``after`` (>= 1; 0: never) requests in a row."""
        return self.uses_model and after > 0 and self.skipped >= after

    def begin(self, schedule: DraftSchedule, profile: Optional[CostProfile], with_model: bool) -> "RequestPolicy":
        """The policy of one request drafting by ``schedule``; ``profile``: the target's costs (``None``: not measured
        yet, or the cost model is off: the schedule's lengths as they are)."""
        return RequestPolicy(self, schedule, profile if schedule.cost_model else None, with_model and self.uses_model)

    def finish(self, request: "RequestPolicy") -> None:
        """Keep what ``request`` measured for the next requests."""
        if not request.model_on_at_start:
            return
        stopped = request.stopped is not None
        self.failures = self.failures + 1 if stopped else 0
        self.cannot_pay = self.cannot_pay + 1 if stopped and request.stopped.cannot_pay else 0
        if request.model_counts.judged:
            self.model_counts = (request.model_counts.copy() if self.model_counts is None
                                 else self.model_counts.decayed_plus(request.model_counts))
        if request.draft_ratios:
            self.draft_ratio = statistics.median(request.draft_ratios)
        if stopped and not self.logged:
            self.logged = True
            counts = request.model_counts
            log.info("%s stopped after %d tokens: measured acceptance %.0f%% at the first draft position over %d "
                     "rounds, predicted %.2fx plain decoding at best (full accept: %.2fx); requests skip it after %d "
                     "such in a row (logged once per model)", self.name, request.stopped.after_tokens,
                     100 * counts.accepted[0] / counts.judged[0] if counts.judged else 0.0,
                     counts.judged[0] if counts.judged else 0, request.stopped.predicted,
                     request.stopped.full_accept, FAILURES_BEFORE_SKIPPING)


@dataclass(frozen=True)
class Stop:
    """Why a request's draft model stopped: the predicted speed-up at the best length, with a full accept, and when."""

    predicted: float
    full_accept: float
    after_tokens: int

    @property
    def cannot_pay(self) -> bool:
        return self.full_accept < 1.0


class RequestPolicy:
    """One request's draft lengths and decisions (see the module docstring); made by :meth:`SpeculationPolicy.begin`.

    Attributes:
        model_counts, free_counts: this request's rounds judged and accepted per position, for rounds a model
            drafted in and rounds that cost no model step.
        stopped: why the draft model stopped, or ``None``.
        pauses: how often a free drafter was paused.
    """

    def __init__(self, parent: SpeculationPolicy, schedule: DraftSchedule, profile: Optional[CostProfile],
                 with_model: bool):
        self.parent, self.schedule, self.profile = parent, schedule, profile
        self.model_on = self.model_on_at_start = with_model
        self.k = schedule.num_assistant_tokens
        self.model_counts, self.free_counts = AcceptanceCounts(), AcceptanceCounts()
        self.guesses = AcceptanceCounts()  # free tokens in rounds that drafted nothing else (a padded step's slot)
        self.draft_ratios = deque(maxlen=DRAFT_RATIO_ROUNDS)  # per model round: seconds per drafted token / C(w)
        self.stopped: Optional[Stop] = None
        self.pauses, self.resume_at, self.pause = 0, 0, 0
        self.took_all = False

    # -- what to draft ------------------------------------------------------------------------------------------
    def widths(self, produced: int, room: int, pad_to: int = 0) -> Widths:
        """Drafts to ask for in the next round; ``produced``: new tokens so far, ``room``: drafts that still fit,
        ``pad_to``: the width the target pads rounds with drafts to (0: none)."""
        schedule = self.schedule
        free_longest = min(schedule.lookup_tokens, room)
        model_longest = min(self.k, room) if self.model_on else 0
        if room <= 0:
            return Widths(0, 0)
        if self.profile is None:  # cost model off: the schedule as it is
            return Widths(model_longest, free_longest)
        past = DRAFTS_PAST_THE_OPTIMUM * self.took_all
        free = 0
        if produced >= self.resume_at:
            free = min(self._best(self.free_counts, 0.0, free_longest, pad_to) + past, free_longest)
        model = 0
        if self.model_on:
            model = min(self._best(self.model_counts, self._draft_step(), self._longest(), pad_to) + past, room)
            if schedule.schedule == "heuristic":
                self.k = min(self.k, model)
                model = min(self.k, model)
        return Widths(model, max(free, model))

    def _longest(self) -> int:
        """The longest model draft considered: k, and room for the heuristic schedule to grow."""
        schedule = self.schedule
        return schedule.num_assistant_tokens + (1 if schedule.schedule == "constant" else 3)

    def widest_needed(self) -> int:
        """The widest verify pass this request may make, for measuring the profile."""
        return max(self._longest() if self.model_on else 0, self.schedule.lookup_tokens) + 1

    def _best(self, counts: AcceptanceCounts, draft_step: float, longest: int, pad_to: int) -> int:
        if longest <= 0:
            return 0
        prior = self.parent.model_counts if counts is self.model_counts else None
        return best_draft_length(counts.rates(longest, prior), draft_step, round_costs(self.profile, longest + 1, pad_to))

    def _draft_step(self) -> float:
        """Seconds of a drafted token in profile units: the median ratio of this request's rounds, else the
        earlier requests', else :data:`PRIOR_DRAFT_STEP`, times a 1-token pass."""
        ratio = (statistics.median(self.draft_ratios) if self.draft_ratios else
                 self.parent.draft_ratio if self.parent.draft_ratio is not None else PRIOR_DRAFT_STEP)
        return ratio * self.profile.pass_s(1)

    # -- what happened ------------------------------------------------------------------------------------------
    def report(self, outcome: RoundOutcome, produced: int, pad_to: int = 0) -> Decision:
        """Note a round; ``produced``: new tokens so far, ``pad_to`` as for :meth:`widths`. Returns what the round
        does next."""
        schedule = self.schedule
        self.took_all = outcome.drafted > 0 and outcome.accepted == outcome.drafted
        if outcome.by_model:
            self.model_counts.add_round(outcome.drafted, outcome.accepted)
            model_drafted = outcome.drafted - outcome.free
            if self.profile is not None and outcome.verify_s > 0:
                self.draft_ratios.append(outcome.draft_s / model_drafted / outcome.verify_s
                                         * self.profile.pass_s(outcome.verify_width) / self.profile.pass_s(1))
            self.k = schedule.next_k(self.k, outcome.drafted, outcome.accepted)
        elif outcome.drafted:
            counts = self.free_counts if outcome.drafted >= self.parent.step_width else self.guesses
            counts.add_round(outcome.drafted, outcome.accepted)
            if self.profile is not None and counts is self.free_counts:
                self._maybe_pause(produced, pad_to)
        if self.model_on and self.profile is not None and outcome.by_model:
            return self._judge_model(produced, pad_to)
        return Decision.GO_ON

    def _plain_rate(self) -> float:
        """Tokens per second of a plain step (with its free guess where the step is padded)."""
        guess = expected_tokens(self.guesses.rates(1), 1) - 1 if self.parent.step_width > 1 else 0.0
        return (1.0 + guess) / self.profile.pass_s(1)

    def _predicted(self, rates: Sequence[float], pad_to: int) -> float:
        """Best predicted speed-up of model rounds over plain steps at ``rates``."""
        step, longest = self._draft_step(), self._longest()
        costs = round_costs(self.profile, longest + 1, pad_to)
        k = best_draft_length(rates, step, costs)
        return expected_tokens(rates, k) / (k * step + costs[k]) / self._plain_rate()

    def _judge_model(self, produced: int, pad_to: int) -> Decision:
        longest = self._longest()
        predicted = self._predicted(self.model_counts.rates(longest, self.parent.model_counts), pad_to)
        full = self._predicted([1.0] * longest, pad_to)
        enough = len(self.model_counts.judged) > 0 and self.model_counts.judged[0] >= MIN_JUDGED_ROUNDS
        if full < 1.0 or (enough and predicted < SPEEDUP_TO_KEEP):
            self.model_on = False
            self.stopped = Stop(predicted, full, produced)
            return Decision.DROP_MODEL
        return Decision.GO_ON

    def _maybe_pause(self, produced: int, pad_to: int) -> None:
        """Pause a free drafter whose rounds predict no gain over plain steps (probed again later)."""
        longest = self.schedule.lookup_tokens
        rates = self.free_counts.rates(longest)
        costs = round_costs(self.profile, longest + 1, pad_to)
        k = best_draft_length(rates, 0.0, costs)
        if expected_tokens(rates, k) / costs[k] >= self._plain_rate():
            self.pause = 0
            return
        self.pause = min(2 * self.pause, MAX_PAUSE_TOKENS) if self.pause else FIRST_PAUSE_TOKENS
        self.resume_at = produced + self.pause
        self.pauses += 1
        self.free_counts = AcceptanceCounts()

    # -- for a batch of requests (xpuspec.speculative.batch) ----------------------------------------------------
    def rates_for(self, by_model: bool, longest: int) -> List[float]:
        """The conditional acceptance rates of draft positions 1..``longest`` for a round a model drafts
        (``by_model``) or a free one."""
        if by_model:
            return self.model_counts.rates(longest, self.parent.model_counts)
        return self.free_counts.rates(longest)

    @property
    def measured_draft_step(self) -> bool:
        """Whether this request timed a round its draft model drafted in (else its draft step is an estimate)."""
        return bool(self.draft_ratios)

    def draft_step_s(self) -> float:
        """Seconds of one drafted token by the model (needs :attr:`profile`)."""
        return self._draft_step()

    def guess_rate(self) -> float:
        """The acceptance rate of a padded plain step's free guess."""
        return self.guesses.rates(1)[0]


class PolicyBook:
    """The speculation policies of one target model: one per (drafter kind, draft model, greedy or sampling), kept
    as long as the draft model lives.

    Args:
        step_width: the target's :attr:`xpuspec.runner.RunnerTraits.single_step_width`.
    """

    def __init__(self, step_width: int = 1):
        self.step_width = step_width
        self._by_draft = weakref.WeakKeyDictionary()  # draft runner -> {(kind, sample): policy}
        self._free = {}  # (kind, sample) -> policy, for drafters without a model

    def policy(self, kind: str, draft_runner, sample: bool, uses_model: bool, name: str) -> SpeculationPolicy:
        """The policy of drafter ``kind`` (``"lookup"``, ``"draft"``, ``"hybrid"`` ...) with ``draft_runner``
        (``None`` without a model) under greedy decoding or sampling (which accepts less)."""
        book = self._free if draft_runner is None else self._by_draft.setdefault(draft_runner, {})
        key = (kind, sample)
        if key not in book:
            book[key] = SpeculationPolicy(uses_model, self.step_width, name)
        return book[key]
