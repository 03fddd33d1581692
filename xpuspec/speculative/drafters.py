"""Drafters: each proposes tokens for the target to verify.

A drafter serves one request at a time, in the manner of llama.cpp's speculative ``begin / draft / accept``:
:meth:`Drafter.begin` takes what is fixed for the request (:class:`DraftRequest`), :meth:`Drafter.propose` returns
a :class:`Draft` of at most the widths the policy allows, and :meth:`Drafter.accept` reports how many of its tokens
the target kept. The request's ``context`` is the decode loop's own list of tokens (prompt and accepted output),
which drafters read and never write. Tokens that cost no model step (looked up in the context) are called *free*.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import SpeculativeConfigError
from ..generation import PositionCounts
from ..runner import Runner
from ..scoring import argmax_rows
from .policy import Widths
from .schedule import check_count

#: ``score(prefix, logits)``: a drafter's raw logits ``[1, vocab]`` turned into the processed scores the target
#: uses at that prefix (repetition penalty, length rules, temperature, top-k, top-p), so that draft and target
#: distributions are built alike.
Score = Callable[[List[int], torch.Tensor], torch.Tensor]
#: Context tokens a draft model prefills by default (``SpeculativeConfig.draft_context_length``): its prefill then
#: costs a bounded number of tokens, and the target's verification keeps the output exact whatever it sees.
DEFAULT_DRAFT_CONTEXT_LENGTH = 64


@dataclass
class DraftRequest:
    """What is fixed for one request.

    Attributes:
        context: the request's tokens so far (prompt, then accepted output); the decode loop appends to this list.
        score: see :data:`Score`.
        sample: drafts are sampled (rejection sampling verifies them) rather than taken greedily.
        threshold: a model drafter ends its round below this top probability (``assistant_confidence_threshold``).
    """

    context: List[int]
    score: Score
    sample: bool
    threshold: float = 0.0


@dataclass(frozen=True)
class Draft:
    """Proposed tokens.

    Attributes:
        tokens: token ids following the request's context.
        probs: ``[len(tokens), vocab]`` float32 draft distributions where a model sampled them; ``None`` for
            deterministic proposals, which count as one-hot distributions in rejection sampling.
        free: how many of ``tokens`` (at the end) cost no model step.
    """

    tokens: List[int]
    probs: Optional[torch.Tensor] = None
    free: int = 0


NO_DRAFT = Draft([])


@dataclass
class DraftCounters:
    """What one drafter's drafts came to since its request began, kept by the drafter as llama.cpp's drafters keep
    their drafted and accepted counts; the decode loop gathers them into the request's ``GenerationStats`` when the
    request ends (:func:`xpuspec.decode.end_drafting`).

    Attributes:
        drafted_tokens: its tokens the target judged.
        accepted_tokens: those the target kept (a draft kept past the output's end, at EOS, a stop string or the
            length limit, does not count).
        positions: per draft position (index 0: the first token of a draft), the rounds that judged a token there
            and the rounds that kept it.
    """

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    positions: PositionCounts = field(default_factory=PositionCounts)

    def add_round(self, drafted: int, kept: int) -> None:
        """One round: the target judged ``drafted`` of its tokens and kept ``kept`` (0 <= kept <= drafted)."""
        self.drafted_tokens += drafted
        self.accepted_tokens += kept
        self.positions.add_round(drafted, kept)


class Drafter(ABC):
    """Proposes draft tokens for one request at a time (see the module docstring)."""

    #: Some of its rounds run a draft model (the policy judges whether they pay).
    uses_model: bool = False

    #: Outputs of the target's passes it needs besides logits (``frozenset({"hidden_states"})`` for a trained draft
    #: head): after every pass of the target over this row (prefill and verify), :func:`xpuspec.decode.verify_and_emit`
    #: hands them to :meth:`observe`. Empty: logits only.
    needs: frozenset = frozenset()

    def begin(self, request: DraftRequest) -> None:
        """Start a request; called before the target's prefill. Its :attr:`counters` start from zero."""
        self.request = request
        self.counters = DraftCounters()

    def counted(self, drafted: int, kept: int) -> None:
        """The decode loop's note of a judged round of this drafter's tokens (:meth:`DraftCounters.add_round`)."""
        self.counters.add_round(drafted, kept)

    @abstractmethod
    def propose(self, widths: Widths) -> Draft:
        """At most ``widths.model`` tokens drafted with a model, or ``widths.free`` free ones."""

    def accept(self, n: int) -> None:
        """The target kept ``n`` tokens of the last draft; the request's context already holds them and the
        target's own next token."""

    def end(self) -> None:
        """The request is over; release what :meth:`begin` holds (a worker thread)."""

    def without_model(self) -> Optional["Drafter"]:
        """What drafts once the policy stops the draft model: the free part of a hybrid, else ``None``."""
        return None if self.uses_model else self

    def on_rows(self, open_sequence: Callable[[Runner], Runner]) -> "Drafter":
        """This drafter for one row of a batch: where it computes with a model, a copy whose model drafts on a
        sequence of its own (``open_sequence(runner)``, which the engine closes when the row leaves); a drafter
        without a model returns itself (it keeps no KV cache)."""
        return self

    def observe(self, outputs: dict) -> None:
        """The outputs named in :attr:`needs` of the target's last pass over this row, before acceptance:
        ``outputs["hidden_states"]`` is ``(start, taps)``, the pass's first position and its tapped layers' hidden
        states ``[n, taps * hidden]`` float32 (:attr:`xpuspec.runner.Runner.last_taps`)."""

    def runners(self) -> List[Runner]:
        """The model runners it computes with."""
        return []

    @property
    def busy_s(self) -> Optional[float]:
        """Seconds a drafter computing in its own thread spent on this request; ``None`` where it drafts inside
        :meth:`propose` (the loop times it)."""
        return None


