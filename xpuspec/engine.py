"""The engine: every request is a row of one :class:`Engine` per target, stepped by one :class:`EngineLoop`.

A request alone is a batch of one; a batch ``[B, T]`` is B rows; concurrent callers' requests are rows of the same
engine. There is no other decode path.

An :class:`Engine` keeps :class:`Job` s, each with its own tokens (:class:`xpuspec.decode.Request`), its own sequence
on the target (``open_sequence`` of a runner that batches, the OpenVINO paged runner; a runner of one sequence, the
torch backend, pipeline stages and the NPU, is an engine with one row through :class:`OneSequence`), its drafter
(:meth:`xpuspec.speculative.drafters.Drafter.on_rows`: a draft model drafts on a sequence of its own) and its policy.
One :meth:`Engine.step` runs these phases in order:

1. **admit** waiting jobs whose KV blocks fit; **prefill** them: a prompt in one pass while no row decodes, else in
   chunks, one per step, each as many tokens as :data:`~xpuspec.batching.PREFILL_BUDGET_S` seconds buy at the
   prefill rate measured so far, so that a long prompt does not stall running rows (vLLM's chunked prefill, with
   a time budget where vLLM has a token budget; the chunks run between the decode steps). Plain greedy decoding of
   a lone row may run in the target's native engine (:meth:`xpuspec.runner.Runner.native_greedy`), which yields
   to any job that arrives;
2. **propose**: free drafts first (prompt lookup, suffix: looked up for every row), then the draft lengths of the
   whole batch by goodput (:mod:`xpuspec.speculative.batch`), then the draft model's drafts, row by row; a row
   without drafts on a target whose 1-token passes run 2 wide carries a free guess, and on a target with split
   steps (``traits.split_steps``) the rows without drafts carry their guesses where the engine's timed passes say
   it pays (:meth:`Engine._guesses_pay`);
3. **verify**: ONE ``forward_batch`` over every row's ``[last token] + drafts`` (a row shorter than the target's
   1-token width is padded, as a request alone pads it, so each row computes as it would alone);
4. **accept** and roll back, per row: greedy acceptance or rejection sampling, rollback of its own rejected drafts
   (:func:`xpuspec.decode.verify_and_emit`);
5. **emit**: the kept tokens to the row's context and streamer, up to EOS, the limit or a stop string;
6. **report**: the drafter and the policy hear what the target kept (:func:`xpuspec.decode.after_round`); finished
   rows leave and free their blocks.

An :class:`EngineLoop` owns the engine in a background thread (started on first use, a daemon, stopped with
:meth:`EngineLoop.stop`): callers submit jobs and wait on their own jobs' events.
"""

import logging
import threading
import time
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from .decode import (NO_DRAFT, Decision, Request, after_round, begin_drafting, cut_draft, drop_model, end_drafting,
                     finish_request, forced_draft, hand_over, native_greedy_applies, verify_and_emit)
from .errors import KVBudgetError
from .runner import Runner, torch_on_one_thread
from .speculative.batch import BATCH_SWEEP_WIDTHS, RowChoice, batch_draft_lengths
from .speculative.drafters import Draft, DraftCounters, Drafter
from .speculative.policy import Widths
from .speculative.profile import SWEEP_WIDTHS, TargetCosts, measure_profile

from .batching import DEFAULT_MAX_BATCH, MIN_PREFILL_CHUNK, PREFILL_BUDGET_S, PREFILL_CHUNK  # noqa: F401 - light for the CLI

log = logging.getLogger("xpuspec")

#: With split steps, a plain step carries a guess only where it pays (:meth:`Engine._guesses_pay`): the tokens the
#: guesses added per row of a guessing step, as pseudo-counts ``(tokens, rows)`` before any guess was verified
#: (0.2: SmolLM2's batch bench gained 0.16-0.21 in 2-wide steps).
GUESS_PRIOR = (2, 10)
#: Steps for which a decision on guessing holds for the same pass widths, so that the width does not change from
#: step to step; and steps that try a width not timed yet.
GUESS_DECISION_STEPS = 32
GUESS_TRIAL_STEPS = 3


def batches(runner: Runner) -> bool:
    """Whether ``runner`` verifies several sequences in one pass (``open_sequence`` and ``forward_batch``)."""
    return runner.traits.batches and not runner.traits.lockstep


