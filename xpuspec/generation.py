"""The decode loop over a Runner, with transformers' generation arguments and return types.

Logits processing uses transformers' own processor classes, in the order
``GenerationMixin`` applies them, so greedy and sampled outputs follow the same
rules as ``transformers.generate``.
"""

import copy
import numbers
import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence

import torch
from transformers import GenerationConfig
from transformers.generation import (
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .errors import GenerationConfigError


#: GenerationConfig fields xpuspec does not implement; setting one away from its default raises.
UNSUPPORTED_FIELDS = (
    "no_repeat_ngram_size", "bad_words_ids", "force_words_ids", "encoder_repetition_penalty",
    "length_penalty", "num_beam_groups", "diversity_penalty", "typical_p", "epsilon_cutoff",
    "eta_cutoff", "min_p", "penalty_alpha", "guidance_scale", "sequence_bias", "suppress_tokens",
    "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
    "exponential_decay_length_penalty", "watermarking_config", "constraints",
    "output_attentions", "output_hidden_states", "prompt_lookup_num_tokens",
)


#: New tokens transformers 5 generates when neither ``max_new_tokens`` nor ``max_length`` is set (measured).
TRANSFORMERS_DEFAULT_NEW_TOKENS = 20

#: Values that leave an option off, whatever its declared default.
_OFF = (None, False, 0, [], ())


@dataclass
class PositionCounts:
    """Per draft position (index 0: position 1), the rounds that judged a draft there and the rounds that accepted
    it (drafts are judged up to the first rejection)."""

    judged: List[float] = field(default_factory=list)
    accepted: List[float] = field(default_factory=list)

    def copy(self) -> "PositionCounts":
        return type(self)(list(self.judged), list(self.accepted))

    def add_round(self, drafted: int, accepted: int) -> None:
        """One round that drafted ``drafted`` tokens, of which the target accepted ``accepted``."""
        judged = accepted + (accepted < drafted)
        grow = judged - len(self.judged)
        if grow > 0:
            self.judged += [0.0] * grow
            self.accepted += [0.0] * grow
        for j in range(judged):
            self.judged[j] += 1
            self.accepted[j] += j < accepted

    def add(self, other: "PositionCounts") -> None:
        """Add ``other``'s counts to these, position by position."""
        grow = len(other.judged) - len(self.judged)
        if grow > 0:
            self.judged += [0.0] * grow
            self.accepted += [0.0] * grow
        for j, (judged, accepted) in enumerate(zip(other.judged, other.accepted)):
            self.judged[j] += judged
            self.accepted[j] += accepted


@dataclass
class GenerationStats:
    """Figures of the last ``generate`` call.

    Attributes:
        prompt_tokens, new_tokens: token counts.
        cached_tokens: prompt tokens whose KV blocks came from the prefix cache (not computed; OpenAI's
            ``usage.prompt_tokens_details.cached_tokens``); 0 with prefix caching off.
        ttft_s: seconds from the call to the first new token (prefill included).
        decode_s: seconds from the first to the last new token.
        decode_tokens_per_s: ``(new_tokens - 1) / decode_s`` (0 when fewer than 2 new tokens).
        setup_s: seconds spent preparing speculation in this call, counted in ``decode_s`` or before the first
            token: a second compiled copy of a model for 1-token steps, the target's cost profile (once per model).
        target_forwards: forward passes of the target, prefill included.
        drafted_tokens, accepted_tokens: draft tokens verified and accepted (0 for plain decoding); a draft accepted
            past the end of the output (EOS, a stop string, the length limit) does not count.
        guessed_tokens, guesses_accepted: free guesses in the slot of a plain step that the target runs 2 tokens
            wide (:class:`xpuspec.runner.RunnerTraits`), and those accepted (counted apart from drafts).
        draft_s, verify_s: seconds spent drafting (waiting for drafts, when overlapped) and in target
            forwards after prefill.
        prefill_s: seconds of the target's prefill forward.
        draft_busy_s: seconds the draft model computed; with overlapped speculation in its own
            thread, beside the target (equal to ``draft_s`` when drafting is sequential).
        acceptance_counts: per draft position (index 0: the first draft of a round), the rounds that judged a
            draft there and the rounds that accepted it; ``None`` for plain decoding.
        engine: what decoded: ``"xpuspec"`` (this loop), ``"native"`` (the backend's own engine) or
            ``"native after speculation"`` (the loop, then the backend's engine once the draft model stopped).
        draft_model_stopped_after: new tokens when the policy stopped the draft model (a hybrid goes on with
            prompt lookup), or ``None``.
        draft_model_skipped: the policy left the draft model out of this request (it stopped in the last ones).
        lookup_pauses: how often prompt lookup was paused for not paying.
        rows: in the stats of a batch, each row's own stats (the batch's figures are their sums, its times the
            batch's wall clock, ``target_forwards`` the batched passes); ``None`` for one request.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    setup_s: float = 0.0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    guessed_tokens: int = 0
    guesses_accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    draft_busy_s: float = 0.0
    acceptance_counts: Optional[PositionCounts] = None
    engine: str = "xpuspec"
    draft_model_stopped_after: Optional[int] = None
    draft_model_skipped: bool = False
    lookup_pauses: int = 0
    rows: Optional[List["GenerationStats"]] = None

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """New tokens per target forward after prefill (tau; 1.0 for plain decoding)."""
        decode_forwards = self.target_forwards - 1
        return (self.new_tokens - 1) / decode_forwards if decode_forwards > 0 else 0.0

    @property
    def idle_fractions(self) -> dict:
        """Share of the call's wall time each model did not compute: ``{"target": f, "draft": f}``."""
        total = self.ttft_s + self.decode_s
        if total <= 0:
            return {"target": 0.0, "draft": 0.0}
        return {"target": max(0.0, 1 - (self.prefill_s + self.verify_s) / total),
                "draft": max(0.0, 1 - self.draft_busy_s / total)}

    def as_dict(self) -> dict:
        return {**asdict(self), "decode_tokens_per_s": self.decode_tokens_per_s,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length}

    def summary(self) -> str:
        line = (f"prompt tokens {self.prompt_tokens}, new tokens {self.new_tokens}, "
                f"TTFT {self.ttft_s * 1000:.0f} ms, decode {self.decode_tokens_per_s:.1f} tokens/s")
        if self.drafted_tokens:
            line += (f", drafted {self.drafted_tokens}, accepted {self.accepted_tokens} "
                     f"({self.acceptance_rate:.0%}), mean accepted length {self.mean_accepted_length:.2f}, "
                     f"draft {self.draft_s * 1000:.0f} ms, verify {self.verify_s * 1000:.0f} ms")
        return line


#: GenerationConfig fields that must be numbers where set.
SAMPLING_NUMBERS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")

#: transformers.generate() arguments outside GenerationConfig that xpuspec does not implement.
GENERATE_ARGUMENTS_NOT_IMPLEMENTED = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                                      "synced_gpus", "negative_prompt_ids", "negative_prompt_attention_mask")


