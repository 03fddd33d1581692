"""What the server asks of the model, behind one small class.

The contract: :meth:`SerialBackend.run` is called from up to :attr:`~SerialBackend.max_running` worker threads at
once, each request's new tokens handed to its ``on_tokens`` as they come, ``on_tokens`` returning ``False`` to end
that request at once (a stop string, a client gone). Nothing else in :mod:`xpuspec.serve` touches the model.

- :class:`BatchedBackend` (continuous batching): concurrent ``generate`` calls on a model whose runners verify
  several sequences in one pass become rows of the model's engine (:mod:`xpuspec.engine`); a request joins between
  steps and leaves, freeing its KV blocks, as soon as it ends.
- :class:`SerialBackend`: one request at a time, for runners that decode one sequence (torch, pipeline stages).

Per-request speculative figures follow vLLM's spec-decode metrics (``num_drafts``, ``num_draft_tokens``,
``num_accepted_tokens``, ``num_accepted_tokens_per_pos``): :class:`SpeculativeUsage`.
"""

import math
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, List, Optional, Sequence, Tuple

from ..errors import SpeculativeConfigError
from ..generation import GenerationStats, eos_ids

#: What the server reports of its engine while requests run one at a time.
SERIAL_NOTE = ("requests run one at a time (this model's backend decodes one sequence): "
               "concurrent requests wait in the queue")


#: A temperature below this decodes greedily, as vLLM does (its ``_SAMPLING_EPS``): dividing the logits by it
#: overflows float32 (a 500 with "probability tensor contains inf or nan", found by schemathesis), and sampling at
#: it is greedy decoding in all but ties.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class GenerationParams:
    """One request's decoding settings, in ``generate``'s terms.

    Attributes:
        max_new_tokens: at most this many new tokens (at least 1).
        min_new_tokens: EOS cannot end the output before this many new tokens (vLLM's ``min_tokens``; 0: off).
        temperature: under :data:`SAMPLING_EPS` (0 included) decodes greedily; above it samples at this temperature
            (with ``top_p``).
        top_p: nucleus sampling's mass (1.0: off).
        seed: seeds torch's sampler before the request (``None``: not reproducible). A seeded request repeats its
            output under plain decoding; with speculation, only where the adaptive draft schedule repeats too
            (it follows what earlier requests measured), as the OpenAI API's seed is best effort.
        num_assistant_tokens, prompt_lookup_num_tokens, assistant_confidence_threshold: ``generate``'s speculative
            arguments of the same names (``None``: the model's own settings).
        speculative: ``False`` decodes plainly on a model loaded with speculation (``generate``'s argument).
        response_format: structured output, ``generate``'s argument (:mod:`xpuspec.grammar`), or ``None``.
    """

    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    num_assistant_tokens: Optional[int] = None
    prompt_lookup_num_tokens: Optional[int] = None
    assistant_confidence_threshold: Optional[float] = None
    speculative: Optional[bool] = None
    response_format: Optional[dict] = field(default=None, hash=False, compare=False)

    def generate_kwargs(self) -> dict:
        """``generate``'s keyword arguments for these settings (no top-k: the OpenAI API has none)."""
        sampling = dict(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=0) \
            if self.temperature >= SAMPLING_EPS else dict(do_sample=False)
        speculation = {name: getattr(self, name) for name in SPECULATIVE_FIELDS if getattr(self, name) is not None}
        structured = {"response_format": self.response_format} if self.response_format is not None else {}
        minimum = {"min_new_tokens": self.min_new_tokens} if self.min_new_tokens else {}
        return dict(max_new_tokens=self.max_new_tokens, **minimum, **sampling, **speculation, **structured)


#: The speculative request fields, named as ``generate``'s arguments (and OVMS's and transformers').
SPECULATIVE_FIELDS = ("num_assistant_tokens", "prompt_lookup_num_tokens", "assistant_confidence_threshold",
                      "speculative")


class FinishReason(Enum):
    """Why a request's generation ended."""

    EOS = "eos"  #: the model gave an end-of-sequence token
    LENGTH = "length"  #: max_new_tokens, or the model's context
    CALLER = "caller"  #: on_tokens returned False