def profile_target(costs: TargetCosts, runner: Runner, token: int, widest: int, batched: bool) -> float:
    """Measure the target's cost profile once into ``costs`` (the one place it is measured: at a speculative load
    and on the first speculative row), on ``runner`` after its prefill; returns the seconds spent (0 when measured
    already, or on a lockstep pipeline rank, whose timings differ between ranks). A runner that batches sweeps the
    batch widths; where its KV budget has no room for them, the widths of a request alone."""
    if runner.traits.lockstep or (costs.profile is not None and
                                  (not batched or costs.profile.widest >= BATCH_SWEEP_WIDTHS[-1])):
        return 0.0
    t0 = time.perf_counter()
    if batched:
        try:
            costs.profile = measure_profile(runner, token, BATCH_SWEEP_WIDTHS[-1], BATCH_SWEEP_WIDTHS)
        except KVBudgetError:  # no room for the batch widths' passes: those of a request alone
            costs.profile = costs.profile or measure_profile(runner, token, SWEEP_WIDTHS[-1], SWEEP_WIDTHS)
    else:
        costs.profile = measure_profile(runner, token, widest, SWEEP_WIDTHS)
    return time.perf_counter() - t0


class OneSequence(Runner):
    """A runner of one sequence as the engine's sequences: :meth:`open_sequence` empties and hands out the runner
    itself, :meth:`forward_batch` takes one part. An engine on it has one row (``max_batch`` 1)."""

    def __init__(self, runner: Runner):
        self.runner = runner
        for name in ("device", "vocab_size", "weight_bytes", "num_layers", "max_length", "max_prompt_len",
                     "head_tokens"):
            setattr(self, name, getattr(runner, name, None))

    @property
    def traits(self):
        return self.runner.traits

    @property
    def length(self) -> int:
        return self.runner.length

    @property
    def last_taps(self):
        return self.runner.last_taps

    def open_sequence(self) -> "OneSequence":
        self.runner.reset()
        return self

    def forward_batch(self, parts):
        if len(parts) != 1:
            raise ValueError(f"a runner of one sequence verifies one part per pass, got {len(parts)}.")
        return [self.runner.forward_steps(parts[0][1])]

    def forward(self, tokens, logits_to_keep=None, exact=True):
        return self.runner.forward(tokens, logits_to_keep, exact)

    def forward_steps(self, tokens):
        return self.runner.forward_steps(tokens)

    def native_greedy(self, *args, **kwargs):
        return self.runner.native_greedy(*args, **kwargs)

    def blocks_for(self, tokens: int) -> int:
        return 0

    def reserve(self, tokens: int) -> list:
        return []

    def rollback(self, n: int) -> None:
        self.runner.rollback(n)

    def reset(self) -> None:
        self.runner.reset()

    def close(self) -> None:
        pass  # the KV cache stays as it is until the next open_sequence (a request alone left it so)


