"""SuffixDecoding's drafter: the request's own suffix structure and the model's cache of earlier outputs.

SuffixDecoding (Oliaro et al., arXiv 2411.04975): each round, the draft is the better scoring of the
request's structure (over its prompt and output so far) and the global one (over earlier
requests' outputs, a :class:`~xpuspec.speculative.suffix_cache.SuffixCache` owned by the loaded
model); the request's own wins ties, as in Arctic Inference. Drafts are looked up, never sampled:
``probs`` is ``None`` (one-hot in rejection sampling) and every token is free, so the output is the
target's whatever is drafted.

The drafter keeps no state across requests except through the cache: :meth:`SuffixDrafter.begin`
rebuilds the request's structure from the request's context, so that a drafter reused for an
unrelated request drafts nothing from the one before (the failure of llama.cpp's ``ngram-cache``,
llama.cpp#27852, whose per-slot table outlived its request). Within a request, drafts from the
cache that keep being rejected (fewer than :data:`SHARED_MIN_ACCEPTANCE` of their tokens kept after
:data:`SHARED_PATIENCE` of them) stop it drafting from the cache for the rest of the request.

"""

import enum
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..errors import SpeculativeConfigError
from .drafters import NO_DRAFT, Draft, Drafter, DraftRequest
from .policy import Widths
from .suffix import DEFAULT_MAX_DEPTH, SpeculationLimits, SuffixAutomaton
from .suffix_cache import SuffixCache

#: Drafts from the cache a request makes before their acceptance is judged.
SHARED_PATIENCE = 4
#: The share of the cache's drafted tokens the target must keep for a request to go on drafting from the cache.
SHARED_MIN_ACCEPTANCE = 0.2


class DraftSource(enum.Enum):
    """Where the last draft came from."""

    NONE = "none"
    REQUEST = "request"  # the request's own prompt and output
    SHARED = "shared"  # the model's cache of earlier outputs


class _Proposal(NamedTuple):
    """The last draft: where it came from, its length, and its :attr:`Candidate.end`."""

    source: DraftSource
    length: int
    end: int


_NOTHING = _Proposal(DraftSource.NONE, 0, -1)


@dataclass
class SuffixStats:
    """One request's drafts by source: drafts made, tokens drafted, tokens the target kept."""

    request_drafts: int = 0
    request_tokens: int = 0
    request_accepted: int = 0
    shared_drafts: int = 0
    shared_tokens: int = 0
    shared_accepted: int = 0
    shared_stopped: bool = False  # the cache's drafts failed and the request stopped using them


class SuffixDrafter(Drafter):
    """SuffixDecoding as a Drafter (``begin / propose / accept / end``); its drafts are free.

    Args:
        cache: the loaded model's cache of earlier outputs.
        share_across_requests: draft from ``cache`` and add this drafter's outputs to it. Off, a request drafts
            from its own prompt and output only, and no request's text reaches another's drafts. Prompts are never
            shared. A shared cache cannot change what a request outputs (an accepted draft is the target's own
            token), but how fast a request runs tells whether its output resembles another's: a server that serves
            several users should share only where they trust each other.
        limits: the paper's draft-length knobs.
        max_depth: the deepest string the request's structure counts (default: the cache's, else
            :data:`~xpuspec.speculative.suffix.DEFAULT_MAX_DEPTH`).

    Raises:
        SpeculativeConfigError: ``share_across_requests`` without a cache, or bad limits.
    """

    def __init__(self, cache: Optional[SuffixCache] = None, share_across_requests: bool = True,
                 limits: SpeculationLimits = SpeculationLimits(), max_depth: Optional[int] = None):
        if share_across_requests and cache is None:
            raise SpeculativeConfigError(
                "share_across_requests=True drafts from the loaded model's SuffixCache: pass cache=, or "
                "share_across_requests=False to draft from each request's own text only.")
        self.cache, self.share_across_requests = cache, share_across_requests
        self.limits = limits.check()
        self.max_depth = max_depth or (cache.max_depth if cache is not None else DEFAULT_MAX_DEPTH)
        self.stats = SuffixStats()
        self._request: Optional[DraftRequest] = None
        self._prompt_len = 0
        self._own = SuffixAutomaton(self.max_depth)
        self._seen = 0  # context tokens in ``_own``
        self._shared = False  # drafting from the cache in this request
        self._last = _NOTHING

    def begin(self, request: DraftRequest) -> None:
        """Start ``request``: index its context afresh, forget the last request's statistics."""
        super().begin(request)
        self._request, self._prompt_len = request, len(request.context)  # begun before the first token
        self._own = SuffixAutomaton(self.max_depth)
        self._own.extend(request.context)
        self._seen = len(request.context)
        self._shared = self.share_across_requests
        self.stats = SuffixStats()
        self._last = _NOTHING

    def propose(self, widths: Widths) -> Draft:
        """Up to ``widths.free`` tokens after the request's context: the better of its own and the cache's
        candidates."""
        if self._request is None:
            raise RuntimeError("SuffixDrafter.propose before begin(): start a request first.")
        k = widths.free
        if k < 1:
            return NO_DRAFT
        context = self._request.context
        self._own.extend(context[self._seen:])
        self._seen = len(context)
        best, source = self._own.speculate_tail(k, self.limits), DraftSource.REQUEST
        if self._shared:
            shared = self.cache.speculate(context[-self.max_depth:], k, self.limits)
            if shared.score > best.score:
                best, source = shared, DraftSource.SHARED
        if not best.tokens:
            source = DraftSource.NONE
        self._last = _Proposal(source, len(best.tokens), best.end)
        return Draft(list(best.tokens), None, len(best.tokens))

    def accept(self, n: int) -> None:
        """The target kept ``n`` tokens of the last draft.

        Raises:
            ValueError: ``n`` outside ``0 .. len(last draft)``.
        """
        source, drafted, end = self._last
        if not 0 <= n <= drafted:
            raise ValueError(f"accept(n): n must be within 0..{drafted} (the last draft's length), got {n!r}.")
        self._last = _NOTHING
        stats = self.stats
        if source is DraftSource.REQUEST:
            stats.request_drafts += 1
            stats.request_tokens += drafted
            stats.request_accepted += n
        elif source is DraftSource.SHARED:
            stats.shared_drafts += 1
            stats.shared_tokens += drafted
            stats.shared_accepted += n
            if n:
                self.cache.touch(end)
            if (stats.shared_drafts >= SHARED_PATIENCE
                    and stats.shared_accepted < SHARED_MIN_ACCEPTANCE * stats.shared_tokens):
                self._shared = False
                stats.shared_stopped = True

    def end(self) -> None:
        """The request finished: its output joins the cache when shared."""
        if self._request is not None and self.share_across_requests:
            self.cache.add(self._request.context[self._prompt_len:])
        self._request = None
        self._own = SuffixAutomaton(self.max_depth)
