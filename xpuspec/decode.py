"""A request's life, row by row: the per-row phase functions the engine (:mod:`xpuspec.engine`) runs.

A :class:`Request` holds one request's tokens and what its rounds read and update. Its life: :func:`new_request`,
:func:`begin_drafting` (before the target's prefill, which gives the first token through :func:`verify_and_emit`),
then rounds: the speculation policy says how many tokens to draft (:mod:`xpuspec.speculative.policy`), the drafter
proposes them, the target verifies ``[last token] + drafts`` in one pass, :func:`verify_and_emit` keeps a prefix of
the drafts by greedy acceptance or rejection sampling and adds the target's own next token
(:mod:`xpuspec.speculative.verify`), rolls the KV cache back past the rejected drafts and emits the tokens up to EOS,
the length limit or a stop string; :func:`after_round` tells the drafter and the policy what the target kept. A
round without drafts is a plain decode step. Then :func:`end_drafting` and :func:`finish_request`.

Where a backend runs its 1-token passes 2 tokens wide, a greedy round without drafts puts a free guess from prompt
lookup (:data:`GUESS_NGRAMS`) in the paid-for slot: verification keeps the output the plain output, and a confirmed
guess is a token for nothing.

Plain greedy decoding whose only processors are the length rules may run in the target's native engine where it has
one (:func:`hand_over`, :meth:`xpuspec.runner.Runner.native_greedy`).

Structured output hooks in at four places, through the request's ``grammar`` (:mod:`xpuspec.grammar`): drafts and
guesses are cut at the first token it forbids (:func:`cut_draft`); a greedy round left without a draft verifies
the tokens it forces (:func:`forced_draft`); :func:`verify_and_emit` masks every row of the verify pass by its
state there and moves it by the kept tokens, rolled back past the rejected ones; a request with a grammar never
takes the native route.
"""

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from transformers import GenerationConfig

from .generation import GenerationStats, PositionCounts, StopStrings, eos_ids, max_new_tokens, min_new_tokens
from .runner import Runner
from .scoring import Scorer, scorer_for
from .speculative.drafters import NO_DRAFT, Draft, DraftCounters, Drafter, DraftRequest, PromptLookupDrafter
from .speculative.policy import Decision, RequestPolicy, RoundOutcome, Widths
from .speculative.profile import TargetCosts
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
        grammar: the request's structured-output matcher (:class:`xpuspec.grammar.GrammarMatcher`), or ``None``:
            it masks the target's rows at every verified position, cuts drafts (:func:`cut_draft`) and follows the
            kept tokens; such a request never takes the native route.
        guesses: the counts of the free guesses (``guesser``'s, and the tokens a grammar forces); a drafter's own
            drafts are counted by the drafter (:class:`xpuspec.speculative.drafters.DraftCounters`).
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
    guesses: DraftCounters = field(default_factory=DraftCounters)
    stats: GenerationStats = field(default_factory=GenerationStats)
    scores: List[torch.Tensor] = field(default_factory=list)
    logits: List[torch.Tensor] = field(default_factory=list)
    pad_to: int = 0
    grammar: Optional[object] = None
    done: bool = False
    first_token_at: Optional[float] = None

    @property
    def new(self) -> List[int]:
        return self.context[self.prompt_len:]

    @property
    def produced(self) -> int:
        return len(self.context) - self.prompt_len


def new_request(prompt: List[int], config: GenerationConfig, streamer=None, drafter: Optional[Drafter] = None,
                policy: Optional[RequestPolicy] = None, stop: Optional[StopStrings] = None,
                setup_s: float = 0.0, grammar=None) -> Request:
    """A :class:`Request` for ``prompt`` under a validated ``config``: the first piece of a request's life (then
    :func:`begin_drafting`, prefill and rounds of ``verify_and_emit`` and :func:`after_round`, :func:`end_drafting`,
    ``finish_request``), which :func:`decode` runs for one request and :mod:`xpuspec.engine` for many."""
    req = Request(list(prompt), len(prompt), config, scorer_for(config, len(prompt)), max_new_tokens(config, len(prompt)),
                  min_new_tokens(config, len(prompt)), frozenset(eos_ids(config)), stop, streamer, drafter, policy)
    req.stats.prompt_tokens, req.stats.setup_s = len(prompt), setup_s
    req.grammar = grammar
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
    """Gather the counters of the drafters the request used (the one it began with and, where the policy stopped
    its draft model, the one that went on; the free guesser apart) into its stats, and note the busy time. A
    speculative request reports its counts, zeros when nothing was drafted."""
    stats = req.stats
    stats.guessed_tokens, stats.guesses_accepted = req.guesses.drafted_tokens, req.guesses.accepted_tokens
    if first_drafter is None:
        return
    stats.acceptance_counts = PositionCounts()
    for drafter in {id(d): d for d in (first_drafter, req.drafter) if d is not None}.values():
        stats.drafted_tokens += drafter.counters.drafted_tokens
        stats.accepted_tokens += drafter.counters.accepted_tokens
        stats.acceptance_counts.add(drafter.counters.positions)
    busy = first_drafter.busy_s
    stats.draft_busy_s = stats.draft_s if busy is None else busy


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


def verify_and_emit(target: Runner, req: Request, draft, rows: torch.Tensor, guessed: bool) -> int:
    """Judge ``draft`` by the target's ``rows`` (``[len(draft.tokens) + 1, vocab]``), roll back the rejected
    drafts, emit the kept tokens and the target's own, and count them; returns the drafts accepted. A drafter that
    needs the target's hidden states gets those of the pass first."""
    if req.drafter is not None and "hidden_states" in req.drafter.needs and target.last_taps is not None:
        req.drafter.observe({"hidden_states": target.last_taps})
    scored = None  # processed scores, built only where sampling or output_scores needs them
    raw = rows
    if req.grammar is not None:  # every verified position masked by the grammar's state there
        rows = req.grammar.mask_rows(draft.tokens, rows)
    if req.config.do_sample:
        scored = req.scorer.rows(req.context, draft.tokens, rows)
        n, token = rejection_sample(draft.tokens, draft.probs, torch.softmax(scored, dim=-1))
    elif req.config.output_scores:
        scored = req.scorer.rows(req.context, draft.tokens, rows)
        n, token = greedy_accept(draft.tokens, scored)
    else:
        n, token = accept_prefix(draft.tokens, req.scorer.best(req.context, draft.tokens, rows))
    target.rollback(len(draft.tokens) - n)
    emitted = _emit(req, draft.tokens[:n] + [token], scored, raw)
    kept = min(n, emitted)
    if req.grammar is not None:  # the grammar keeps what was emitted, rolled back past the rest
        req.grammar.keep(kept, token if emitted > n else None)
    if guessed:
        req.guesses.add_round(len(draft.tokens), kept)
    elif draft.tokens:
        req.drafter.counted(len(draft.tokens), kept)
    return n


def cut_draft(req: Request, draft: Draft) -> Draft:
    """``draft`` up to the first token the request's grammar forbids (all of it without a grammar), so that no
    verify pass is spent on a draft the mask would reject."""
    if req.grammar is None or not draft.tokens:
        return draft
    k = req.grammar.valid_prefix(draft.tokens)
    if k == len(draft.tokens):
        return draft
    return Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k], min(draft.free, k))