@dataclass
class Job:
    """One request in the engine.

    Attributes:
        prepare: makes its request (in the engine's thread, holding the models' locks: it reads the model's
            policies); ``req``: that request (``req.drafter`` is rebound to sequences of its own when admitted).
        models: the xpuspec models it computes with (their locks are held while it steps; those whose runner runs
            one sequence at a time, for its whole life).
        result: ``(new, scores, logits, stats)`` once done; ``error``: what failed it; ``done``: set then.
    """

    prepare: Optional[Callable[[], Request]]
    models: tuple = ()
    req: Optional[Request] = None
    start: float = field(default_factory=time.perf_counter)
    seq: Optional[Runner] = None
    opened: List[Runner] = field(default_factory=list)
    held: List[object] = field(default_factory=list)  # models whose locks this job holds for its life
    claimed: List[Runner] = field(default_factory=list)  # runners of one sequence this job uses alone
    first_drafter: Optional[Drafter] = None
    filled: bool = False  # prefilled: it decodes
    catch_up: bool = False  # its sequence is behind its context (after the native phase yielded)
    result: Optional[tuple] = None
    error: Optional[BaseException] = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def end(self, result: Optional[tuple] = None, error: Optional[BaseException] = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class _Busy(Exception):
    """A runner of one sequence that another row holds: the job waits."""


class _Yield(Exception):
    """The native phase stops for a job that arrived."""


class Engine:
    """Live jobs on one target runner (see the module docstring). Not thread-safe: one thread steps it.

    Args:
        target: any runner: one with ``open_sequence`` and ``forward_batch`` batches, any other has one row.
        costs: the target's measured costs (a speculative load measures them; otherwise the profile is measured
            here, on the first speculative job).
        max_batch: the most rows a step verifies (1 on a runner of one sequence).
        prefill_budget_s: seconds of prefill a step may spend while other rows decode (``None``: chunks of
            ``prefill_chunk`` tokens whatever they cost).
        prefill_chunk: prompt tokens of a chunk before a prefill pass was timed, or always with no budget.
    """

    def __init__(self, target: Runner, costs: Optional[TargetCosts] = None, max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_budget_s: Optional[float] = PREFILL_BUDGET_S, prefill_chunk: int = PREFILL_CHUNK):
        self.target, self.costs = target, costs if costs is not None else TargetCosts()
        self.batched = batches(target)
        self.rows = target if self.batched else OneSequence(target)
        self.max_batch = max_batch if self.batched else 1
        self.prefill_budget_s, self.prefill_chunk = prefill_budget_s, prefill_chunk
        self.prefill_rate: Optional[float] = None  # prompt tokens per second of the prefill passes, a running mean
        self.waiting: List[Job] = []
        self.live: List[Job] = []
        self.steps = 0
        self.widest = 0  # the most rows a step has verified
        self.guess_counts = DraftCounters()  # every row's guesses so far (split steps weigh them)
        self.guessing_rows = 0  # rows of steps that ran 2 wide for a guess (split steps)
        self._guess_decisions: dict = {}  # (plain width, guessing rows) -> (guess?, the step it holds until)
        self._pass_s: dict = {}  # verify pass width -> running mean of its seconds (_time_pass)
        self._last_width = 0
        self.step_width = target.traits.single_step_width  # this step's width of a row without drafts
        self.interrupt: Callable[[], bool] = lambda: False  # whether jobs wait to join (ends the native phase)
        self.lock_of: Callable[[object], object] = lambda model: None  # an xpuspec model's lock (the loop sets it)

    # -- joining ------------------------------------------------------------------------------------------------
    def tokens_needed(self, req: Request) -> int:
        """KV tokens a request holds at most: prompt, new tokens and the widest verify pass past them."""
        widest = req.policy.widest_needed() + 1 if req.policy is not None else 1
        return len(req.context) + req.limit + max(widest, self.target.traits.guess_width) + 1

    def submit(self, job: Job) -> None:
        """Queue ``job``; it joins between steps once its blocks fit.

        Raises:
            KVBudgetError: its blocks exceed the whole KV budget (it could never run).
        """
        budget = getattr(self.target, "kv_budget_blocks", None) if self.batched else None
        if budget is not None:
            need = self.target.blocks_for(self.tokens_needed(job.req))
            if need > budget:
                raise KVBudgetError(self.target.budget_message(need, f"a request of {len(job.req.context)} prompt "
                                                                     f"tokens and {job.req.limit} new tokens"))
        self.waiting.append(job)

    # -- phase 1: admit and prefill ------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.live) < self.max_batch:
            job = self.waiting[0]
            try:
                self._claim(job)
            except _Busy:
                return  # its runner of one sequence is free once a live job leaves
            seq = self._open_row(job, self.rows.open_sequence())
            try:
                seq.reserve(self.tokens_needed(job.req))
            except KVBudgetError:
                seq.close()
                if self.live:
                    self._release(job)
                    return  # it fits once a live job leaves
                self.target.reset()  # the runner's own sequence (model(...)) gives its blocks back
                seq = self._open_row(job, self.target.open_sequence())
                try:
                    seq.reserve(self.tokens_needed(job.req))
                except KVBudgetError as exc:
                    seq.close()
                    self.waiting.pop(0)
                    self._release(job)
                    job.end(error=exc)
                    continue
            self.waiting.pop(0)
            job.seq = seq
            self.live.append(job)
            try:
                self._begin(job)
            except Exception as exc:  # this job fails alone
                self._fail(job, exc)
                continue
            if job.req.done:
                self._finish(job)

    @property
    def caching_prefixes(self) -> bool:
        """Whether the target's runner shares KV blocks across requests by their tokens (:mod:`xpuspec.kv_blocks`)."""
        return bool(getattr(getattr(self.target, "prefix_cache", None), "prefix_caching", False))

    def _open_row(self, job: Job, seq: Runner) -> Runner:
        """``seq`` started on the prefix cache's blocks for the job's prompt (``stats.cached_tokens``), except for a
        drafter that needs the target's hidden states at every prompt position (EAGLE-3), which a cached prefix
        does not compute."""
        req = job.req
        if req.drafter is not None and req.drafter.needs:
            if self.caching_prefixes:
                log.info("prefix caching skips a request drafted by %s: it reads the target's hidden states at "
                         "every prompt position", type(req.drafter).__name__)
            return seq
        req.stats.cached_tokens = seq.reuse_prefix(req.context)
        return seq

    def _claim(self, job: Job) -> None:
        """Hold for the job's life the locks of its models whose runners run one sequence at a time (so that no
        other thread's call touches their KV cache between steps), and claim those runners in this engine."""
        alone = [m for m in job.models if not self.batched or not batches(m.runner)]
        runners = [m.runner for m in alone if m.runner is not self.target]
        if any(r is c for r in runners for j in self.live for c in j.claimed):
            raise _Busy()
        for model in alone:
            lock = self.lock_of(model)
            if lock is not None:
                lock.acquire()
                job.held.append(lock)
        job.claimed = runners

    def _release(self, job: Job) -> None:
        for lock in job.held:
            lock.release()
        job.held, job.claimed = [], []

    def _begin(self, job: Job) -> None:
        """Bind the job's drafter to its row, begin drafting; a plain greedy lone row may go native."""
        req = job.req
        if self.batched:
            req.drafter = None if req.drafter is None else req.drafter.on_rows(lambda r: self._open(job, r))
        job.first_drafter = req.drafter
        begin_drafting(req, self.target.traits.guess_width)
        if self._native_applies(req):
            self._native(job, "native")

    def _native_applies(self, req: Request) -> bool:
        """A lone plain greedy row may decode in the target's native engine, except with prefix caching on (that
        engine keeps its own KV cache, which the next request could not reuse)."""
        return req.drafter is None and native_greedy_applies(req) and len(self.live) == 1 and not self.waiting \
            and not self.caching_prefixes

    def _open(self, job: Job, runner: Runner) -> Runner:
        """A sequence of its own on a draft model's ``runner`` for ``job``'s drafter."""
        seq = runner.open_sequence() if batches(runner) else OneSequence(runner).open_sequence()
        job.opened.append(seq)
        return seq

    def _native(self, job: Job, name: str) -> None:
        """The native phase: the target's own engine decodes the rest of the lone row's plain greedy request; it
        yields (the row catches its sequence up by prefill) as soon as another job waits to join."""
        def check() -> None:
            if self.interrupt():
                raise _Yield()

        try:
            if hand_over(self.rows, job.req, self.costs, name, check):
                job.filled = True
        except _Yield:
            req = job.req
            req.stats.engine = f"{name}, then xpuspec"
            req.done = bool(req.new) and (req.new[-1] in req.eos or req.produced >= req.limit)
        if job.req.produced and not job.req.done:
            job.catch_up = True

    def _chunk(self) -> int:
        """Prompt tokens a chunk takes: what the budget buys at the measured prefill rate, at least
        :data:`~xpuspec.batching.MIN_PREFILL_CHUNK` (``prefill_chunk`` before a pass was timed, or without a budget)."""
        if self.prefill_budget_s is None or self.prefill_rate is None:
            return self.prefill_chunk
        return max(MIN_PREFILL_CHUNK, round(self.prefill_budget_s * self.prefill_rate))

    def _time_prefill(self, tokens: int, seconds: float) -> None:
        """Fold a prefill pass of ``tokens`` prompt tokens into the rate (passes shorter than a least chunk, whose
        cost is mostly the pass's fixed part, are left out)."""
        if tokens >= MIN_PREFILL_CHUNK and seconds > 0:
            rate = tokens / seconds
            self.prefill_rate = rate if self.prefill_rate is None else (self.prefill_rate + rate) / 2

    def _prefill(self) -> None:
        """One prefill pass per unfilled live job: the whole prompt while no row decodes, else one chunk."""
        decoding = any(j.filled for j in self.live)
        for job in [j for j in self.live if not j.filled]:
            req = job.req
            end = len(req.context) - (1 if job.catch_up else 0)
            todo = end - job.seq.length
            take = min(todo, self._chunk()) if decoding else todo
            t0 = time.perf_counter()
            try:
                if take > 0:
                    rows = job.seq.forward(req.context[job.seq.length:job.seq.length + take], logits_to_keep=1)
                    spent = time.perf_counter() - t0
                    req.stats.prefill_s += spent
                    req.stats.target_forwards += 1
                    self._time_prefill(take, spent)
                if take < todo:
                    decoding = True
                    continue
                job.filled = True
                job.seq.share(req.context)  # the prompt's full blocks, for requests that start alike
                if not job.catch_up:
                    verify_and_emit(job.seq, req, NO_DRAFT, rows, guessed=False)
                self._ready(job)
            except Exception as exc:
                self._fail(job, exc)
                continue
            if req.done:
                self._finish(job)
            decoding = True

    def _ready(self, job: Job) -> None:
        """A prefilled speculative row gets the target's profile (measured here once)."""
        req, policy = job.req, job.req.policy
        if policy is not None and policy.schedule.cost_model and not req.done:
            req.stats.setup_s += profile_target(self.costs, job.seq, req.context[-1], policy.widest_needed(),
                                                self.batched)
            policy.profile = self.costs.profile

    # -- one step -----------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Run every phase once (see the module docstring)."""
        self._admit()
        self._prefill()
        jobs = [j for j in self.live if j.filled and not j.finished]
        self.live = [j for j in self.live if not j.finished]
        if not jobs:
            return
        self.steps += 1
        self.widest = max(self.widest, len(jobs))
        try:
            drafts, guessed, draft_s = self._propose(jobs)
        except Exception as exc:  # a drafter failed: the rows of this step fail, the engine goes on
            return self._fail_all(jobs, exc)
        parts = self._parts(jobs, drafts, guessed)
        t1 = time.perf_counter()
        try:
            rows = self._verify(jobs, parts)
        except Exception as exc:  # every row of the pass fails
            return self._fail_all(jobs, exc)
        verify_s = time.perf_counter() - t1
        self._time_pass(sum(len(p[1]) for p in parts), verify_s)
        self._accept(jobs, drafts, guessed, draft_s, parts, rows, verify_s)
        self.live = [j for j in self.live if not j.finished]

    # -- phase 2: propose -----------------------------------------------------------------------------------------
    def _propose(self, jobs: Sequence[Job]):
        """Every row's draft: free ones first, then lengths by goodput, then the draft model's; else a guess (free
        where 1-token passes are padded; with split steps, where :meth:`_guesses_pay` says it pays, and then the
        rows without a draft run as wide: :attr:`step_width`)."""
        width = self.target.traits.guess_width
        uppers, drafts, draft_s = [], [], []
        for job in jobs:
            req = job.req
            room = req.limit - req.produced - 1
            speculative = req.drafter is not None and req.policy is not None
            upper = req.policy.widths(req.produced, room, req.pad_to) if speculative else Widths(0, 0)
            t0 = time.perf_counter()
            free = cut_draft(req, req.drafter.propose(Widths(0, upper.free)) if upper.free > 0 else NO_DRAFT)
            uppers.append(upper)
            drafts.append(free)
            draft_s.append(time.perf_counter() - t0)
        lengths = self._lengths(jobs, uppers, drafts)
        out, guessed, looked_up = [], [], []
        for i, job in enumerate(jobs):
            req, k, draft = job.req, lengths[i], drafts[i]
            t0 = time.perf_counter()
            if draft.tokens:
                draft = Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k], min(draft.free, k))
            elif k > 0 and req.drafter is not None and req.drafter.uses_model:
                draft = cut_draft(req, req.drafter.propose(Widths(k, 0)))
            room = req.limit - req.produced - 1
            guess = not draft.tokens and req.guesser is not None and room > 0
            if guess:
                draft = cut_draft(req, req.guesser.propose(Widths(0, width - 1)))
                if draft.tokens:
                    looked_up.append(i)
            if not draft.tokens and room > 0:
                draft, guess = forced_draft(req, Widths(k, 0) if k else uppers[i], self.target.traits, room, draft,
                                            guess)
            draft_s[i] += time.perf_counter() - t0
            req.stats.draft_s += draft_s[i]
            out.append(draft)
            guessed.append(guess)
        self.step_width = self.target.traits.single_step_width
        if self.target.traits.split_steps and looked_up:
            if self._guesses_pay(out, looked_up):
                self.step_width = width
                self.guessing_rows += sum(1 for i, d in enumerate(out) if i in looked_up or not d.tokens)
            else:
                for i in looked_up:
                    out[i], guessed[i] = NO_DRAFT, False
        return out, guessed, draft_s

    def _guesses_pay(self, drafts, looked_up) -> bool:
        """Whether the rows without a draft of their own run 2 wide, carrying their guesses (``looked_up``: the rows
        whose guesser found one; the others padded), where a guess costs its token (split steps). All such rows or
        none, so that the pass keeps one of two widths (a new width costs the plugin a re-preparation), and the
        answer holds for :data:`GUESS_DECISION_STEPS` steps of the same widths. It compares the guessing pass's
        expected tokens per second with the plain pass's, by this engine's own passes of each width (timed when
        the width before was the same; a width not timed yet is tried for :data:`GUESS_TRIAL_STEPS` steps) and
        the tokens the guesses added per guessing row so far (:data:`GUESS_PRIOR` before). Yes where the pass is
        padded to the runner's ``traits.split_width`` anyway."""
        plain = sum(1 + len(d.tokens) for i, d in enumerate(drafts) if i not in looked_up) + len(looked_up)
        rows = sum(1 for i, d in enumerate(drafts) if i in looked_up or not d.tokens)
        if plain < self.target.traits.split_width:
            return True
        key = (plain, rows)
        known = self._guess_decisions.get(key)
        if known is not None and self.steps < known[1]:
            return known[0]
        narrow, wide = self._pass_s.get(plain), self._pass_s.get(plain + rows)
        if narrow is None or wide is None:
            pays, steps = wide is None, GUESS_TRIAL_STEPS
        else:
            gain = (self.guess_counts.accepted_tokens + GUESS_PRIOR[0]) / (self.guessing_rows + GUESS_PRIOR[1])
            pays, steps = (len(drafts) + gain * rows) * narrow > len(drafts) * wide, GUESS_DECISION_STEPS
        self._guess_decisions[key] = (pays, self.steps + steps)
        return pays

    def _time_pass(self, width: int, seconds: float) -> None:
        """Fold a verify pass of ``width`` tokens into the running mean of its width (split steps weigh guesses by
        it), where the pass before had the same width (no re-preparation in the time)."""
        if width == self._last_width:
            known = self._pass_s.get(width)
            self._pass_s[width] = seconds if known is None else 0.7 * known + 0.3 * seconds
        self._last_width = width

    def _lengths(self, jobs, uppers, frees) -> List[int]:
        """Draft lengths per row: by the batch's goodput where every row's policy has a profile, else each row's
        own policy's."""
        width = self.target.traits.single_step_width
        profile = self.costs.profile
        choices = []
        for job, upper, free in zip(jobs, uppers, frees):
            policy = job.req.policy
            if free.tokens:
                cap, by_model = len(free.tokens), False
            else:
                cap, by_model = (upper.model if job.req.drafter is not None and job.req.drafter.uses_model else 0), True
            if policy is None or policy.profile is None or profile is None or len(jobs) == 1:
                choices.append(None if cap == 0 or policy is None else cap)
                continue
            guess = policy.guess_rate() if width > 1 and job.req.guesser is not None else 0.0
            choices.append(RowChoice(policy.rates_for(by_model, max(cap, 1))[:cap],
                                     policy.draft_step_s() if by_model else 0.0, cap, width, 1.0 + guess))
        if profile is not None and all(isinstance(c, RowChoice) or c is None for c in choices) and \
                any(isinstance(c, RowChoice) for c in choices):
            rows = [c if isinstance(c, RowChoice) else RowChoice([], 0.0, 0, width, 1.0) for c in choices]
            lengths = batch_draft_lengths(rows, profile)
            # A draft model's cost is measured only in rounds it drafts in: a request drafts at least once with it,
            # so that a cost estimated under another load cannot keep the model idle for good.
            return [max(k, 1) if row.draft_step > 0 and row.cap and not job.req.policy.measured_draft_step else k
                    for k, row, job in zip(lengths, rows, jobs)]
        return [c.cap if isinstance(c, RowChoice) else (c or 0) for c in choices]

    # -- phase 3: verify --------------------------------------------------------------------------------------------
    def _parts(self, jobs, drafts, guessed):
        """Every row's ``(sequence, [last token] + drafts + padding)``: padded to the step's width (the target's
        1-token width, or the guessing width of split steps: :attr:`step_width`), and a lone row with drafts to the
        widest so far where the target keeps one verify width."""
        traits = self.target.traits
        parts = []
        for job, draft, guess in zip(jobs, drafts, guessed):
            verify = [job.req.context[-1]] + draft.tokens
            width = self.step_width
            if traits.fixed_verify_width and draft.tokens and not guess and len(jobs) == 1:
                job.req.pad_to = width = max(job.req.pad_to, len(verify), width)
            parts.append((job.seq, verify + [verify[-1]] * max(0, width - len(verify))))
        return parts

    def _verify(self, jobs, parts):
        """ONE pass of the target over every row's part (a lone row through its sequence's own ``forward``, which
        picks the compiled copy of its width); per row ``[len(part), vocab]`` float32. A row's sequence keeps the
        outputs its drafter ``needs`` besides logits (``last_taps``), which ``verify_and_emit`` hands over."""
        if len(parts) == 1:
            return [parts[0][0].forward_steps(parts[0][1])]
        return self.rows.forward_batch(parts)

    # -- phases 4-6: accept and roll back, emit, report ---------------------------------------------------------------
    def _accept(self, jobs, drafts, guessed, draft_s, parts, rows, verify_s) -> None:
        total = sum(len(p[1]) for p in parts)
        profile = self.costs.profile
        for job, draft, row, (_, fed), was_guess, d_s in zip(jobs, drafts, rows, parts, guessed, draft_s):
            req = job.req
            try:
                n = len(draft.tokens) + 1
                job.seq.rollback(len(fed) - n)  # the padding
                req.stats.target_forwards += 1
                req.stats.verify_s += verify_s
                accepted = verify_and_emit(job.seq, req, draft, row[:n], was_guess)
                if was_guess:
                    self.guess_counts.add_round(len(draft.tokens), accepted)
                own_s = verify_s * profile.pass_s(len(fed)) / profile.pass_s(total) if profile else verify_s
                if after_round(req, draft, accepted, was_guess, d_s, own_s, len(fed)) is Decision.DROP_MODEL:
                    drop_model(req)
                    if not req.done and self._native_applies(req):
                        self._native(job, "native after speculation")
                        job.filled = not job.catch_up
            except Exception as exc:
                self._fail(job, exc)
                continue
            if req.done:
                self._finish(job)

    # -- leaving ------------------------------------------------------------------------------------------------
    def _close(self, job: Job, share: bool = False) -> None:
        """Free the job's sequences (after offering their accepted blocks to the prefix cache, when ``share``)."""
        if share and job.seq is not None and job.req is not None:
            job.seq.share(job.req.context)
        if job.first_drafter is not None and not job.finished:
            try:
                job.first_drafter.end()
            except Exception:  # the job has failed already; its blocks are freed below
                pass
        for seq in [job.seq, *job.opened]:
            if seq is not None:
                seq.close()
        job.opened = []
        self._release(job)

    def _finish(self, job: Job) -> None:
        req = job.req
        try:
            if job.first_drafter is not None:
                job.first_drafter.end()
            end_drafting(req, job.first_drafter)
            result, error = finish_request(req, job.start), None
        except Exception as exc:
            result, error = None, exc
        job.first_drafter = None
        self._close(job, share=error is None)
        job.end(result, error)

    def _fail(self, job: Job, exc: BaseException) -> None:
        self._close(job)
        if not job.finished:
            job.end(error=exc)

    def _fail_all(self, jobs, exc: BaseException) -> None:
        for job in jobs:
            self._fail(job, exc)
        self.live = [j for j in self.live if not j.finished]

    def cancel(self, job: Job, error: Optional[BaseException] = None) -> None:
        """Take ``job`` out (a caller that left); its blocks are freed."""
        if job in self.waiting:
            self.waiting.remove(job)
        if job in self.live:
            self.live.remove(job)
            self._close(job)
        if not job.finished:
            job.end(error=error or RuntimeError("cancelled"))

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.live

    def run(self, jobs: Sequence[Job]) -> None:
        """Step in the calling thread until ``jobs`` (already prepared) are finished: for tests and benchmarks that
        drive an engine by hand; :class:`EngineLoop` is how models run it."""
        for job in jobs:
            if job.req is None:
                job.req = job.prepare()
            self.submit(job)
        drafters = [j.req.drafter for j in jobs if j.req.drafter is not None]
        with torch_on_one_thread([self.target, *(r for d in drafters for r in d.runners())]):
            while not all(j.finished for j in jobs):
                self.step()