def _has_effect(value) -> bool:
    """A generate() argument's value that asks for something: not ``None``, ``False`` or an empty list."""
    return not (value is None or value is False or (isinstance(value, (list, tuple)) and len(value) == 0))


def resolve_generation_config(base: GenerationConfig, generation_config: Optional[GenerationConfig],
                              kwargs: dict) -> GenerationConfig:
    """Merge ``generation_config`` (or the model's ``base``) with keyword overrides, and validate.

    Raises:
        TypeError: a keyword is not a generation argument, ``max_new_tokens`` not an integer.
        NotImplementedError: beams, several return sequences, a field in :data:`UNSUPPORTED_FIELDS`, or an argument
            in :data:`GENERATE_ARGUMENTS_NOT_IMPLEMENTED`.
        GenerationConfigError: ``max_new_tokens < 1``, ``do_sample`` with ``temperature <= 0``, a field of
            :data:`SAMPLING_NUMBERS` that is not a number, or another value transformers' ``GenerationConfig`` or its
            logits processors refuse (``top_k=-1``).
    """
    config = copy.deepcopy(generation_config if generation_config is not None else base)
    wanted = kwargs.get("max_new_tokens")
    if wanted is not None:
        if isinstance(wanted, bool) or not isinstance(wanted, numbers.Integral):
            raise TypeError(f"max_new_tokens must be an integer, got {wanted!r}.")
        if wanted < 1:
            raise GenerationConfigError(
                f"max_new_tokens must be at least 1, got {wanted}; ask for one or more new tokens "
                "(to score a prompt without generating, call the model: model(input_ids).logits).")
        kwargs = {**kwargs, "max_new_tokens": int(wanted)}  # a NumPy integer too
    try:
        unused = config.update(**kwargs)
    except ValueError as exc:  # transformers' own validation of a value
        raise GenerationConfigError(f"Invalid generation argument: {exc}") from exc
    given = [name for name in GENERATE_ARGUMENTS_NOT_IMPLEMENTED if _has_effect(unused.get(name))]
    if given:
        raise NotImplementedError(f"xpuspec's generate() does not implement {', '.join(given)}; leave them out.")
    unused = {k: v for k, v in unused.items() if k not in GENERATE_ARGUMENTS_NOT_IMPLEMENTED}
    if unused:
        raise TypeError(f"generate() got unexpected keyword arguments: {', '.join(sorted(unused))}.")
    for name in SAMPLING_NUMBERS:  # a string here fails deep in transformers' processors, or in a comparison below
        value = getattr(config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise GenerationConfigError(f"{name} must be a number, got {value!r}.")
    defaults = GenerationConfig()
    changed = [f for f in UNSUPPORTED_FIELDS
               if getattr(config, f, None) != getattr(defaults, f, None) and getattr(config, f, None) not in _OFF]
    if changed:
        raise NotImplementedError(f"xpuspec does not implement {', '.join(changed)}; leave them at their defaults.")
    if (config.num_beams or 1) > 1:
        raise NotImplementedError(f"Beam search (num_beams={config.num_beams}) is not supported; use num_beams=1.")
    if (config.num_return_sequences or 1) > 1:
        raise NotImplementedError("num_return_sequences > 1 is not supported; call generate once per sequence.")
    if config.max_new_tokens is not None and not isinstance(config.max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an integer, got {config.max_new_tokens!r}.")
    if config.do_sample and config.temperature is not None and config.temperature <= 0:
        raise GenerationConfigError(
            f"do_sample=True needs temperature > 0, got {config.temperature}. For greedy decoding pass do_sample=False."
        )
    try:  # transformers' processors check their values (top_k, top_p, a NaN temperature) when built
        logits_processor(config, prompt_len=1)
    except ValueError as exc:
        raise GenerationConfigError(f"Invalid generation argument: {exc}") from exc
    return config


def eos_ids(config: GenerationConfig) -> List[int]:
    eos = config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def logits_processor(config: GenerationConfig, prompt_len: int) -> LogitsProcessorList:
    """transformers' processors for ``config``: penalties and length rules always, warpers when sampling."""
    procs = LogitsProcessorList()
    eos = eos_ids(config)
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty=config.repetition_penalty))
    if eos and config.min_length is not None and config.min_length > 0:
        procs.append(MinLengthLogitsProcessor(config.min_length, eos))
    if eos and config.min_new_tokens is not None and config.min_new_tokens > 0:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, config.min_new_tokens, eos))
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            procs.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    return procs


