"""The decode loop: plain and speculative decoding are one loop.

Each round the target verifies ``[pending] + drafts`` in one forward pass, where ``pending``
is the last emitted token (not yet in the target's KV cache). Without a drafter (or with
speculation switched off) the round has no drafts and is a plain decode step. After a
partial accept the target's KV cache is rolled back past the rejected drafts. The first token
comes from the target's prefill alone: a draft model prefills when drafting begins, after it
(openvino_genai's speculative pipeline, too, gives its first token at its plain TTFT), so its prefill
counts in the decode time and not in the TTFT; an overlapped draft model, which computes in its own
thread on its own device, prefills beside the target's prefill (``Drafter.starts_before_prefill``).

Adaptive draft length: the heuristic schedule (+2 after a full accept, -1 otherwise, as in
transformers; prompt lookup keeps a constant length, as transformers' does), capped by the draft
length the measured verify cost per width favours (:mod:`xpuspec.speculative.widths`; a hybrid's lookup
rounds by the length favoured for drafts that cost nothing, and the draft step counts only the tokens a
model drafted), and a cost model
(:mod:`xpuspec.speculative.costmodel`) that switches a draft model off for the rest of the request,
or pauses prompt lookup, when speculation measures slower than plain decoding.

Plain greedy decoding without scores, logits or processors other than the length rules runs in the
target's native engine where it has one (:meth:`Runner.native_greedy`; openvino_genai's C++ loop on
OpenVINO), which gives the same tokens with less per-step overhead.

On a target that prefers a fixed verify width (OpenVINO, where a new input length costs 8-14 ms),
every round with drafts feeds the widest verify input seen so far in the request (it never narrows
when the draft-length cap falls: on a 2-core Xeon with AMX, SmolLM2 int8, alternating 3- and 11-token
passes cost 19.4 and 22.5 ms against 13.2 and 16.4 in runs of one width), padded with a repeated token
whose KV slots are rolled back at once; a round without drafts is a plain one-token step.

A target that runs its 1-token steps as wider passes (``Runner.single_step_width`` > 1: OpenVINO CPU
with dynamic quantization) pays for those slots anyway, so greedy decoding puts a prompt-lookup guess
there (n-grams of 3 down to 1) wherever a round has no drafts of its own, plain requests included: a
guess the target confirms is a token for free, and verification keeps the output the plain output.
Such rounds count as plain steps for the cost model and as ``extra["step_guesses"]`` /
``extra["step_guesses_accepted"]`` in the stats, not as drafts.
"""

import numbers
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence

import torch
from transformers import GenerationConfig

from .errors import SpeculativeConfigError
from .generation import GenerationStats, eos_ids, logits_processor, max_new_tokens
from .runner import Runner
from .speculative.costmodel import (AcceptanceCounts, CostModel, remember_native_step, remember_plain_step,
                                   remembered_native_step, remembered_plain_step)
from .speculative.drafters import DEFAULT_LOOKUP_TOKENS, Drafter, PromptLookupDrafter, check_count
from .speculative.verify import greedy_accept, rejection_sample
from .speculative.widths import best_draft_length, measure_widths, predicted_speedup, remembered_widths

#: Longest n-gram a step's guess matches (down to 1): the guess costs nothing, so a 1-gram match is worth trying.
STEP_GUESS_NGRAM = 3
#: Drafts past the cost model's optimum after a round that took every draft: the rates of positions not drafted
#: in the request are only a prior (remembered from earlier requests, or the rate of the position before), and
#: this measures the next one.
DRAFTS_PAST_THE_OPTIMUM = 1


