"""The cost model: whether speculation pays against plain decoding, measured while a request runs.

With T1 the time of a plain decode step and k*H + T_k the measured time of a speculative round (k
drafts at H each, one verify pass of k + 1 tokens), a round that yields tau tokens is worth
tau * T1 / (k*H + T_k) plain steps per step's time. T1 is the fastest plain step measured on the
same target, in this request (rounds without drafts are plain steps) and in the previous request
(:func:`remembered_plain_step`). Only a target never timed before spends its first
:data:`PLAIN_WARMUP_ROUNDS` steps without drafts to measure it (the first step after prefill pays
the change of input length on a stateful model). Rounds are judged over the last
:data:`WINDOW_ROUNDS` speculative rounds: speculation cannot pay when even a full accept (tau = k + 1)
would not, and does not pay once a full window measured fewer tokens than plain steps would have
given in the same time.

What happens then depends on the drafter. A model drafter is switched off for the rest of the
request (its probe cost a draft prefill and k draft steps), unless the request's acceptance rate,
draft step and measured verify costs still predict :data:`PREDICTED_SPEEDUP_TO_STAY` at the capped
draft length (three rounds are few: a Qwen2.5-1.5B code prompt lost its 0.5B draft after three
rejected opening rounds); a hybrid drops its draft model and keeps its prompt lookup. The decode
loop hands the rest of a request whose speculation is off to the target's native engine only where
that saves time (:meth:`CostModel.handover_pays`): the engine prefills the whole context again
(0.1-0.7 s for the bench's prompts on SmolLM2-135M here) and saves about 1 ms a step. The model also
keeps the request's acceptance rate of each draft position and seconds per token a model drafted, from which the
decode loop caps the draft length (:mod:`xpuspec.speculative.widths`); for a draft model, the rates start from
the drafter's rates in its earlier requests (:class:`AcceptanceCounts`, kept by
:class:`xpuspec.speculative.memory.SpeculationMemory`), so that one unlucky opening does not end a pair that
usually pays. A costless drafter (prompt lookup) is paused
for 2, 4, 8 ... 32 new tokens and then probed again (whether the output copies its input changes
within a request: an edit copies most of the source and then writes the one change). Judging lookup
on a single round paused it at the first miss: on 3 code, 3 prose and 4 edit prompts x 64 tokens x 2
(SmolLM2-135M int8, paged target) that made 296 target passes where judging over the window made
280, and lost 11% of the speed on code.
"""

import weakref
from collections import deque
from dataclasses import dataclass
from typing import List, Optional

#: Plain decode steps timed first, so that T1 is known before any speculative round. The first two
#: after a prefill are slow (SmolLM2-135M int8, paged, AMX Xeon: 28 and 20 ms against 14 later; with
#: two, T1 came out 1.5x too high and an int4 self-draft that cannot pay stayed on, 0.64x genai).
PLAIN_WARMUP_ROUNDS = 3
#: Speculative rounds the measured acceptance is judged over (a sliding window).
WINDOW_ROUNDS = 3
#: Tokens a costless drafter is paused for after its first failing probe; doubled per failure.
FIRST_PAUSE_TOKENS = 2
MAX_PAUSE_TOKENS = 32

#: The speed-up over plain decoding that the measured rates must predict for a draft model to stay on
#: after its window failed (below it, the estimate's error could hide a loss).
PREDICTED_SPEEDUP_TO_STAY = 1.1

#: The acceptance rate assumed before a request has measured one, and how many drafts it weighs as.
PRIOR_ACCEPTANCE = 0.7
PRIOR_TRIALS = 3

#: The most rounds the earlier requests' rate at a draft position weighs as in a new request's prior. Measured
#: on the Qwen2.5-Coder 1.5B target with its 0.5B int4 draft (2 code + 2 prose + 2 edit prompts x 32 tokens x 3,
#: the memory across requests kept as in the bench, in-process A/B against the fixed prior of PRIOR_TRIALS rounds
#: at PRIOR_ACCEPTANCE): draft mode 22.0 and 21.9 tok/s against 21.2 and 21.3; hybrid 23.6 against 21.3 in one
#: run (the fixed prior switched its draft model off on 9 of 18 requests, this one on none), 23.0 against 23.1
#: in another (2 against 3 switched off); measured with a weight of the remembered rounds alone, before the
#: PRIOR_TRIALS added in review (which changes only positions measured in fewer than 3 rounds).
REMEMBERED_ROUNDS = 6


@dataclass
class AcceptanceCounts:
    """Rounds that judged a draft at each draft position (index 0: position 1) and rounds that accepted it,
    two lists of one length; floats, since :class:`xpuspec.speculative.memory.SpeculationMemory` weighs
    earlier requests down."""

    judged: List[float]
    accepted: List[float]

    def copy(self) -> "AcceptanceCounts":
        return AcceptanceCounts(list(self.judged), list(self.accepted))


#: The fastest plain step of each target's last timed request, seconds (see :func:`remembered_plain_step`).
_PLAIN_STEP_S = weakref.WeakKeyDictionary()
#: The mean step of each target's last request decoded by its native engine, seconds.
_NATIVE_STEP_S = weakref.WeakKeyDictionary()


