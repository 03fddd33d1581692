"""Drafters (candidate generators): each proposes up to k tokens after a context.

Interface: ``propose(context, k, score) -> (tokens, probs)``. ``score(prefix, logits)`` turns a
drafter's raw logits ``[1, vocab]`` into the processed scores the target would use at that
prefix (same repetition penalty, length rules, temperature, top-k, top-p), so that draft and
target distributions are built identically. When sampling, ``probs`` is ``[n, vocab]`` float32
(the draft distribution of each proposed token) for model drafters, or ``None`` for deterministic
drafters (prompt lookup), whose proposals count as one-hot distributions in rejection sampling.
"""

import numbers
from abc import ABC, abstractmethod
from typing import Callable, List, Optional, Tuple

import torch

from ..errors import SpeculativeConfigError
from ..runner import Runner

Score = Callable[[List[int], torch.Tensor], torch.Tensor]
#: Context tokens a draft model prefills by default (``SpeculativeConfig.draft_context_length``). On the
#: Qwen2.5-Coder 1.5B int8 target with its 0.5B int4 draft (hybrid, 2 code + 2 prose + 2 edit prompts of
#: 14-130 tokens x 32 new tokens x 3, in-process A/B, outputs identical, the draft's prefill counted in the
#: decode time): 21.3 tok/s against 20.0 with the whole prompt (edit 41.3 against 32.6), 64 and 96 alike
#: within noise, 32 cost acceptance on code (120 accepted drafts against 128-134).
DEFAULT_DRAFT_CONTEXT_LENGTH = 64

#: ``(prefix, n) -> up to n tokens`` that continue ``prefix`` at no cost (prompt lookup), or ``[]``.
Extension = Callable[[List[int], int], List[int]]

#: The longest draft of prompt lookup alone; each round drafts at most the length the target's
#: measured verify costs favour (:mod:`xpuspec.speculative.widths`), so on a target whose wide passes
#: are dear it drafts fewer. On a 2-core AMD EPYC (AVX2) k=5 (openvino_genai's) gave 1.21x (edit), 1.09x
#: (code) and 1.07x (prose) the tokens/s of k=4 on SmolLM2 int8; on a 2-core Xeon with AMX, where a
#: 16-token pass costs 1.6 plain steps, k=10 made 112 target passes on 4 edit prompts x 64 tokens x 2
#: against 148 for k=5, and 157.2 against 148.0 tok/s over 3 code + 3 prose + 4 edit prompts.
DEFAULT_LOOKUP_TOKENS = 10