@dataclass
class DraftSchedule:
    """How many tokens to draft per round.

    Attributes:
        num_assistant_tokens: initial draft length k (>= 1).
        schedule: ``"heuristic"`` (+2 after a full accept, -1 otherwise, at least 1) or ``"constant"``.
        confidence_threshold: stop drafting when the draft's top probability falls below it (0: off).
        cost_model: switch a draft model off, or pause prompt lookup, when speculation measures slower
            than plain decoding (:mod:`xpuspec.speculative.costmodel`), and cap the draft length at the one
            the target's measured verify cost per width favours (:mod:`xpuspec.speculative.widths`).
        lookup_tokens: the longest draft of a prompt-lookup round beside a draft model (a hybrid's) and of
            prompt lookup going on alone once the draft model is dropped (``prompt_lookup_num_tokens``).
    """

    num_assistant_tokens: int = 4
    schedule: str = "heuristic"
    confidence_threshold: float = 0.0
    cost_model: bool = True
    lookup_tokens: int = DEFAULT_LOOKUP_TOKENS

    def __post_init__(self):
        self.num_assistant_tokens = check_count("num_assistant_tokens", self.num_assistant_tokens)
        self.lookup_tokens = check_count("prompt_lookup_num_tokens", self.lookup_tokens)
        if self.schedule not in ("heuristic", "constant"):
            raise SpeculativeConfigError(
                f"num_assistant_tokens_schedule must be 'heuristic' or 'constant', got {self.schedule!r}.")
        threshold = self.confidence_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0.0 <= threshold < 1.0:
            raise SpeculativeConfigError(
                f"assistant_confidence_threshold must be a number in [0, 1), got {threshold!r}.")
        self.confidence_threshold = float(threshold)

    def for_lookup(self) -> "DraftSchedule":
        """This schedule for prompt lookup alone: a constant ``lookup_tokens``."""
        return replace(self, num_assistant_tokens=self.lookup_tokens, schedule="constant")

    def next_k(self, k: int, drafted: int, accepted: int) -> int:
        if self.schedule == "constant" or drafted == 0:
            return k
        return k + 2 if accepted == drafted else max(1, k - 1)


def decode(target: Runner, prompt: List[int], config: GenerationConfig, streamer=None,
           drafter: Optional[Drafter] = None, schedule: Optional[DraftSchedule] = None,
           acceptance_prior: Optional[AcceptanceCounts] = None):
    """Generate after ``prompt`` with ``target``, speculatively when a ``drafter`` is given.

    Args:
        target: the target model; its KV cache is reset first.
        prompt: prompt token ids (non-empty).
        config: a validated GenerationConfig (greedy or sampling).
        streamer: a transformers streamer, or ``None``.
        drafter: proposes draft tokens; ``None`` decodes plainly.
        schedule: draft-length policy (default :class:`DraftSchedule`).
        acceptance_prior: the drafter's rounds judged and accepted per draft position in earlier
            requests, from which the cost model's acceptance rates start (``None``: a fixed prior).

    Returns:
        ``(new_tokens, scores, raw_logits, stats)``: generated ids; processed scores and raw
        logits per new token (``[1, vocab]`` float32, filled only when ``output_scores`` /
        ``output_logits`` are set); :class:`GenerationStats`.
    """
    start = time.perf_counter()
    with torch_on_one_thread([target, *(drafter.runners() if drafter is not None else ())]):
        return _decode(target, prompt, config, streamer, drafter, schedule or DraftSchedule(), acceptance_prior,
                       start)


@contextmanager
def torch_on_one_thread(runners: Sequence[Runner]):
    """Run torch on one intra-op thread inside the block, unless one of ``runners`` computes with torch's
    threads (:attr:`Runner.uses_torch_threads`); the setting before is restored afterwards.

    The decode loop's own tensor work is small (a few rows of logits: scoring, concatenation, argmax), and
    torch's OpenMP threads otherwise compete with the backend's threads for the cores. In-process A/B on a
    2-core Xeon, 3 code + 3 prose + 4 edit prompts x 64 tokens x 2 (SmolLM2-135M int8 on OpenVINO, outputs
    identical): on a quiet machine prompt lookup 1.04x and plain decoding 1.02x end to end; on a busy one
    (other load slowing OpenVINO 3x) 1.69x and 1.28x, where a clone of one row of logits took 3.7 ms on two
    threads. Not thread-safe against other threads changing torch's thread count meanwhile."""
    before = torch.get_num_threads()
    if before == 1 or any(r.uses_torch_threads for r in runners):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _decode(target, prompt, config, streamer, drafter, schedule, acceptance_prior, start):
    """:func:`decode` inside its thread setting."""
    processors = logits_processor(config, len(prompt))
    plain_greedy = _native_greedy_applies(config, processors)
    if drafter is None and plain_greedy:
        done = _native_greedy(target, prompt, config, streamer, start)
        if done is not None:
            return done

    def score(prefix: List[int], logits: torch.Tensor) -> torch.Tensor:
        return processors(torch.tensor([prefix]), logits)

    if plain_greedy:
        score = _length_rule_score(config, len(prompt))

    target.reset()
    if drafter is not None and drafter.starts_before_prefill:  # others start in the loop, after the first token
        drafter.start(list(prompt), score, bool(config.do_sample), schedule.confidence_threshold)
    try:
        return _loop(target, prompt, config, streamer, drafter, schedule, score, start,
                     native=plain_greedy, prior=acceptance_prior)
    finally:
        if drafter is not None:
            drafter.stop()