class EngineLoop:
    """The one loop of a target model's :class:`Engine`: a daemon thread, started on first use, that steps the
    engine while it has jobs. Callers :meth:`run` their jobs and wait on their own jobs' events.

    Args:
        engine: the engine it owns.
        lock_of: an xpuspec model's lock; the loop holds, while it steps, the locks of every model its jobs use.
    """

    def __init__(self, engine: Engine, lock_of: Callable[[object], object]):
        self.engine, self.lock_of = engine, lock_of
        engine.lock_of = lock_of
        self.cond = threading.Condition()
        self.pending: List[Job] = []  # submitted, not yet handed to the engine (its thread does that)
        self.cancelled: List[Job] = []
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        engine.interrupt = lambda: bool(self.pending or self.cancelled)

    @property
    def idle(self) -> bool:
        with self.cond:
            return not self.pending and self.engine.idle

    def run(self, jobs: Sequence[Job]) -> None:
        """Submit ``jobs`` and return once they are finished (their ``result`` or ``error`` set). An exception in
        the waiting thread (Ctrl-C's KeyboardInterrupt) cancels them and is raised again at once."""
        with self.cond:
            if self._stopping:
                raise RuntimeError("this model's engine was stopped; load the model again.")
            self.pending.extend(jobs)
            self._start()
            self.cond.notify_all()
        try:
            for job in jobs:
                while not job.done.wait(0.25):
                    pass
        except BaseException:
            with self.cond:
                self.cancelled.extend(j for j in jobs if not j.finished)
                self.cond.notify_all()
            raise

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="xpuspec-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread; jobs not finished fail. The loop cannot run again."""
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self._stopping or self.pending or self.cancelled or not self.engine.idle):
                    self.cond.wait()
                if self._stopping:
                    break
            self._step()
        error = RuntimeError("the model's engine stopped")
        with self.cond:
            for job in self.pending:
                job.end(error=error)
            self.pending = []
        for job in [*self.engine.waiting, *self.engine.live]:
            self.engine.cancel(job, error)

    def _step(self) -> None:
        """Hold the locks of every model the jobs use (sorted by id: two loops sharing models cannot deadlock), take
        in what was submitted and cancelled, and step once."""
        engine = self.engine
        with self.cond:
            jobs = [*engine.live, *engine.waiting, *self.pending]
        models = {id(m): m for j in jobs for m in j.models}
        with ExitStack() as stack:
            for model in sorted(models.values(), key=id):
                lock = self.lock_of(model)
                if lock is not None:
                    stack.enter_context(lock)
            with self.cond:  # those submitted since whose models are all held join now, the others next step
                joining = [j for j in self.pending if all(id(m) in models for m in j.models)]
                self.pending = [j for j in self.pending if j not in joining]
                cancelled, self.cancelled = self.cancelled, []
            runners = [engine.target, *(r for j in jobs if j.req is not None and j.req.drafter is not None
                                        for r in j.req.drafter.runners())]
            with torch_on_one_thread(runners):
                for job in cancelled:
                    engine.cancel(job, KeyboardInterrupt())
                for job in joining:
                    if job.finished:
                        continue
                    try:
                        job.req = job.prepare()
                        engine.submit(job)
                    except Exception as exc:  # this job fails alone; its caller raises it
                        job.end(error=exc)
                try:
                    engine.step()
                except Exception as exc:  # a defect of the engine: fail its jobs rather than the loop
                    for job in [*engine.waiting, *engine.live]:
                        engine.cancel(job, exc)