def forced_draft(req: Request, widths: Widths, traits, room: int, draft: Draft, guessed: bool):
    """Where a greedy round has no draft: the tokens the request's grammar forces next as a free guess
    (:meth:`xpuspec.grammar.GrammarMatcher.forced`), as many as the request drafts (its policy's widest pass; the
    free slot of a 2-wide step without speculation, or where the backend keeps one verify width);
    ``(draft, guessed)`` unchanged without a grammar or forced tokens."""
    if req.grammar is None or req.config.do_sample:
        return draft, guessed
    cap = traits.guess_width - 1 if req.guesser is not None else 0
    if req.drafter is not None and req.policy is not None and not traits.fixed_verify_width:  # a guess is not padded
        cap = max(cap, widths.free, widths.model, req.policy.widest_needed() - 1)
    forced = req.grammar.forced(min(cap, room))
    return (Draft(forced, None, len(forced)), True) if forced else (draft, guessed)


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


def native_greedy_applies(req: Request) -> bool:
    """Plain greedy decoding without scores, logits, stop strings, a grammar or processors other than the length
    rules (the native engine cannot mask by a grammar)."""
    return not (req.config.do_sample or req.config.output_scores or req.config.output_logits) and \
        req.scorer.only_length_rules and req.stop is None and req.grammar is None


def hand_over(target: Runner, req: Request, costs: TargetCosts, engine: str, check=lambda: None) -> bool:
    """Let the target's native engine decode the rest of ``req``, where it has one and (once the engine decoded
    part of the request) finishing there saves time; ``False`` where it does not decode. Each native token is
    appended to the context and streamed as it comes; ``check()`` is called after each and may raise to stop the
    native engine there (the exception propagates, the tokens so far are kept: the engine's native phase yields
    to a job that arrived)."""
    remaining = req.limit - req.produced
    if req.produced and not costs.hand_over_pays(remaining, len(req.context)):
        return False
    arrivals = []
    base = len(req.context)
    t0 = time.perf_counter()

    def on_token(token: int) -> None:
        arrivals.append(time.perf_counter())
        req.context.append(token)
        if req.first_token_at is None:
            req.first_token_at = arrivals[-1]
            req.stats.prefill_s = arrivals[-1] - t0
        if req.streamer is not None:
            req.streamer.put(torch.tensor([token]))
        check()

    try:
        new = target.native_greedy(req.context[:base], remaining, max(0, req.min_new - req.produced), sorted(req.eos),
                                   on_token)
    finally:
        end = time.perf_counter()
        req.stats.target_forwards += len(req.context) - base
        req.stats.verify_s += end - t0
    if new is None:
        return False
    if len(arrivals) > 1:
        costs.native_step_s = (end - arrivals[0]) / (len(arrivals) - 1)
    req.context[base:] = new
    req.stats.engine = engine
    req.done = True
    return True


def finish_request(req: Request, start: float):
    """Fill the request's stats and hand its output to the policy's memory; returns ``(new_tokens, scores,
    raw_logits, stats)``: generated ids; processed scores and raw logits per new token (``[1, vocab]`` float32,
    filled only when ``output_scores`` / ``output_logits`` are set); the stats."""
    end = time.perf_counter()
    stats = req.stats
    stats.new_tokens = req.produced
    stats.ttft_s = (req.first_token_at or end) - start
    stats.decode_s = end - (req.first_token_at or end)
    if req.policy is not None:
        stats.lookup_pauses = req.policy.pauses
        req.policy.parent.finish(req.policy)
    return req.new, req.scores, req.logits, stats

