"""The batched engine: many requests decoded together, their verify passes in one forward of the target.

An :class:`Engine` keeps live :class:`Job` s, each with its own tokens (:class:`xpuspec.decode.Request`), its own
sequence on the target's block pool (:meth:`PagedRunner.open_sequence`-style runners: ``open_sequence`` and
``forward_batch``), its drafter (a draft model drafts on a sequence of its own) and its policy. One :meth:`Engine.step`:

1. admits waiting jobs whose KV blocks fit (prefill, one pass each, as a request alone does it);
2. free drafts first (prompt lookup, suffix: looked up for every row), then the draft lengths of the whole batch by
   goodput (:mod:`xpuspec.speculative.batch`), then the draft model's drafts, row by row;
3. ONE ``forward_batch`` over every row's ``[last token] + drafts`` (a row shorter than the target's 1-token width
   is padded, as a request alone pads it, so each row computes as it would alone);
4. per row: greedy acceptance or rejection sampling, rollback of its own rejected drafts, emission, the policy's
   report (:func:`xpuspec.decode.verify_and_emit`, :func:`xpuspec.decode.after_round`);
5. finished rows (EOS, limit, stop string) leave and free their blocks.

A :class:`Batcher` turns concurrent callers into rows: each submits its jobs and waits; one caller at a time is
elected driver, holds the models' locks, and steps the engine until its own jobs are done, then hands over.
"""

import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from .decode import (NO_DRAFT, Decision, Request, after_round, begin_drafting, cut_draft, drop_model, end_drafting,
                     finish_request, forced_draft, verify_and_emit)
from .errors import BatchNotSupportedError, KVBudgetError
from .runner import Runner, torch_on_one_thread
from .speculative.batch import BATCH_SWEEP_WIDTHS, RowChoice, batch_draft_lengths
from .speculative.drafters import Draft, Drafter, HybridDrafter, ModelDrafter
from .speculative.overlap import OverlappedDrafter
from .speculative.policy import Widths
from .speculative.profile import TargetCosts, measure_profile

#: The most rows one step verifies; more jobs wait.
DEFAULT_MAX_BATCH = 16


def check_batch_runner(runner: Runner, what: str = "batch > 1") -> None:
    """Refuse a runner that runs one sequence at a time.

    Raises:
        BatchNotSupportedError: the runner's traits say it does not batch (no ``open_sequence`` / ``forward_batch``).
    """
    if not runner.traits.batches:
        raise BatchNotSupportedError(
            f"{what} needs a runner that verifies several sequences in one pass; this model's "
            f"{type(runner).__name__} on {runner.device} runs one sequence at a time (the torch backend, pipeline "
            "stages and the NPU do). Load the model on the OpenVINO backend on one CPU or GPU (paged attention, "
            "the default there), or call generate once per prompt in a loop.")


def on_sequences(drafter: Optional[Drafter], opened: List[Runner]) -> Optional[Drafter]:
    """``drafter`` with each draft model drafting on a sequence of its own (appended to ``opened``); an overlapped
    drafter drafts in the engine's thread instead (a sequence's passes share one compiled model).

    Raises:
        BatchNotSupportedError: a draft model whose runner runs one sequence at a time.
    """
    if isinstance(drafter, OverlappedDrafter):
        drafter = drafter.model
    if isinstance(drafter, ModelDrafter):
        check_batch_runner(drafter.runner, "a draft model in a batch")
        seq = drafter.runner.open_sequence()
        opened.append(seq)
        return ModelDrafter(seq, drafter.vocab_size, drafter.context_length, drafter.extension)
    if isinstance(drafter, HybridDrafter):
        model = on_sequences(drafter.model, opened)
        fallback = drafter.lookup if drafter.fallback is drafter.lookup else drafter.fallback
        return HybridDrafter(drafter.lookup, model, fallback)
    return drafter


@dataclass
class Job:
    """One request in the engine.

    Attributes:
        prepare: makes its request (in the driver's thread, holding the models' locks: it reads the model's
            policies); ``req``: that request (``req.drafter`` is rebound to sequences of its own when admitted).
        models: the xpuspec models it computes with (their locks are held while it runs).
        result: ``(new, scores, logits, stats)`` once done; ``error``: what failed it.
    """

    prepare: Callable[[], Request]
    models: tuple = ()
    req: Optional[Request] = None
    start: float = field(default_factory=time.perf_counter)
    seq: Optional[Runner] = None
    opened: List[Runner] = field(default_factory=list)
    first_drafter: Optional[Drafter] = None
    result: Optional[tuple] = None
    error: Optional[BaseException] = None

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None