def decode(target: Runner, prompt: List[int], config, streamer=None, drafter: Optional[Drafter] = None,
           policy=None, costs: Optional[TargetCosts] = None, stop=None, setup_s: float = 0.0):
    """Generate after ``prompt`` with ``target`` as the one row of an engine stepped in the calling thread (for
    tests and benchmarks on bare runners; models run their :class:`EngineLoop`).

    Args:
        target: the target model (any runner); prompt: prompt token ids (non-empty); config: a validated
        GenerationConfig; streamer: a transformers streamer or ``None``; drafter, policy: speculation (a policy is
        required with a drafter); costs: the target's measured costs; stop: stop strings; setup_s: seconds spent
        preparing (counted in the stats).

    Returns:
        ``(new_tokens, scores, raw_logits, stats)`` as :func:`xpuspec.decode.finish_request` gives them.
    """
    from .decode import new_request

    engine = Engine(target, costs, max_batch=1)
    job = Job(None, req=new_request(prompt, config, streamer, drafter, policy, stop, setup_s))
    engine.run([job])
    if job.error is not None:
        raise job.error
    return job.result


def loop_for(model, make: Callable[[], EngineLoop]) -> EngineLoop:
    """``make()``, stopped when ``model`` is collected (the loop holds no reference to it)."""
    loop = make()
    weakref.finalize(model, loop.stop)
    return loop