@dataclass(frozen=True)
class SpeculativeUsage:
    """One request's speculative decoding, counted as vLLM counts it.

    Attributes:
        num_drafts: rounds that verified at least one draft token.
        num_draft_tokens, num_accepted_tokens: draft tokens verified, and accepted.
        accepted_per_position: rounds that accepted the draft token at each position (index 0: the first draft of a
            round); where a hybrid dropped its draft model, its rounds before (:class:`GenerationStats`).
    """

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: Tuple[int, ...]

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified round: 1 + accepted drafts per round (vLLM's definition; 1.0 without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_histogram(self) -> Tuple[int, ...]:
        """Rounds that accepted exactly j draft tokens, at index j (from :attr:`accepted_per_position`)."""
        at_least = (self.num_drafts,) + self.accepted_per_position
        return tuple(at_least[j] - (at_least[j + 1] if j + 1 < len(at_least) else 0) for j in range(len(at_least)))

    @classmethod
    def from_stats(cls, stats: GenerationStats) -> Optional["SpeculativeUsage"]:
        """The figures of a finished ``generate`` call; ``None`` for plain decoding."""
        counts = stats.acceptance_counts
        if counts is None:
            return None
        return cls(num_drafts=int(counts.judged[0]) if counts.judged else 0,
                   num_draft_tokens=stats.drafted_tokens, num_accepted_tokens=stats.accepted_tokens,
                   accepted_per_position=tuple(int(a) for a in counts.accepted))


@dataclass(frozen=True)
class Finished:
    """How a request ended.

    Attributes:
        prompt_tokens: tokens of the prompt.
        completion_tokens: new tokens handed to ``on_tokens``.
        reason: see :class:`FinishReason`.
        speculative: the request's speculative figures; ``None`` for plain decoding, and for a request its caller
            ended (``generate`` gives its statistics only when it returns).
        cached_tokens: prompt tokens found in the prefix cache; ``None`` for a request its caller ended.
    """

    prompt_tokens: int
    completion_tokens: int
    reason: FinishReason
    speculative: Optional[SpeculativeUsage] = None
    cached_tokens: Optional[int] = None


class _Ended(Exception):
    """Raised by the streamer to end ``generate`` when ``on_tokens`` returns False."""


class _Streamer:
    """transformers' streamer protocol (``put``/``end``): hands each new token to ``on_tokens``."""

    def __init__(self, on_tokens: Callable[[List[int]], bool]):
        self.on_tokens = on_tokens
        self.prompt_seen = False
        self.delivered: List[int] = []

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate puts the prompt first
            self.prompt_seen = True
            return
        ids = [int(t) for t in value.reshape(-1).tolist()]
        self.delivered.extend(ids)
        if not self.on_tokens(ids):
            raise _Ended

    def end(self) -> None:
        pass


class SerialBackend:
    """One model serving one request at a time.

    Args:
        model: an :class:`xpuspec.XpuspecModelForCausalLM`.

    Attributes:
        engine: ``"serial"``, for ``/health``.
        max_running: requests it runs at once (1).
        note: a line for ``/health`` on how requests are scheduled.
    """

    engine = "serial"
    max_running = 1
    note = SERIAL_NOTE

    def __init__(self, model):
        self.model = model
        self._lock = threading.Lock()  # one request at a time
        self._running = 0  # requests in generate

    @property
    def context_length(self) -> Optional[int]:
        """Tokens a request may hold, prompt and new tokens together (``None``: unknown)."""
        return self.model.context_length

    @property
    def vocab_size(self) -> int:
        return self.model.runner.vocab_size

    @property
    def has_draft_model(self) -> bool:
        """Whether the model drafts with a draft model (what ``assistant_confidence_threshold`` applies to)."""
        return self.model.draft_model is not None

    @property
    def speculation(self) -> str:
        """The model's speculative mode at load (``"none"`` without one), for ``/health``."""
        spec = self.model.speculative_config
        return "none" if spec is None else spec.mode

    def warm_up(self) -> None:
        """Decode two tokens plainly, so that the first request does not pay for what a model builds on first use
        (openvino_genai's engine for plain greedy decoding)."""
        import torch

        with self._lock:
            self.model.generate(torch.tensor([[self.model.generation_config.bos_token_id or 0]]), max_new_tokens=2,
                                do_sample=False, speculative=False)

    def check(self, params: GenerationParams) -> None:
        """Refuse settings this model cannot apply, before the request is queued.

        Raises:
            SpeculativeConfigError: ``speculative=False`` with speculative settings, a draft length with nothing to
                draft with, or a confidence threshold without a draft model.
            ResponseFormatError: a ``response_format`` that does not compile (compiled here, then cached).
        """
        self.model.grammar_for(params.response_format)
        given = [n for n in SPECULATIVE_FIELDS[:-1] if getattr(params, n) is not None]
        if params.speculative is False and given:
            raise SpeculativeConfigError(f"speculative=false decodes plainly; leave out {', '.join(given)}.")
        if params.speculative is True and self.model.speculative_config is None \
                and params.prompt_lookup_num_tokens is None:
            raise SpeculativeConfigError(
                "speculative=true: this server was started without --speculative; set prompt_lookup_num_tokens, or "
                "start the server with --speculative MODE.")
        if params.num_assistant_tokens is not None and self.model.speculative_config is None \
                and params.prompt_lookup_num_tokens is None:
            raise SpeculativeConfigError(
                "num_assistant_tokens: this server was started without --speculative, so nothing drafts; set "
                "prompt_lookup_num_tokens too, or start the server with --speculative MODE.")
        if params.assistant_confidence_threshold is not None and self.model.draft_model is None:
            raise SpeculativeConfigError(
                "assistant_confidence_threshold applies to a draft model, and this server has none; start it with "
                "--speculative self, hybrid or draft (--draft MODEL).")

    def run(self, prompt_ids: Sequence[int], params: GenerationParams,
            on_tokens: Callable[[List[int]], bool]) -> Finished:
        """Generate a continuation of ``prompt_ids``, handing new tokens to ``on_tokens`` as they come (possibly
        in another request's thread: the engine's driver); generation ends when ``on_tokens`` returns ``False``.
        Blocks while another request runs (:class:`BatchedBackend`: joins it instead).

        Raises:
            whatever ``generate`` raises for settings it refuses (:mod:`xpuspec.errors`).
        """
        with self._lock:
            self._running += 1
            try:
                return self._generate(prompt_ids, params, on_tokens)
            finally:
                self._running -= 1

    def _generate(self, prompt_ids, params: GenerationParams, on_tokens) -> Finished:
        import torch

        streamer = _Streamer(on_tokens)
        if params.seed is not None and params.temperature >= SAMPLING_EPS:
            torch.manual_seed(params.seed)
        try:
            self.model.generate(torch.tensor([list(prompt_ids)], dtype=torch.long), streamer=streamer,
                                **params.generate_kwargs())
        except _Ended:
            return Finished(len(prompt_ids), len(streamer.delivered), FinishReason.CALLER)
        stats = self.model.last_generate_stats  # this thread's call
        new = streamer.delivered
        eos = set(eos_ids(self.model.generation_config))
        reason = FinishReason.EOS if new and new[-1] in eos else FinishReason.LENGTH
        return Finished(len(prompt_ids), len(new), reason, SpeculativeUsage.from_stats(stats), stats.cached_tokens)

    @property
    def prefix_caching(self) -> bool:
        """Whether requests reuse the KV blocks of earlier requests' common prompt starts, for ``/health``."""
        return self.model.prefix_caching

    def prefix_cache_counts(self) -> tuple:
        """``(queries, hits)``: prompt tokens the target's prefix cache was asked for and found since the model
        loaded (vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``); ``(0, 0)`` without a prefix cache."""
        pool = getattr(self.model.runner, "prefix_cache", None)
        return (0, 0) if pool is None else (pool.queries, pool.hits)

    def kv_blocks_in_use(self) -> int:
        """KV-cache blocks the running requests hold in the target and draft models (a runner's block pool, or one
        block per ``block_size`` tokens of a runner without one); 0 between requests."""
        if not self._running:
            return 0
        runners = [self.model.runner] + ([self.model.draft_model.runner] if self.model.draft_model else [])
        return sum(r.blocks_in_use if hasattr(r, "blocks_in_use")
                   else math.ceil(getattr(r, "length", 0) / getattr(r, "block_size", 1)) for r in runners)


class BatchedBackend(SerialBackend):
    """Continuous batching: up to ``max_batch`` requests run at once as rows of the model's engine
    (:mod:`xpuspec.engine`), joining between steps and leaving, with their KV blocks, as soon as they end.

    Args:
        model: an xpuspec model whose runners verify several sequences in one pass (``model.can_batch()``).
        max_batch: the most requests decoded together; more wait in the server's queue.

    Raises:
        ValueError: ``max_batch`` below 1.
    """

    engine = "batched"
    note = "continuous batching: requests join the running batch between steps and leave as they end"

    def __init__(self, model, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}.")
        super().__init__(model)
        model.max_batch = self.max_running = max_batch

    def run(self, prompt_ids: Sequence[int], params: GenerationParams,
            on_tokens: Callable[[List[int]], bool]) -> Finished:
        with self._lock:
            self._running += 1
        try:
            return self._generate(prompt_ids, params, on_tokens)
        finally:
            with self._lock:
                self._running -= 1