def min_new_tokens(config: GenerationConfig, prompt_len: int) -> int:
    """New tokens before which EOS is masked: ``min_new_tokens``, or what ``min_length`` leaves after the prompt."""
    return max(config.min_new_tokens or 0, (config.min_length or 0) - prompt_len, 0)


class StopStrings:
    """transformers' ``stop_strings``: generation ends with the token whose text completes one of ``strings``
    (the output keeps the stop string, as transformers' ``StopStringCriteria`` does; its text may overhang).

    Args:
        tokenizer: the model's tokenizer (``generate(..., tokenizer=tok)``).
        strings: the stop strings (non-empty).
    """

    def __init__(self, tokenizer, strings: Sequence[str]):
        self.tokenizer, self.strings = tokenizer, list(strings)
        self.window = 2 * max(len(s) for s in self.strings) + 2  # tokens: enough text to hold any stop string

    def ends_with_stop(self, tokens: Sequence[int]) -> bool:
        """Whether the last token of ``tokens`` (the sequence so far, prompt included) completes a stop string: an
        occurrence that ends in the last token's text, whatever occurrences the text before it holds."""
        tail = list(tokens[-self.window:])
        text = self.tokenizer.decode(tail)
        if not any(s in text for s in self.strings):
            return False
        kept = len(os.path.commonprefix([self.tokenizer.decode(tail[:-1]), text]))  # text the last token left alone
        return any(text.find(s, max(0, kept - len(s) + 1)) >= 0 for s in self.strings)