class Drafter(ABC):
    """Proposes draft tokens for the target to verify."""

    #: True when proposals are sampled from a distribution (``probs`` returned).
    stochastic: bool = False
    #: True when proposing costs nothing next to a target step (no model runs): the cost model then
    #: pauses speculation that does not pay instead of switching it off.
    costless: bool = False
    #: True when :meth:`start` belongs before the target's prefill (a drafter computing in its own thread
    #: prefills alongside it); else the decode loop starts the drafter once the first token is out and
    #: drafting begins, so that a draft model's prefill does not delay the first token.
    starts_before_prefill: bool = False

    @property
    def busy_s(self) -> Optional[float]:
        """Seconds a drafter that computes in its own thread spent on this request; ``None`` when it
        drafts inside :meth:`propose` (the decode loop then times it)."""
        return None

    @abstractmethod
    def propose(self, context: List[int], k: int, score: Score, sample: bool, threshold: float = 0.0,
                costless_k: Optional[int] = None) -> Tuple[List[int], Optional[torch.Tensor]]:
        """Propose up to ``k`` tokens following ``context``.

        Args:
            context: every token so far (prompt and generated), ints.
            k: the most tokens to propose (>= 1).
            score: processed-scores function, see the module docstring.
            sample: draw proposals from the processed distribution instead of taking the argmax.
            threshold: stop when the draft's top probability falls below this (``assistant_confidence_threshold``).
            costless_k: the most tokens a round may propose where it drafts without a model (the decode loop
                gives the length the verify costs favour for drafts that cost nothing, at most
                ``prompt_lookup_num_tokens``; ``None``: ``k``). Only a drafter whose rounds cost differently uses
                it (a hybrid's lookup rounds); the others draft ``k``.

        Returns:
            ``(tokens, probs)``: 0..k token ids, and ``[len(tokens), vocab]`` probabilities when
            sampling with a model drafter, else ``None``.
        """

    def reset(self) -> None:
        """Forget per-request state."""

    def start(self, context: List[int], score: Score, sample: bool, threshold: float = 0.0) -> None:
        """Begin a request at ``context``: the prompt, or, when drafting begins later, the tokens so far but
        the last, which the first :meth:`propose` feeds (see :attr:`starts_before_prefill`; arguments as for
        :meth:`propose`); default: :meth:`reset`."""
        self.reset()

    def stop(self) -> None:
        """End a request: release what :meth:`start` holds (a worker thread)."""

    def costless_part(self) -> Optional["Drafter"]:
        """What keeps drafting once the cost model drops the draft model: this drafter if it is
        costless, the prompt lookup of a hybrid, else ``None``."""
        return self if self.costless else None

    def last_round_costless(self) -> bool:
        """Whether the last :meth:`propose` drafted without a model (a hybrid's lookup hit)."""
        return self.costless

    def extended_tokens(self) -> int:
        """Tokens at the end of the last :meth:`propose` that a costless continuation added
        (:meth:`ModelDrafter.propose`'s ``extend``); 0 by default."""
        return 0

    def mixed_width_runners(self, target: Runner) -> List[Runner]:
        """The runners whose passes alternate between 1-token steps and wider passes when this drafter drafts
        for ``target``, to be told so before decoding (:meth:`Runner.expect_mixed_widths`). Default: :meth:`runners`,
        whose drafting steps fall between the passes that catch up on accepted tokens; the target verifies a draft
        model's rounds at one padded width (``plugins/xpuspec_openvino/paged.py``)."""
        return self.runners()

    def runners(self) -> List[Runner]:
        """The runners this drafter computes with (its draft model's); default: none."""
        return []


