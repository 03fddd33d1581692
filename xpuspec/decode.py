"""The decode loop: plain and speculative decoding are one loop of rounds.

The target's prefill gives the first token. Then each round (:func:`decode_round`): the speculation policy says how
many tokens to draft (:mod:`xpuspec.speculative.policy`); the drafter proposes them; the target verifies
``[last token] + drafts`` in one pass; greedy acceptance or rejection sampling keeps a prefix of the drafts and adds
the target's own next token (:mod:`xpuspec.speculative.verify`); the KV cache is rolled back past the rejected
drafts; the tokens are emitted up to EOS, the length limit or a stop string; the drafter and the policy hear what
the target kept. A round without drafts is a plain decode step.

Two backend traits shape a round (:class:`xpuspec.runner.RunnerTraits`). Where a backend runs its 1-token passes 2
tokens wide, a greedy round without drafts puts a free guess from prompt lookup in the paid-for slot: verification
keeps the output the plain output, and a confirmed guess is a token for nothing. Where a backend keeps one verify
width, a round with drafts is padded to the widest so far in the request, the padding rolled back at once.

Plain greedy decoding whose only processors are the length rules runs in the target's native engine where it has
one (:meth:`xpuspec.runner.Runner.native_greedy`), and so does the rest of a request whose draft model stopped.
"""

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from transformers import GenerationConfig

from .generation import GenerationStats, StopStrings, eos_ids, max_new_tokens, min_new_tokens
from .runner import Runner, torch_on_one_thread
from .scoring import Scorer, scorer_for
from .speculative.drafters import NO_DRAFT, Drafter, DraftRequest, PromptLookupDrafter
from .speculative.eagle3_drafter import hand_hidden
from .speculative.policy import AcceptanceCounts, Decision, RequestPolicy, RoundOutcome, Widths
from .speculative.profile import TargetCosts, measure_profile
from .speculative.verify import accept_prefix, greedy_accept, rejection_sample

#: The n-grams a plain step's free guess matches (3 down to 1): the guess costs nothing, so a 1-gram is worth it.
GUESS_NGRAMS = (3, 1)


@dataclass
class Request:
    """One request being decoded: its tokens and everything a round reads or updates.

    Attributes:
        context: prompt then output token ids (drafters read this very list).
        prompt_len: tokens of the prompt at the start of ``context``.
        limit: the most new tokens; ``min_new``: new tokens before EOS may end it.
        policy: the speculation policy of this request (``None`` for plain decoding).
        pad_to: the width rounds with drafts are padded to (a backend that keeps one width).
        scores, logits: processed scores and raw logits per new token, when the config asks for them.
    """

    context: List[int]
    prompt_len: int
    config: GenerationConfig
    scorer: Scorer
    limit: int
    min_new: int
    eos: frozenset
    stop: Optional[StopStrings] = None
    streamer: object = None
    drafter: Optional[Drafter] = None
    policy: Optional[RequestPolicy] = None
    guesser: Optional[PromptLookupDrafter] = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    scores: List[torch.Tensor] = field(default_factory=list)
    logits: List[torch.Tensor] = field(default_factory=list)
    pad_to: int = 0
    done: bool = False
    first_token_at: Optional[float] = None

    @property
    def new(self) -> List[int]:
        return self.context[self.prompt_len:]

    @property
    def produced(self) -> int:
        return len(self.context) - self.prompt_len


def decode(target: Runner, prompt: List[int], config: GenerationConfig, streamer=None, drafter: Optional[Drafter] = None,
           policy: Optional[RequestPolicy] = None, costs: Optional[TargetCosts] = None,
           stop: Optional[StopStrings] = None, setup_s: float = 0.0):
    """Generate after ``prompt`` with ``target``, speculatively when a ``drafter`` is given.

    Args:
        target: the target model; its KV cache is reset first.
        prompt: prompt token ids (non-empty).
        config: a validated GenerationConfig (greedy or sampling).
        streamer: a transformers streamer, or ``None``.
        drafter: proposes draft tokens; ``None`` decodes plainly.
        policy: the request's speculation policy (required with a ``drafter``).
        costs: the target's measured costs, kept on the model across requests (its profile is measured here
            on the first speculative request with the cost model on).
        stop: stop strings, or ``None``.
        setup_s: seconds already spent preparing this request (counted in its stats).

    Returns:
        ``(new_tokens, scores, raw_logits, stats)``: generated ids; processed scores and raw logits per new token
        (``[1, vocab]`` float32, filled only when ``output_scores`` / ``output_logits`` are set); the stats.
    """
    start = time.perf_counter()
    costs = costs if costs is not None else TargetCosts()
    req = new_request(prompt, config, streamer, drafter, policy, stop, setup_s)
    with torch_on_one_thread([target, *(drafter.runners() if drafter is not None else ())]):
        native = _native_greedy_applies(req) and stop is None
        if drafter is None and native and _hand_over(target, req, costs, "native"):
            return finish_request(req, start, costs)
        first_drafter = drafter
        begin_drafting(req, target.traits.single_step_width)
        try:
            target.reset()
            t0 = time.perf_counter()
            rows = target.forward(prompt, logits_to_keep=1)
            req.stats.prefill_s, req.stats.target_forwards = time.perf_counter() - t0, 1
            verify_and_emit(target, req, NO_DRAFT, rows, guessed=False)
            if policy is not None and policy.schedule.cost_model and not target.traits.lockstep and not req.done:
                if costs.profile is None:  # once per target; timings differ between a pipeline's ranks
                    t0 = time.perf_counter()
                    costs.profile = measure_profile(target, req.context[-1], policy.widest_needed())
                    req.stats.setup_s += time.perf_counter() - t0
                policy.profile = costs.profile
            while not req.done:
                if decode_round(target, req) is Decision.DROP_MODEL:
                    drop_model(req)
                    if req.drafter is None and native and _hand_over(target, req, costs, "native after speculation"):
                        break
        finally:
            if first_drafter is not None:
                first_drafter.end()
        end_drafting(req, first_drafter)
        return finish_request(req, start, costs)