def choose_token(request: DraftRequest, scored: torch.Tensor, drafted: int):
    """The next token of a model's draft chain from its processed scores ``scored`` (``[1, vocab]`` float32):
    ``(token, p)``, sampled where the request samples, else the argmax, with ``p`` its distribution ``[vocab]``
    where sampling or the confidence stop needs it (else ``None``); ``None`` where the chain stops before this
    token (every token masked, e.g. a cut head; or, after ``drafted`` >= 1 tokens, a top probability under the
    request's confidence threshold: transformers' ``assistant_confidence_threshold``)."""
    if not (request.sample or request.threshold > 0):
        return argmax_rows(scored)[0], None
    if not bool(torch.isfinite(scored).any()):
        return None
    p = torch.softmax(scored, dim=-1)[0]
    token = int(torch.multinomial(p, 1)) if request.sample else argmax_rows(p)[0]
    if request.threshold > 0 and drafted and float(p.max()) < request.threshold:
        return None
    return token, p


class PromptLookupDrafter(Drafter):
    """n-gram prompt lookup (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

    Finds the first occurrence of the context's last n tokens, for n from ``max_matching_ngram_size`` down to
    ``min_matching_ngram_size``, and proposes the tokens that followed it (openvino_genai's choice: the earliest
    match lies in the prompt, the text being copied). The n-grams are indexed as the context grows, so a lookup
    costs O(n) whatever the context's length.

    Raises:
        SpeculativeConfigError: sizes that are not ints >= 1, or a minimum above the maximum.
    """

    def __init__(self, max_matching_ngram_size: int = 3, min_matching_ngram_size: int = 2):
        self.max_ngram = check_count("max_matching_ngram_size", max_matching_ngram_size)
        self.min_ngram = check_count("min_matching_ngram_size", min_matching_ngram_size)
        if self.min_ngram > self.max_ngram:
            raise SpeculativeConfigError(
                f"need min_matching_ngram_size <= max_matching_ngram_size, got {self.min_ngram} and {self.max_ngram}: "
                "set min_matching_ngram_size to at most max_matching_ngram_size.")
        self._first: Dict[Tuple[int, ...], int] = {}  # n-gram -> where it first starts
        self._indexed = 0  # context tokens indexed

    def begin(self, request: DraftRequest) -> None:
        super().begin(request)
        self._first, self._indexed = {}, 0

    def propose(self, widths: Widths) -> Draft:
        found = self.lookup(self.request.context, widths.free) if widths.free > 0 else []
        return Draft(found, None, len(found))

    def lookup(self, prefix: List[int], k: int) -> List[int]:
        """Up to ``k`` tokens that followed the first earlier occurrence of ``prefix``'s longest matching suffix
        n-gram, or ``[]``. ``prefix`` is the request's context, possibly followed by tokens drafted after it."""
        self._index()
        for n in range(min(self.max_ngram, len(prefix) - 1), self.min_ngram - 1, -1):
            start = self._first.get(tuple(prefix[-n:]))
            if start is not None and start + n < len(prefix):
                return prefix[start + n:start + n + k]
        return []

    def _index(self) -> None:
        """Index the n-grams that end in the context tokens not indexed yet."""
        context = self.request.context
        for end in range(self._indexed + 1, len(context) + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._first.setdefault(tuple(context[end - n:end]), end - n)
        self._indexed = len(context)


class ModelDrafter(Drafter):
    """A draft model behind a Runner (a small model, or a low-bit copy of the target).

    Its KV cache follows the context by itself: each :meth:`propose` rolls the draft back to the longest prefix it
    shares with the context and feeds the rest, so it prefills only once drafting begins (after the target's first
    token). It sees at most ``context_length`` tokens of the prompt's end, and every token after (a truncated view
    of the context, as MagicDec's StreamingLLM draft cache: Chen et al. 2024): the target verifies every draft, so
    the output stays exact.

    Args:
        runner: the draft model.
        vocab_size: the target's logit rows, which draft distributions are laid out on.
        context_length: the most prompt tokens the draft sees (0: all).
        extension: a lookup tried after each drafted token but the last; where it finds tokens, they end the chain
            (free, one-hot when sampling: a deterministic function of the drafted prefix) and the model stops there.
    """

    uses_model = True

    def __init__(self, runner: Runner, vocab_size: int, context_length: int = 0,
                 extension: Optional[PromptLookupDrafter] = None):
        self.runner, self.vocab_size, self.context_length, self.extension = runner, vocab_size, context_length, extension
        self.tokens: List[int] = []  # what the draft's KV cache holds: the context from ``skip`` on
        self.skip = 0  # context tokens the draft does not see this request

    def runners(self) -> List[Runner]:
        return [self.runner]

    def on_rows(self, open_sequence: Callable[[Runner], Runner]) -> "ModelDrafter":
        return ModelDrafter(open_sequence(self.runner), self.vocab_size, self.context_length, self.extension)

    def begin(self, request: DraftRequest) -> None:
        super().begin(request)
        if self.extension is not None:
            self.extension.begin(request)
        self.runner.reset()
        self.tokens = []
        self.skip = max(0, len(request.context) - self.context_length) if self.context_length else 0

    def end(self) -> None:
        """Offer the draft's KV blocks of the request's accepted tokens to later requests (prefix caching; drafts
        past them stay private)."""
        request = getattr(self, "request", None)
        if request is not None:
            self.runner.share(request.context[self.skip:])

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits on the target's vocabulary: padded rows cut off, missing rows at -inf."""
        extra = self.vocab_size - logits.shape[-1]
        if extra <= 0:
            return logits[:, :self.vocab_size]
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))

    def next_logits(self, prefix: List[int]) -> torch.Tensor:
        """The draft's logits after ``prefix`` on the target's vocabulary, ``[1, vocab]`` float32."""
        return self._fit(self._sync(prefix))

    def _sync(self, prefix: List[int]) -> torch.Tensor:
        """Bring the draft cache to ``prefix`` (from ``skip`` on); the raw logits after it, ``[1, vocab]``."""
        seen = prefix[self.skip:]
        if not self.tokens and self.runner.length == 0:  # a new request: start on its cached prefix, if any
            self.tokens = list(seen[:self.runner.reuse_prefix(seen)])
        common = 0
        for a, b in zip(self.tokens, seen):
            if a != b:
                break
            common += 1
        common = min(common, len(seen) - 1)  # always feed at least the last token
        self.runner.rollback(self.runner.length - common)
        logits = self.runner.forward(seen[common:], logits_to_keep=1, exact=False)
        self.tokens = list(seen)
        return logits

    def propose(self, widths: Widths) -> Draft:
        k, request = widths.model, self.request
        if k <= 0:
            return NO_DRAFT
        prefix = list(request.context)
        logits = self._sync(prefix)
        tokens, probs, free = [], [], 0
        for i in range(k):
            picked = choose_token(request, request.score(prefix, self._fit(logits)), len(tokens))
            if picked is None:
                break
            token, p = picked
            if p is not None:
                probs.append(p)
            tokens.append(token)
            prefix.append(token)
            found = self.extension.lookup(prefix, k - len(tokens)) if self.extension is not None and i + 1 < k else []
            if found:
                tokens += found
                free = len(found)
                probs += [torch.nn.functional.one_hot(torch.tensor(t), self.vocab_size).float() for t in found]
                break
            if i + 1 < k:
                logits = self.runner.forward([token], exact=False)[-1:]
                self.tokens.append(token)
        return Draft(tokens, torch.stack(probs) if request.sample and probs else None, free)