#: Logits processors a backend's native greedy engine applies itself (through min_new_tokens).
_NATIVE_PROCESSORS = ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor")


def _native_greedy_applies(config: GenerationConfig, processors) -> bool:
    """Plain greedy decoding without scores, logits or processors other than the length rules."""
    return (not config.do_sample and not config.output_scores and not config.output_logits
            and all(type(p).__name__ in _NATIVE_PROCESSORS for p in processors))


def _min_new_tokens(config: GenerationConfig, prompt_len: int) -> int:
    return max(config.min_new_tokens or 0, (config.min_length or 0) - prompt_len, 0)


def _length_rule_score(config: GenerationConfig, prompt_len: int):
    """The scores of greedy decoding whose only processors are the length rules: EOS at -inf below the
    minimum length, as transformers' ``MinLengthLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``
    do, without their per-step tensor work (a vocabulary-wide ``isin``, about 0.4 ms a step)."""
    minimum = prompt_len + _min_new_tokens(config, prompt_len)

    def score(prefix: List[int], logits: torch.Tensor) -> torch.Tensor:
        if len(prefix) >= minimum:
            return logits
        eos = [e for e in eos_ids(config) if 0 <= e < logits.shape[-1]]  # as isin: ids off the vocabulary mask nothing
        if not eos:
            return logits
        masked = logits.clone()
        masked[:, eos] = float("-inf")
        return masked

    return score


def _run_native(target: Runner, context: List[int], limit: int, min_new: int, config: GenerationConfig, streamer):
    """``(new tokens, arrival times)`` from the target's native greedy engine, or ``None`` when it has none."""
    arrivals = []

    def on_token(token: int) -> None:
        arrivals.append(time.perf_counter())
        if streamer is not None:
            streamer.put(torch.tensor([token]))

    new = target.native_greedy(list(context), limit, min(min_new, limit), eos_ids(config), on_token)
    return None if new is None else (new, arrivals)


def _native_greedy(target: Runner, prompt: List[int], config: GenerationConfig, streamer, start: float):
    """Decode in the target's native engine (:meth:`Runner.native_greedy`); ``None`` when it has none."""
    done = _run_native(target, prompt, max_new_tokens(config, len(prompt)), _min_new_tokens(config, len(prompt)),
                       config, streamer)
    if done is None:
        return None
    new, arrivals = done
    end = time.perf_counter()
    first = arrivals[0] if arrivals else end
    if len(new) > 1:
        remember_native_step(target, (end - first) / (len(new) - 1))
    stats = GenerationStats(prompt_tokens=len(prompt), new_tokens=len(new), ttft_s=first - start,
                            decode_s=end - first, target_forwards=len(new), prefill_s=first - start,
                            verify_s=end - first, extra={"engine": "native"})
    return new, [], [], stats