class Engine:
    """Live jobs on one target runner (see the module docstring). Not thread-safe: one driver steps it.

    Args:
        target: a runner with ``open_sequence`` and ``forward_batch``.
        costs: the target's measured costs (a speculative load measures the batch widths; otherwise the profile is
            measured here, on the first speculative job).
        max_batch: the most rows a step verifies.

    Raises:
        BatchNotSupportedError: a runner that runs one sequence at a time.
    """

    def __init__(self, target: Runner, costs: Optional[TargetCosts] = None, max_batch: int = DEFAULT_MAX_BATCH):
        check_batch_runner(target)
        self.target, self.costs, self.max_batch = target, costs if costs is not None else TargetCosts(), max_batch
        self.waiting: List[Job] = []
        self.live: List[Job] = []
        self.steps = 0
        self.widest = 0  # the most rows a step has verified
        self.swept = False  # the batch-width sweep ran (once: a sequence without blocks for it sweeps 1-16)

    # -- joining ------------------------------------------------------------------------------------------------
    def tokens_needed(self, req: Request) -> int:
        """KV tokens a request holds at most: prompt, new tokens and the widest verify pass past them."""
        widest = req.policy.widest_needed() + 1 if req.policy is not None else 1
        return len(req.context) + req.limit + max(widest, self.target.traits.single_step_width) + 1

    def submit(self, job: Job) -> None:
        """Queue ``job``; it joins between steps once its blocks fit.

        Raises:
            KVBudgetError: its blocks exceed the whole KV budget (it could never run).
        """
        budget = getattr(self.target, "kv_budget_blocks", None)
        need = self.target.blocks_for(self.tokens_needed(job.req))
        if budget is not None and need > budget:
            raise KVBudgetError(self.target.budget_message(need, f"a request of {len(job.req.context)} prompt "
                                                                 f"tokens and {job.req.limit} new tokens"))
        self.waiting.append(job)

    def _admit(self) -> None:
        while self.waiting and len(self.live) < self.max_batch:
            job = self.waiting[0]
            seq = self.target.open_sequence()
            try:
                seq.reserve(self.tokens_needed(job.req))
            except KVBudgetError:
                seq.close()
                if self.live:
                    return  # it fits once a live job leaves
                self.target.reset()  # the runner's own sequence (batch-1 requests) gives its blocks back
                seq = self.target.open_sequence()
                try:
                    seq.reserve(self.tokens_needed(job.req))
                except KVBudgetError as exc:
                    seq.close()
                    self.waiting.pop(0)
                    job.error = exc
                    continue
            self.waiting.pop(0)
            job.seq = seq
            try:
                self._prefill(job)
            except Exception as exc:  # this job fails alone
                self._close(job)
                job.error = exc
                continue
            if job.req.done:
                self._finish(job)
            else:
                self.live.append(job)

    def _prefill(self, job: Job) -> None:
        req = job.req
        req.drafter = on_sequences(req.drafter, job.opened)
        job.first_drafter = req.drafter
        begin_drafting(req, self.target.traits.single_step_width)
        t0 = time.perf_counter()
        rows = job.seq.forward(list(req.context), logits_to_keep=1)
        req.stats.prefill_s, req.stats.target_forwards = time.perf_counter() - t0, 1
        verify_and_emit(job.seq, req, NO_DRAFT, rows, guessed=False)
        policy = req.policy
        if policy is not None and policy.schedule.cost_model and not req.done:
            if not self.swept and (self.costs.profile is None or self.costs.profile.widest < BATCH_SWEEP_WIDTHS[-1]):
                self.swept = True
                t0 = time.perf_counter()
                try:  # once per target, on the first speculative job's sequence
                    self.costs.profile = measure_profile(job.seq, req.context[-1], widths=BATCH_SWEEP_WIDTHS)
                except KVBudgetError:  # no room for the sweep's widest passes: the sweep of a single request
                    self.costs.profile = self.costs.profile or measure_profile(job.seq, req.context[-1], 16)
                req.stats.setup_s += time.perf_counter() - t0
            policy.profile = self.costs.profile

    # -- one step -----------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit what fits, run one round for every live job, and let finished jobs leave."""
        self._admit()
        if not self.live:
            return
        self.steps += 1
        jobs = list(self.live)
        self.widest = max(self.widest, len(jobs))
        try:
            drafts, guessed, draft_s = self._draft(jobs)
        except Exception as exc:  # a drafter failed: the rows of this step fail, the engine goes on
            for job in jobs:
                self._fail(job, exc)
            self.live = []
            return
        width = self.target.traits.single_step_width
        parts = []
        for job, draft in zip(jobs, drafts):
            verify = [job.req.context[-1]] + draft.tokens
            parts.append((job.seq, verify + [verify[-1]] * max(0, width - len(verify))))
        t1 = time.perf_counter()
        try:
            rows = self.target.forward_batch(parts)
        except Exception as exc:  # every row of the pass fails
            for job in jobs:
                self._fail(job, exc)
            self.live = []
            return
        verify_s = time.perf_counter() - t1
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
                own_s = verify_s * profile.pass_s(len(fed)) / profile.pass_s(total) if profile else verify_s
                if after_round(req, draft, accepted, was_guess, d_s, own_s, len(fed)) is Decision.DROP_MODEL:
                    drop_model(req)
            except Exception as exc:
                self._fail(job, exc)
                continue
            if req.done:
                self._finish(job)
        self.live = [j for j in self.live if not j.finished]

    def _draft(self, jobs: Sequence[Job]):
        """Every row's draft: free ones first, then lengths by goodput, then the draft model's."""
        width = self.target.traits.single_step_width
        uppers, drafts, draft_s = [], [], []
        for job in jobs:
            req = job.req
            room = req.limit - req.produced - 1
            speculative = req.drafter is not None and req.policy is not None
            upper = req.policy.widths(req.produced, room, 0) if speculative else Widths(0, 0)
            t0 = time.perf_counter()
            free = cut_draft(req, req.drafter.propose(Widths(0, upper.free)) if upper.free > 0 else NO_DRAFT)
            uppers.append(upper)
            drafts.append(free)
            draft_s.append(time.perf_counter() - t0)
        lengths = self._lengths(jobs, uppers, drafts)
        out, guessed = [], []
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
            if not draft.tokens and room > 0:
                draft, guess = forced_draft(req, Widths(k, 0) if k else uppers[i], self.target.traits, room, draft,
                                            guess)
            draft_s[i] += time.perf_counter() - t0
            req.stats.draft_s += draft_s[i]
            out.append(draft)
            guessed.append(guess)
        return out, guessed, draft_s

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
            if policy is None or policy.profile is None or profile is None:
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

    # -- leaving ------------------------------------------------------------------------------------------------
    def _close(self, job: Job) -> None:
        if job.first_drafter is not None and not job.finished:
            try:
                job.first_drafter.end()
            except Exception:  # the job has failed already; its blocks are freed below
                pass
        for seq in [job.seq, *job.opened]:
            if seq is not None:
                seq.close()
        job.opened = []

    def _finish(self, job: Job) -> None:
        req = job.req
        try:
            if job.first_drafter is not None:
                job.first_drafter.end()
            end_drafting(req, job.first_drafter)
            job.result = finish_request(req, job.start, self.costs)
        except Exception as exc:
            job.error = exc
        finally:
            job.first_drafter = None
            self._close(job)

    def _fail(self, job: Job, exc: BaseException) -> None:
        self._close(job)
        job.error = exc

    def cancel(self, job: Job) -> None:
        """Take ``job`` out (a client that left); its blocks are freed."""
        if job in self.waiting:
            self.waiting.remove(job)
        if job in self.live:
            self.live.remove(job)
            self._close(job)
        if not job.finished:
            job.error = RuntimeError("cancelled")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.live