def new_request(prompt: List[int], config: GenerationConfig, streamer=None, drafter: Optional[Drafter] = None,
                policy: Optional[RequestPolicy] = None, stop: Optional[StopStrings] = None,
                setup_s: float = 0.0) -> Request:
    """A :class:`Request` for ``prompt`` under a validated ``config``: the first piece of a request's life (then
    :func:`begin_drafting`, prefill and rounds of ``verify_and_emit`` and :func:`after_round`, :func:`end_drafting`,
    ``finish_request``), which :func:`decode` runs for one request and :mod:`xpuspec.engine` for many."""
    req = Request(list(prompt), len(prompt), config, scorer_for(config, len(prompt)), max_new_tokens(config, len(prompt)),
                  min_new_tokens(config, len(prompt)), frozenset(eos_ids(config)), stop, streamer, drafter, policy)
    req.stats.prompt_tokens, req.stats.setup_s = len(prompt), setup_s
    if drafter is not None:  # a speculative request reports its counts, zeros when nothing was drafted
        req.stats.acceptance_counts = AcceptanceCounts()
    return req


def begin_drafting(req: Request, single_step_width: int) -> None:
    """Begin the request's drafter, and a free guesser where the target's 1-token passes run wider
    (``single_step_width`` > 1, greedy): called before the target's prefill."""
    if not req.config.do_sample and single_step_width > 1:
        req.guesser = PromptLookupDrafter(*GUESS_NGRAMS)
    for part in (req.drafter, req.guesser):
        if part is not None:
            part.begin(DraftRequest(req.context, req.scorer, bool(req.config.do_sample),
                                    req.policy.schedule.confidence_threshold if req.policy else 0.0))


def end_drafting(req: Request, first_drafter: Optional[Drafter]) -> None:
    """End the drafter the request began with and note its busy time."""
    if first_drafter is not None:
        busy = first_drafter.busy_s
        req.stats.draft_busy_s = req.stats.draft_s if busy is None else busy


def drop_model(req: Request) -> None:
    """The policy stopped the draft model: draft with what is free (a hybrid's lookup), or not at all."""
    req.drafter, req.pad_to = req.drafter.without_model(), 0
    req.stats.draft_model_stopped_after = req.produced


def after_round(req: Request, draft, accepted: int, guessed: bool, draft_s: float, verify_s: float,
                width: int) -> Decision:
    """Tell the drafter and the policy what the target kept of ``draft``; returns the policy's decision."""
    if req.done or not draft.tokens:
        return Decision.GO_ON
    if not guessed:
        req.drafter.accept(accepted)
    if req.policy is None:
        return Decision.GO_ON
    outcome = RoundOutcome(len(draft.tokens), accepted, draft.free, draft_s, verify_s, width)
    return req.policy.report(outcome, req.produced, req.pad_to)


def decode_round(target: Runner, req: Request) -> Decision:
    """One round: propose, pad, verify, roll back, emit, report (see the module docstring)."""
    room = req.limit - req.produced - 1  # drafts that can still become output
    widths = req.policy.widths(req.produced, room, req.pad_to) if req.drafter is not None else Widths(0, 0)
    t0 = time.perf_counter()
    draft = req.drafter.propose(widths) if widths.model or widths.free else NO_DRAFT
    guessed = not draft.tokens and req.guesser is not None and room > 0
    if guessed:
        draft = req.guesser.propose(Widths(0, target.traits.single_step_width - 1))
    t1 = time.perf_counter()
    verify = [req.context[-1]] + draft.tokens
    padding = 0
    if target.traits.fixed_verify_width and draft.tokens and not guessed:  # one input width for rounds with drafts
        req.pad_to = max(req.pad_to, len(verify))
        padding = req.pad_to - len(verify)
    rows = target.forward(verify + [verify[-1]] * padding)[:len(verify)]
    target.rollback(padding)
    t2 = time.perf_counter()
    stats = req.stats
    stats.target_forwards += 1
    stats.draft_s += t1 - t0
    stats.verify_s += t2 - t1
    accepted = verify_and_emit(target, req, draft, rows, guessed)
    return after_round(req, draft, accepted, guessed, t1 - t0, t2 - t1, len(verify) + padding)