def _loop(target, prompt, config, streamer, drafter, schedule, score, start, native, prior):
    """The decode loop; ``native``: once the cost model switches speculation off, the target's native
    greedy engine (if any) decodes the rest of the request where the cost model finds that it saves
    time (:meth:`CostModel.handover_pays`: the engine prefills the context again)."""
    cost = CostModel(schedule.cost_model and not target.lockstep,  # timings differ between a pipeline's ranks
                     costless=drafter is not None and drafter.costless, known_plain_s=remembered_plain_step(target),
                     prior=prior)
    stop, limit, sample = set(eos_ids(config)), max_new_tokens(config, len(prompt)), bool(config.do_sample)
    stats = GenerationStats(prompt_tokens=len(prompt))
    context, new, scores, raw = list(prompt), [], [], []
    k, active, first = schedule.num_assistant_tokens, drafter is not None, None
    proposer = drafter  # what drafts: the drafter, or a hybrid's prompt lookup once its draft model is dropped
    started = drafter is None or drafter.starts_before_prefill
    free = 0 if sample else target.single_step_width - 1  # slots a 1-token step pays for anyway (module docstring)
    guesser = PromptLookupDrafter(STEP_GUESS_NGRAM, 1) if free else None
    guessed = 0  # guesses in the last round
    pad_to = 0  # the widest verify pass so far, when the target prefers a fixed width
    t0 = time.perf_counter()
    rows, drafts, draft_probs, round_s, draft_s = target.forward(prompt, logits_to_keep=1), [], None, None, 0.0
    free_drafts = 0  # drafts of the last round that cost nothing (looked up)
    stats.prefill_s = time.perf_counter() - t0
    stats.target_forwards = 1
    verify_s = None  # seconds of a verify pass by width (index w - 1), once the cost model has timed them
    cap = None  # the draft length the measured costs favour (Leviathan et al.'s optimum, per width)
    # the widths the cap chooses among: k0 + 1 for a constant schedule, k0 + 3 for the heuristic (+2 after a full
    # accept), at least prompt lookup's (a hybrid goes on with lookup alone); the cap never drafts more than widest - 1
    widest = max(k + (1 if schedule.schedule == "constant" else 3), schedule.lookup_tokens + 1)
    while limit > 0:
        scored = torch.cat([score(context + drafts[:i], rows[i:i + 1]) for i in range(len(drafts) + 1)])
        if sample:
            n, token = rejection_sample(drafts, draft_probs, torch.softmax(scored, dim=-1))
        else:
            n, token = greedy_accept(drafts, scored)
        target.rollback(len(drafts) - n)
        if guessed:
            stats.extra["step_guesses"] = stats.extra.get("step_guesses", 0) + guessed
            stats.extra["step_guesses_accepted"] = stats.extra.get("step_guesses_accepted", 0) + n
        else:
            stats.drafted_tokens += len(drafts)
            stats.accepted_tokens += n
        done = False
        if drafts and not guessed:
            cost.note_drafts(len(drafts), n, draft_s, free=free_drafts)
        for j, tok in enumerate(drafts[:n] + [token]):
            if config.output_scores:
                scores.append(scored[j:j + 1])
            if config.output_logits:
                raw.append(rows[j:j + 1])
            new.append(tok)
            context.append(tok)
            first = first or time.perf_counter()
            if streamer is not None:
                streamer.put(torch.tensor([tok]))
            if tok in stop or len(new) >= limit:
                done = True
                break
        if done:
            break
        k = schedule.next_k(k, 0 if guessed else len(drafts), n)
        speculative = bool(drafts) and not guessed
        if round_s is not None and not (speculative and not proposer.costless and proposer.last_round_costless()):
            cost.record(round_s, n + 1, len(drafts), speculative=speculative)  # a hybrid's model: its own rounds
        predicted = None  # what the measured rates predict for a draft model at the capped length
        if speculative and cap is not None and not proposer.costless and cost.plain_step() is not None:
            predicted = predicted_speedup(cost.acceptance_by_position(cap), cost.draft_step(), verify_s, cap,
                                          cost.plain_step())
        if active and speculative and not cost.keep_speculating(len(new), predicted):
            if not cost.full_accept_pays():  # remembered across requests (SpeculationMemory)
                stats.extra["speculation_cannot_pay"] = True
            fallback = proposer.costless_part()
            if fallback is not None:  # a hybrid drops its draft model and goes on with prompt lookup
                drafter.stop()
                proposer, schedule, pad_to = fallback, schedule.for_lookup(), 0
                k = schedule.num_assistant_tokens
                cost.become_costless()
                stats.extra["draft_model_off_after_tokens"] = len(new)
            else:
                active = False
                stats.extra["speculation_off_after_tokens"] = len(new)
                t0 = time.perf_counter()
                native = native and cost.handover_pays(  # the engine prefills the context again
                    limit - len(new), remembered_native_step(target), stats.prefill_s * len(context) / len(prompt))
                rest = _run_native(target, context, limit - len(new),
                                   max(0, _min_new_tokens(config, len(prompt)) - len(new)), config, streamer) \
                    if native else None
                if rest is not None:
                    new += rest[0]
                    stats.target_forwards += len(rest[0])
                    stats.verify_s += time.perf_counter() - t0
                    stats.extra["engine"] = "native after speculation"
                    break
        drafting = active and not cost.measuring() and not cost.paused(len(new))
        room = limit - len(new) - 1  # drafts this round may hold
        if drafting and not started and room > 0:  # the draft model's prefill, once the first token is out (TTFT)
            drafter.start(context[:-1], score, sample, schedule.confidence_threshold)  # propose feeds the last
            started = True
        if drafting and cost.enabled and verify_s is None and room > 0:  # once, after the first token is out
            timed = len(remembered_widths(target))
            t0 = time.perf_counter()
            verify_s = list(measure_widths(target, context[-1], min(widest, room + 1)).values())
            if len(remembered_widths(target)) > timed:  # measured now, not remembered from an earlier request
                stats.extra["verify_widths_measured_s"] = round(time.perf_counter() - t0, 3)
        cap = None
        if verify_s is not None:
            longest = len(verify_s) - 1
            rates = cost.acceptance_by_position(longest)
            past = DRAFTS_PAST_THE_OPTIMUM * (speculative and n == len(drafts))
            cap = min(best_draft_length(rates, cost.draft_step(), verify_s) + past, longest)
            if schedule.schedule == "heuristic":  # grow from the cap, not past it
                k = min(k, cap)
        width = min(k, room if cap is None else min(cap, room)) if drafting else 0
        t0 = time.perf_counter()
        costless_width = None  # for a drafter whose lookup rounds cost nothing beside its model rounds (a hybrid)
        if width > 0 and cap is not None and not proposer.costless:
            costless_width = min(max(width, min(best_draft_length(rates, 0.0, verify_s) + past, longest, room)),
                                 schedule.lookup_tokens)
        drafts, draft_probs = (proposer.propose(context, width, score, sample, schedule.confidence_threshold,
                                                costless_k=costless_width) if width > 0 else ([], None))
        t1 = time.perf_counter()
        free_drafts = 0 if width == 0 else (len(drafts) if proposer.last_round_costless() else proposer.extended_tokens())
        guessed = 0
        if guesser is not None and not drafts:
            drafts = guesser.lookup(context, free)
            guessed = len(drafts)
        verify = [context[-1]] + drafts
        padding = 0
        if target.fixed_verify_width and drafts and not guessed:  # one input length for all rounds with drafts
            pad_to = max(pad_to, len(verify))  # never narrower: a change of width costs a re-preparation
            padding = pad_to - len(verify)
        rows = target.forward(verify + [verify[-1]] * padding)[:len(verify)]
        target.rollback(padding)
        t2 = time.perf_counter()
        stats.target_forwards += 1
        draft_s = t1 - t0
        stats.draft_s += draft_s
        stats.verify_s += t2 - t1
        round_s = t2 - t0
    end = time.perf_counter()
    busy = drafter.busy_s if drafter is not None else None
    stats.draft_busy_s = stats.draft_s if busy is None else busy
    stats.new_tokens = len(new)
    stats.ttft_s = (first or end) - start
    stats.decode_s = end - (first or end)
    if drafter is not None:
        stats.acceptance_counts = cost.counts()
    if cost.pauses:
        stats.extra["speculation_paused"] = cost.pauses
    if cost.enabled:
        remember_plain_step(target, cost)
    return new, scores, raw, stats