class Batcher:
    """Concurrent callers' jobs become rows of one :class:`Engine` (see the module docstring).

    Args:
        engine: the engine.
        locks: the lock of an xpuspec model (``locks(model)``), held by the driver for every model its jobs use.
    """

    def __init__(self, engine: Engine, locks: Callable[[object], threading.RLock]):
        self.engine, self.locks = engine, locks
        self.cond = threading.Condition()
        self.driving = False
        self.pending: List[Job] = []  # submitted, not yet handed to the engine (the driver does that)

    @property
    def idle(self) -> bool:
        with self.cond:
            return not self.driving and not self.pending and self.engine.idle

    def run(self, jobs: Sequence[Job]) -> None:
        """Submit ``jobs`` and return once they are finished (their ``result`` or ``error`` set); the calling
        thread drives the engine while it is elected."""
        with self.cond:
            self.pending.extend(jobs)
            self.cond.notify_all()
        while True:
            with self.cond:
                while self.driving and not all(j.finished for j in jobs):
                    self.cond.wait()
                if all(j.finished for j in jobs):
                    return
                self.driving = True
            try:
                self._drive(jobs)
            finally:
                with self.cond:
                    self.driving = False
                    self.cond.notify_all()

    def _drive(self, mine: Sequence[Job]) -> None:
        """Hold the locks of every model the live and pending jobs use (sorted by id, as the models' own
        ``_exclusive`` does), and step until ``mine`` are finished."""
        with self.cond:
            models = {id(m): m for j in (*self.engine.live, *self.engine.waiting, *self.pending) for m in j.models}
        with ExitStack() as stack:
            for model in sorted(models.values(), key=id):
                stack.enter_context(self.locks(model))
            runners = [self.engine.target]
            with torch_on_one_thread(runners):
                while not all(j.finished for j in mine):
                    with self.cond:
                        joining = [j for j in self.pending if all(id(m) in models for m in j.models)]
                        self.pending = [j for j in self.pending if j not in joining]
                    for job in joining:
                        try:
                            job.req = job.prepare()
                            self.engine.submit(job)
                        except Exception as exc:  # this job fails alone; its caller raises it
                            job.error = exc
                    self.engine.step()
                    with self.cond:
                        self.cond.notify_all()