def verify_and_emit(target: Runner, req: Request, draft, rows: torch.Tensor, guessed: bool) -> int:
    """Judge ``draft`` by the target's ``rows`` (``[len(draft.tokens) + 1, vocab]``), roll back the rejected
    drafts, emit the kept tokens and the target's own, and count them; returns the drafts accepted. A drafter that
    needs the target's hidden states gets those of the pass first."""
    hand_hidden(req.drafter, getattr(target, "last_taps", None))
    scored = None  # processed scores, built only where sampling or output_scores needs them
    if req.config.do_sample:
        scored = req.scorer.rows(req.context, draft.tokens, rows)
        n, token = rejection_sample(draft.tokens, draft.probs, torch.softmax(scored, dim=-1))
    elif req.config.output_scores:
        scored = req.scorer.rows(req.context, draft.tokens, rows)
        n, token = greedy_accept(draft.tokens, scored)
    else:
        n, token = accept_prefix(draft.tokens, req.scorer.best(req.context, draft.tokens, rows))
    target.rollback(len(draft.tokens) - n)
    emitted = _emit(req, draft.tokens[:n] + [token], scored, rows)
    kept, stats = min(n, emitted), req.stats
    if guessed:
        stats.guessed_tokens += len(draft.tokens)
        stats.guesses_accepted += kept
    elif draft.tokens:
        stats.drafted_tokens += len(draft.tokens)
        stats.accepted_tokens += kept
        stats.acceptance_counts.add_round(len(draft.tokens), kept)
    return n


def _emit(req: Request, tokens: Sequence[int], scored: Optional[torch.Tensor], rows: torch.Tensor) -> int:
    """Append ``tokens`` to the output one by one, up to EOS, the limit or a stop string; how many were emitted."""
    for j, token in enumerate(tokens):
        if req.config.output_scores:
            req.scores.append(scored[j:j + 1])
        if req.config.output_logits:
            req.logits.append(rows[j:j + 1])
        req.context.append(token)
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        if req.streamer is not None:
            req.streamer.put(torch.tensor([token]))
        if token in req.eos or req.produced >= req.limit or (req.stop is not None and req.stop.ends_with_stop(req.context)):
            req.done = True
            return j + 1
    return len(tokens)


def _native_greedy_applies(req: Request) -> bool:
    """Plain greedy decoding without scores, logits or processors other than the length rules."""
    return not (req.config.do_sample or req.config.output_scores or req.config.output_logits) and req.scorer.only_length_rules


def _hand_over(target: Runner, req: Request, costs: TargetCosts, engine: str) -> bool:
    """Let the target's native engine decode the rest of ``req``, where it has one and (once the loop decoded
    part of the request) finishing there saves time; ``False`` where it does not decode."""
    remaining = req.limit - req.produced
    if req.produced and not costs.hand_over_pays(remaining, len(req.context)):
        return False
    arrivals = []

    def on_token(token: int) -> None:
        arrivals.append(time.perf_counter())
        if req.streamer is not None:
            req.streamer.put(torch.tensor([token]))

    t0 = time.perf_counter()
    new = target.native_greedy(list(req.context), remaining, max(0, req.min_new - req.produced), sorted(req.eos),
                               on_token)
    if new is None:
        return False
    end = time.perf_counter()
    if not req.produced:
        req.first_token_at = arrivals[0] if arrivals else end
        req.stats.prefill_s = req.first_token_at - t0
    if len(arrivals) > 1:
        costs.native_step_s = (end - arrivals[0]) / (len(arrivals) - 1)
    req.context.extend(new)
    req.stats.target_forwards += len(new)
    req.stats.verify_s += end - t0
    req.stats.engine = engine
    return True


def finish_request(req: Request, start: float, costs: TargetCosts):
    """Fill the request's stats and hand its output to the policy's memory; returns what :func:`decode` returns."""
    end = time.perf_counter()
    stats = req.stats
    stats.new_tokens = req.produced
    stats.ttft_s = (req.first_token_at or end) - start
    stats.decode_s = end - (req.first_token_at or end)
    if req.policy is not None:
        stats.lookup_pauses = req.policy.pauses
        req.policy.parent.finish(req.policy)
    return req.new, req.scores, req.logits, stats