def check_count(name: str, value) -> int:
    """``value`` as an int, where it is an integer (Python's or NumPy's; not a bool) >= 1.

    Raises:
        SpeculativeConfigError: naming ``name``, for anything else (a float, a string, None).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise SpeculativeConfigError(f"{name} must be an int >= 1, got {value!r}.")
    return int(value)


class PromptLookupDrafter(Drafter):
    """n-gram prompt lookup (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

    Finds the first occurrence of the context's last n tokens (openvino_genai's choice: the earliest
    match lies in the prompt, the text being copied), for n from ``max_matching_ngram_size`` down to
    ``min_matching_ngram_size`` (vLLM's ``prompt_lookup_min``), and proposes the tokens that followed
    it. Needs no model. On SmolLM2-135M int8 (3 code + 3 prose + 4 edit bench prompts x 64 tokens,
    two in-process A/B runs) the first match gave 1.54-1.55x plain decoding where the latest match
    (transformers') gave 1.42x: 269 against 280 target passes on code, where the latest match is often
    the output's own last lines.
    """

    costless = True

    def __init__(self, max_matching_ngram_size: int = 2, min_matching_ngram_size: int = 1):
        max_matching_ngram_size = check_count("max_matching_ngram_size", max_matching_ngram_size)
        min_matching_ngram_size = check_count("min_matching_ngram_size", min_matching_ngram_size)
        if min_matching_ngram_size > max_matching_ngram_size:
            raise SpeculativeConfigError(
                f"need min_matching_ngram_size <= max_matching_ngram_size, got {min_matching_ngram_size} and "
                f"{max_matching_ngram_size}: set min_matching_ngram_size to at most max_matching_ngram_size.")
        self.max_ngram, self.min_ngram = max_matching_ngram_size, min_matching_ngram_size

    def propose(self, context, k, score, sample, threshold=0.0, costless_k=None):
        return self.lookup(context, k), None

    def mixed_width_runners(self, target):
        return [target]  # rounds without a match are 1-token steps between verify passes

    def lookup(self, context: List[int], k: int) -> List[int]:
        """The continuation of the first match of the longest matching suffix n-gram, or []."""
        length = len(context)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            for start in range(length - n):
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + k]
                    if follow:
                        return follow
        return []


class ModelDrafter(Drafter):
    """A draft model behind a Runner (a small model, or a low-bit copy of the target).

    Its KV cache follows the context by itself: each ``propose`` rolls the draft back to the
    longest prefix it shares with the context and feeds the rest, so a partial accept needs no
    separate update call.

    The draft sees the context from at most ``context_length`` tokens before the point where
    :meth:`start` (or :meth:`begin`) began the request (positions counted from there), and every token
    after: its prefill costs that many tokens instead of the whole prompt, and the target's verification
    keeps the output exact whatever the draft sees (a draft with a truncated view of the context, as
    MagicDec's StreamingLLM draft cache: Chen et al. 2024, "MagicDec: Breaking the Latency-Throughput
    Tradeoff for Long Context Generation with Speculative Decoding"). A hybrid's prompt lookup still searches
    the whole context.
    """

    stochastic = True

    def __init__(self, runner: Runner, vocab_size: int, context_length: int = 0):
        """``vocab_size``: the target's logit rows, which draft distributions are laid out on;
        ``context_length``: the most tokens of the starting context the draft prefills (0: all)."""
        self.runner = runner
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.tokens: List[int] = []  # what the draft's KV cache holds: the context from ``skip`` on
        self.skip = 0  # context tokens the draft does not see this request
        self.extended = 0  # tokens the last propose took from ``extend``

    def reset(self) -> None:
        self.runner.reset()
        self.tokens = []
        self.skip = 0
        self.extended = 0

    def extended_tokens(self) -> int:
        return self.extended

    def runners(self):
        return [self.runner]

    def start(self, context, score, sample, threshold=0.0) -> None:
        """Reset and prefill the draft with ``context`` now, so that the first round the cost model
        times is a drafting round and not the draft's prefill."""
        self.begin(context)
        self._sync(context)

    def begin(self, context: List[int]) -> None:
        """Reset for a request starting at ``context``, of which the draft will see the last ``context_length``."""
        self.reset()
        if self.context_length:
            self.skip = max(0, len(context) - self.context_length)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits on the target's vocabulary: padded rows cut off, missing rows at -inf."""
        extra = self.vocab_size - logits.shape[-1]
        if extra <= 0:
            return logits[:, : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))

    def next_logits(self, context: List[int]) -> torch.Tensor:
        """The draft's logits after ``context`` on the target's vocabulary, ``[1, vocab]`` float32."""
        return self._fit(self._sync(context))

    def _sync(self, context: List[int]) -> torch.Tensor:
        """Bring the draft cache to ``context`` (from ``skip`` on); return the raw logits after it, ``[1, vocab]``."""
        context = context[self.skip:]
        common = 0
        for a, b in zip(self.tokens, context):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)  # always feed at least the last token
        self.runner.rollback(self.runner.length - common)
        logits = self.runner.forward(context[common:], logits_to_keep=1)
        self.tokens = list(context)
        return logits

    def propose(self, context, k, score, sample, threshold=0.0, costless_k=None, extend: Optional[Extension] = None):
        """As :meth:`Drafter.propose`, and:

        Args:
            extend: a costless continuation, ``extend(prefix, n) -> up to n tokens`` (a hybrid's prompt
                lookup), tried after each drafted token but the last: where it finds tokens, they end the
                chain and the draft model stops there. When sampling they count as one-hot distributions
                (a deterministic function of the drafted prefix, so rejection sampling stays exact).
        """
        logits = self._sync(context)
        prefix = list(context)
        tokens, probs = [], []
        need_probs = sample or threshold > 0
        self.extended = 0
        for i in range(k):
            scored = score(prefix, self._fit(logits))
            if need_probs:
                if not bool(torch.isfinite(scored).any()):  # every token the draft scores is masked (a cut head)
                    break
                p = torch.softmax(scored, dim=-1)[0]
                token = int(torch.multinomial(p, 1)) if sample else int(p.argmax())
                if threshold > 0 and tokens and float(p.max()) < threshold:
                    break
                probs.append(p)
            else:
                token = int(scored.argmax())
            tokens.append(token)
            prefix.append(token)
            found = extend(prefix, k - len(tokens)) if extend is not None and i + 1 < k else []
            if found:
                tokens += found
                self.extended = len(found)
                if need_probs:
                    probs += [torch.nn.functional.one_hot(torch.tensor(t), self.vocab_size).float() for t in found]
                break
            if i + 1 < k:
                logits = self.runner.forward([token])[-1:]
                self.tokens.append(token)
        return tokens, (torch.stack(probs) if sample and probs else None)


class HybridDrafter(Drafter):
    """Prompt lookup when an n-gram matches, else the draft model, whose chain ends with prompt lookup's
    continuation as soon as its drafts so far make a match of the longest n-gram size
    (``max_matching_ngram_size``, 3 by default; :meth:`ModelDrafter.propose`'s ``extend``; an overlapped draft
    model drafted its tokens ahead and is not cut). On the Qwen2.5-Coder 1.5B target with its 0.5B int4 draft
    (3 code + 3 prose + 2 edit prompts x 32 tokens x 3, in-process A/B of three arms, identical outputs) this made
    20.9 tok/s against 19.8 without it (code 20.6 against 18.6: the draft model stops early, fewer draft steps;
    prose 15.5 against 15.2; edit 45.8 against 43.8); ending the chain at matches of 2 tokens made 20.2
    (more target passes: 86 against 79 on code, 36 against 33 on edit). ``lookup`` itself matches only its
    longest n-gram by default, for the same reason (:class:`~xpuspec.speculative.config.SpeculativeConfig`'s
    ``min_matching_ngram_size``), and its rounds may be longer than the model's (``costless_k``)."""

    stochastic = True

    def __init__(self, lookup: PromptLookupDrafter, model: Drafter, fallback: Optional[PromptLookupDrafter] = None):
        """``fallback``: the prompt lookup that goes on alone once the cost model drops the draft model
        (default ``lookup``)."""
        self.lookup, self.model, self.fallback = lookup, model, fallback or lookup
        self.extension = PromptLookupDrafter(lookup.max_ngram, lookup.max_ngram)
        self._looked_up = False

    @property
    def starts_before_prefill(self) -> bool:
        return self.model.starts_before_prefill  # an overlapped draft model prefills beside the target

    def reset(self) -> None:
        self.model.reset()
        self._looked_up = False

    @property
    def busy_s(self) -> Optional[float]:
        return self.model.busy_s

    def start(self, context, score, sample, threshold=0.0) -> None:
        self.model.start(context, score, sample, threshold)

    def stop(self) -> None:
        self.model.stop()

    def costless_part(self) -> Drafter:
        return self.fallback

    def runners(self):
        return self.model.runners()

    def last_round_costless(self) -> bool:
        return self._looked_up

    def extended_tokens(self) -> int:
        return 0 if self._looked_up else self.model.extended_tokens()

    def propose(self, context, k, score, sample, threshold=0.0, costless_k=None):
        """As :meth:`Drafter.propose`: a lookup round proposes up to ``costless_k``, a model round up to ``k``."""
        found = self.lookup.lookup(context, k if costless_k is None else costless_k)
        self._looked_up = bool(found)
        if found:
            return found, None
        if isinstance(self.model, ModelDrafter):
            return self.model.propose(context, k, score, sample, threshold, extend=self.extension.lookup)
        return self.model.propose(context, k, score, sample, threshold)