def stop_strings(config: GenerationConfig, tokenizer) -> Optional[StopStrings]:
    """The :class:`StopStrings` of ``config.stop_strings``, or ``None``.

    Raises:
        GenerationConfigError: stop strings without a tokenizer, or a stop string that is empty or not a string.
    """
    strings = config.stop_strings
    if not strings:
        return None
    strings = [strings] if isinstance(strings, str) else list(strings)
    if not all(isinstance(s, str) and s for s in strings):
        raise GenerationConfigError(f"stop_strings must be non-empty strings, got {config.stop_strings!r}.")
    if tokenizer is None:
        raise GenerationConfigError("stop_strings need the model's tokenizer to read the text: pass tokenizer= to "
                                    "generate (generate(..., stop_strings=[...], tokenizer=tok)), as transformers does.")
    return StopStrings(tokenizer, strings)


def max_new_tokens(config: GenerationConfig, prompt_len: int) -> int:
    """``max_new_tokens``, else ``max_length - prompt_len``, else 20 new tokens (transformers 5's rule)."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    if config.max_length is None:
        return TRANSFORMERS_DEFAULT_NEW_TOKENS
    return max(config.max_length - prompt_len, 0)


def batch_stats(rows: List[GenerationStats]) -> GenerationStats:
    """The stats of a batch: token and draft counts summed over ``rows``, TTFT the first row's first token, the
    decode time from then to the last row's last token, the target's passes those of the widest row (every row's
    pass is one batched pass), and ``rows`` themselves."""
    total = GenerationStats(rows=list(rows))
    for name in ("prompt_tokens", "new_tokens", "cached_tokens", "drafted_tokens", "accepted_tokens", "guessed_tokens",
                 "guesses_accepted", "lookup_pauses"):
        setattr(total, name, sum(getattr(r, name) for r in rows))
    total.ttft_s = min(r.ttft_s for r in rows)
    total.decode_s = max(r.ttft_s + r.decode_s for r in rows) - total.ttft_s
    total.target_forwards = max(r.target_forwards for r in rows)
    total.verify_s = max(r.verify_s for r in rows)
    total.setup_s = sum(r.setup_s for r in rows)
    total.draft_s = sum(r.draft_s for r in rows)
    total.prefill_s = sum(r.prefill_s for r in rows)
    total.draft_busy_s = sum(r.draft_busy_s for r in rows)
    for counts in (r.acceptance_counts for r in rows if r.acceptance_counts is not None):
        if total.acceptance_counts is None:
            total.acceptance_counts = PositionCounts()
        total.acceptance_counts.add(counts)
    total.engine = "xpuspec batch"
    return total


def pack_output(prompt_ids: torch.Tensor, rows, config: GenerationConfig, vocab_size: int):
    """What ``transformers.generate`` returns for one prompt or a batch: ``[B, T + new]`` (``new``: the longest row's
    new tokens), each row's new tokens after its (padded) prompt and ``pad_token_id`` after a row's end (the first EOS
    id where no pad token is set, as transformers does); or :class:`GenerateDecoderOnlyOutput` with per-step
    ``scores`` / ``logits`` of shape ``[B, vocab]`` (a row past its end scores ``pad_token_id`` 0 and every other
    token -inf).

    Args:
        prompt_ids: the ``[B, T]`` ids as given; rows: per row ``(new, scores, logits)`` as the decode loop gives.
    """
    pad = config.pad_token_id
    if pad is None:
        eos = eos_ids(config)
        pad = eos[0] if eos else 0
    longest = max(len(r[0]) for r in rows)
    new = torch.full((len(rows), longest), pad, dtype=torch.long)
    for i, (tokens, _, _) in enumerate(rows):
        new[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    sequences = torch.cat([prompt_ids.to("cpu", torch.long), new], dim=1)
    if not config.return_dict_in_generate:
        return sequences

    def steps(which):
        filler = torch.full((1, vocab_size), float("-inf"))
        filler[0, pad] = 0.0
        out = []
        for t in range(longest):
            out.append(torch.cat([r[which][t] if t < len(r[which]) else filler for r in rows]))
        return tuple(out)

    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=steps(1) if config.output_scores else None,
        logits=steps(2) if config.output_logits else None,
    )