def remembered_plain_step(target) -> Optional[float]:
    """T1 measured on ``target`` (a Runner) in an earlier request, or ``None``."""
    return _PLAIN_STEP_S.get(target)


def remember_plain_step(target, cost: "CostModel") -> None:
    """Keep the fastest plain step of ``cost``'s request for ``target``'s next requests (the older value
    when it made none), so that T1 follows the machine's load and the context length."""
    if cost.plain_s:
        _PLAIN_STEP_S[target] = min(cost.plain_s)


def remember_native_step(target, seconds: float) -> None:
    """Keep the mean decode step of a request ``target``'s native engine decoded (seconds per token)."""
    _NATIVE_STEP_S[target] = seconds


def remembered_native_step(target) -> Optional[float]:
    """The native engine's step on ``target`` from an earlier request, seconds, or ``None``."""
    return _NATIVE_STEP_S.get(target)


class CostModel:
    """Per request: times plain steps and speculative rounds, and says when to draft.

    Args:
        enabled: ``False`` drafts every round (``SpeculativeConfig(cost_model=False)``).
        costless: the drafter costs nothing to run (prompt lookup): pause and probe again instead of
            switching speculation off.
        known_plain_s: T1 from an earlier request on the same target, seconds; ``None`` measures it first.
        prior: the drafter's rounds judged and accepted per draft position in earlier requests
            (:class:`xpuspec.speculative.memory.SpeculationMemory`), the prior of
            :meth:`acceptance_by_position`; ``None`` for the fixed prior.
    """

    def __init__(self, enabled: bool, costless: bool, known_plain_s: Optional[float] = None,
                 prior: Optional[AcceptanceCounts] = None):
        self.enabled, self.costless, self.known_plain_s = enabled, costless, known_plain_s
        self.prior, self.before_drop = prior, None
        self.plain_s: List[float] = []  # this request's plain steps
        self.plain_tokens = 0  # the tokens they gave (more than one a step where steps carry a free guess)
        self.window = deque(maxlen=WINDOW_ROUNDS)  # (seconds, tokens, drafted) of speculative rounds
        self.pause = 0
        self.resume_at = 0
        self.pauses = 0  # how often a costless drafter was paused
        self.drafted = 0  # tokens a model drafted in this request (looked-up ones left out)
        self.draft_s = 0.0
        self.rounds = AcceptanceCounts([], [])  # this request's, per draft position

    def become_costless(self) -> None:
        """The draft model was dropped and a costless drafter goes on: pause and probe from now on."""
        self.before_drop = self.counts()  # the draft model's rounds: what the memory keeps of this request
        self.costless, self.prior = True, None  # the draft model's rates say nothing of lookup
        self.window.clear()
        self.drafted = 0  # the draft model's acceptance and step say nothing of lookup
        self.draft_s = 0.0
        self.rounds = AcceptanceCounts([], [])

    def measuring(self) -> bool:
        """True while the first plain steps are timed (no drafting yet): only on a target not timed before."""
        return self.enabled and self.known_plain_s is None and len(self.plain_s) < PLAIN_WARMUP_ROUNDS

    def plain_step(self) -> Optional[float]:
        """T1 in seconds per token: the fastest plain step of this request and the remembered one (a T1 too
        low makes speculation look slower than it is, never faster), over the tokens this request's plain
        steps gave on average (1, or more where they carry a free guess, :mod:`xpuspec.decode`: on the
        AMX Xeon a Qwen2.5-1.5B code prompt's guesses made plain steps as good as the 0.5B draft's rounds)."""
        known = [] if self.known_plain_s is None else [self.known_plain_s]
        fastest = min(self.plain_s + known, default=None)
        if fastest is None or not self.plain_tokens:
            return fastest
        return fastest * len(self.plain_s) / self.plain_tokens

    def handover_pays(self, remaining: int, native_step_s: Optional[float], prefill_s: float) -> bool:
        """Whether the native engine would finish the request sooner than this loop's plain steps. T1 is
        the fastest plain step and the engine's step a mean, so a close call stays in the loop.

        Args:
            remaining: tokens still to generate.
            native_step_s: the engine's decode step, seconds (``None``: never measured, no handover).
            prefill_s: predicted seconds for the engine to prefill the context again.
        """
        plain = self.plain_step()
        if native_step_s is None or plain is None:
            return False
        return remaining * (plain - native_step_s) > prefill_s

    def paused(self, produced: int) -> bool:
        """True while a paused costless drafter waits; ``produced``: new tokens so far."""
        return produced < self.resume_at

    def record(self, seconds: float, tokens: int, drafted: int, speculative: bool) -> None:
        """Note a round: its seconds (drafting and verifying), the tokens it produced, the tokens drafted."""
        if speculative:
            self.window.append((seconds, tokens, drafted))
        else:
            self.plain_s.append(seconds)
            self.plain_tokens += tokens

    def note_drafts(self, drafted: int, accepted: int, draft_s: float, free: int = 0) -> None:
        """Note a round with drafts (of any drafter, a hybrid's lookup too): tokens drafted and accepted,
        the seconds spent drafting them, and how many of them cost nothing (looked up: a hybrid's lookup
        round, or the lookup that ended its draft model's chain), which :meth:`draft_step` leaves out."""
        self.drafted += drafted - free
        self.draft_s += draft_s if drafted > free else 0.0  # a round of looked-up drafts only costs nothing
        judged = accepted + (accepted < drafted)  # drafts are judged until the first rejection
        for counts in (self.rounds.judged, self.rounds.accepted):
            counts.extend([0] * (judged - len(counts)))
        for j in range(judged):
            self.rounds.judged[j] += 1
            self.rounds.accepted[j] += j < accepted

    def acceptance_by_position(self, positions: int) -> List[float]:
        """The conditional acceptance rate of draft positions 1..``positions`` in this request: at position j,
        the rounds that accepted draft j over those that judged it (drafts 1..j-1 accepted), each starting from
        a prior. Without :attr:`prior` (a drafter's first request, prompt lookup, ``cost_model=False``, a hybrid
        after it dropped its draft model) the prior is worth :data:`PRIOR_TRIALS` rounds: :data:`PRIOR_ACCEPTANCE`
        at position 1, the rate of position j-1 further on (a position never drafted yet gets the rate of the
        one before it, as in Leviathan et al.'s model of one rate; :mod:`xpuspec.speculative.widths`). With it,
        the prior of position j is the earlier requests' rate there (:class:`AcceptanceCounts`, itself from a
        prior of :data:`PRIOR_TRIALS` rounds at the rate before it), worth the rounds that measured it plus
        :data:`PRIOR_TRIALS`, at most :data:`REMEMBERED_ROUNDS` (a position barely measured before weighs as
        the fixed prior does)."""
        rates, prior = [], PRIOR_ACCEPTANCE
        for j in range(positions):
            weight = PRIOR_TRIALS
            if self.prior is not None and j < len(self.prior.judged) and self.prior.judged[j] > 0:
                prior = (self.prior.accepted[j] + prior * PRIOR_TRIALS) / (self.prior.judged[j] + PRIOR_TRIALS)
                weight = min(self.prior.judged[j] + PRIOR_TRIALS, REMEMBERED_ROUNDS)  # its evidence, smoothed
            if j < len(self.rounds.judged):
                prior = (self.rounds.accepted[j] + prior * weight) / (self.rounds.judged[j] + weight)
            rates.append(prior)
        return rates

    def counts(self) -> AcceptanceCounts:
        """A copy of this request's rounds judged and accepted per draft position; where a hybrid dropped its
        draft model, those of the rounds before (the later ones are its prompt lookup's)."""
        return (self.rounds if self.before_drop is None else self.before_drop).copy()

    def draft_step(self) -> float:
        """Seconds per token a model drafted in this request (0 before any, and for prompt lookup)."""
        return self.draft_s / self.drafted if self.drafted else 0.0

    def _window(self):
        """(rounds, seconds, tokens, drafted) over the window."""
        return (len(self.window), sum(r[0] for r in self.window), sum(r[1] for r in self.window),
                sum(r[2] for r in self.window))

    def full_accept_pays(self) -> bool:
        """Whether the window's rounds would pay had every draft been accepted (tau = k + 1): ``False``
        means the drafting and verifying themselves cost more than the plain steps they could replace."""
        rounds, seconds, _, drafted = self._window()
        return (drafted / rounds + 1) * self.plain_step() * rounds / seconds >= 1.0

    def pays(self) -> bool:
        """Whether the speculative rounds in the window pay, on their own measurements."""
        rounds, seconds, tokens, _ = self._window()
        return self.full_accept_pays() and (rounds < WINDOW_ROUNDS or tokens * self.plain_step() / seconds >= 1.0)

    def keep_speculating(self, produced: int, predicted_speedup: Optional[float] = None) -> bool:
        """Call after each speculative round. ``False``: switch speculation off for the rest of the
        request. A costless drafter is paused instead (and ``True`` returned). A draft model whose
        window did not pay stays on where ``predicted_speedup`` (the speed-up over plain decoding that
        the request's acceptance rate, draft step and measured verify costs predict at the capped draft
        length, :func:`xpuspec.speculative.widths.predicted_speedup`) is at least
        :data:`PREDICTED_SPEEDUP_TO_STAY`: three rounds are few, and one unlucky start should not end it."""
        if not self.enabled or self.plain_step() is None or not self.window:
            return True
        if self.pays():
            if len(self.window) == WINDOW_ROUNDS:
                self.pause = 0
            return True
        if not self.costless:
            return (predicted_speedup is not None and predicted_speedup >= PREDICTED_SPEEDUP_TO_STAY
                    and self.full_accept_pays())
        self.pause = min(2 * self.pause, MAX_PAUSE_TOKENS) if self.pause else FIRST_PAUSE_TOKENS
        self.resume_at = produced + self.pause
        self.pauses += 1
        self.window.clear()
        return True