class HybridDrafter(Drafter):
    """A free drafter (prompt lookup, suffix decoding) where it finds tokens (a round of up to ``widths.free``),
    else the draft model.

    Args:
        lookup: the free drafter tried first each round.
        model: the draft model's drafter (its chain may end with a lookup, :class:`ModelDrafter`'s ``extension``).
        fallback: the free drafter that drafts alone once the policy stops the draft model (default ``lookup``).
    """

    uses_model = True

    def __init__(self, lookup: Drafter, model: Drafter, fallback: Optional[Drafter] = None):
        self.lookup, self.model, self.fallback = lookup, model, fallback or lookup
        self._last: Drafter = lookup
        self.needs = frozenset().union(*(p.needs for p in self._parts()))  # an EAGLE-3 head's hidden states

    def _parts(self) -> List[Drafter]:
        return list({id(p): p for p in (self.lookup, self.model, self.fallback)}.values())

    def begin(self, request: DraftRequest) -> None:
        super().begin(request)
        for part in self._parts():
            part.begin(request)

    def propose(self, widths: Widths) -> Draft:
        draft = self.lookup.propose(widths)
        self._last = self.lookup if draft.tokens else self.model
        return draft if draft.tokens else self.model.propose(widths)

    def accept(self, n: int) -> None:
        self._last.accept(n)

    def observe(self, outputs: dict) -> None:
        for part in self._parts():  # every pass, whichever part drafted: a head keeps the taps of each position
            if part.needs:
                part.observe(outputs)

    def end(self) -> None:
        for part in self._parts():
            part.end()

    def without_model(self) -> Drafter:
        return self.fallback

    def on_rows(self, open_sequence: Callable[[Runner], Runner]) -> "HybridDrafter":
        fallback = self.lookup if self.fallback is self.lookup else self.fallback
        return HybridDrafter(self.lookup, self.model.on_rows(open_sequence), fallback)

    def runners(self) -> List[Runner]:
        return self.model.runners()

    @property
    def busy_s(self) -> Optional[float]:
        return self.model.busy_s
