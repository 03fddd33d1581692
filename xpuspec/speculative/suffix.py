"""The suffix structure of SuffixDecoding and its draft scoring.

SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", arXiv 2411.04975) drafts from suffix trees: one over the current request (prompt
and output so far), one over the outputs of earlier requests. At each round it matches the last
``p`` tokens of the context, follows the most frequent continuations of the match and keeps the
draft whose score (the sum of the drafted tokens' estimated probabilities) is highest over all
match lengths ``p``, each drafting at most ``MAX_SPEC = alpha * p`` tokens.

:class:`SuffixAutomaton` holds the same counts as the paper's depth-bounded suffix tree: how often
every token string of at most ``max_depth`` tokens occurs in the indexed text. It is an online
suffix automaton (Blumer et al. 1985, "The smallest automaton recognizing the subwords of a
text"): at most ``2n`` states and ``3n`` transitions for ``n`` tokens however repetitive the text
(a suffix trie without path compression grows as ``n * max_depth``), extended one token at a time
in amortized constant time plus at most ``max_depth`` count updates.

Scoring (:meth:`SuffixAutomaton.speculate`), as the paper with the draft tree reduced to a chain
(the target verifies one chain): for every suffix ``P`` of the pattern of length ``m <= max_depth``
that occurs in the text, follow from ``P`` the continuation seen most often (ties: the one seen
last), each token's probability being the running product of ``count(s t) / sum_u count(s u)``
over the walk (the share of the occurrences of ``s`` that went on with ``t``); stop below
``min_token_prob`` or after ``min(k, int(max_spec_factor * m + max_spec_offset), max_depth - m)``
tokens (the last term: the tree is ``max_depth`` deep). The draft with the highest sum of
probabilities wins; ties go to the longer match. Occurrences at the very end of the text or of
a sequence have no continuation and count for nothing.
"""

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

from ..errors import SpeculativeConfigError

#: Tokens of the deepest string counted (the paper's tree depth; vLLM's default is 24). A match longer than
#: ``max_depth - k`` drafts fewer than k tokens, so it must well exceed the longest draft.
DEFAULT_MAX_DEPTH = 32
#: The token that ends a sequence in a structure holding several (no real token id is negative).
SEPARATOR = -1
_NO_TOKEN = -2  # a state's first transition is still unset


@dataclass(frozen=True)
class SpeculationLimits:
    """The paper's draft-length knobs (vLLM's ``suffix_decoding_*`` names and defaults).

    Attributes:
        max_spec_factor: ``alpha`` of ``MAX_SPEC = alpha * p``: at most this many tokens per matched token.
        max_spec_offset: added to ``alpha * p`` (may be negative).
        min_token_prob: stop the draft where a token's estimated probability falls below this (0..1).
    """

    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1

    def check(self) -> "SpeculationLimits":
        """Raises: SpeculativeConfigError: a negative factor or a probability outside 0..1."""
        if not self.max_spec_factor >= 0:
            raise SpeculativeConfigError(f"max_spec_factor must be >= 0, got {self.max_spec_factor!r}.")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise SpeculativeConfigError(f"min_token_prob must be within 0..1, got {self.min_token_prob!r}.")
        return self

    def spec(self, m: int, k: int) -> int:
        """``MAX_SPEC`` of a match of ``m`` tokens, at most ``k`` (may be negative with a negative offset)."""
        return min(k, int(self.max_spec_factor * m + self.max_spec_offset + 1e-6))

    def cap(self, m: int, k: int, max_depth: int) -> int:
        """The most tokens a match of ``m`` tokens drafts from a structure ``max_depth`` deep."""
        return max(0, min(self.spec(m, k), max_depth - m))


@dataclass(frozen=True)
class Candidate:
    """A scored draft.

    Attributes:
        tokens: the drafted token ids, in order.
        probs: each token's estimated probability (non-increasing, in ``[min_token_prob, 1]``).
        score: ``sum(probs)``, the paper's SCORE.
        match_len: tokens of the pattern the draft continues.
        end: text position of the last drafted token in its latest occurrence (-1: no draft).
    """

    tokens: Tuple[int, ...] = ()
    probs: Tuple[float, ...] = ()
    score: float = 0.0
    match_len: int = 0
    end: int = -1


NO_CANDIDATE = Candidate()


class SuffixAutomaton:
    """Occurrence counts of every token string of at most ``max_depth`` tokens in a growing text.

    The text is one or more sequences of token ids (ints >= 0); :meth:`separate` ends one. Counts
    and positions are exact for strings of at most ``max_depth`` tokens, which is all that
    :meth:`speculate` reads.
    """

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH):
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 2:
            raise SpeculativeConfigError(f"max_depth must be an int >= 2, got {max_depth!r}.")
        self.max_depth = max_depth
        # Per state: its first transition (token, or NO_TOKEN, and target) and a dict of the others or None (most
        # states have one), suffix link, longest string's length, occurrences, end of the latest occurrence, and
        # ``floor``: an ancestor-or-self on the suffix-link path with no state between that holds a string of at
        # most max_depth - 1 tokens (see _resolve_floor).
        self._token: List[int] = [_NO_TOKEN]
        self._to: List[int] = [0]
        self._more: List[Optional[dict]] = [None]
        self._link: List[int] = [-1]
        self._len: List[int] = [0]
        self._count: List[int] = [0]
        self._end: List[int] = [-1]
        self._floor: List[int] = [0]
        # Per state: the sum of its continuations' counts (separators left out) and the continuation seen most
        # often (ties: last), or -1. Exact for states holding a string of at most max_depth - 1 tokens.
        self._total: List[int] = [0]
        self._top: List[int] = [-1]
        self._last = 0  # the state of the whole text
        self._size = 0  # tokens held, separators included

    def __len__(self) -> int:
        """Tokens held, separators included."""
        return self._size

    @property
    def states(self) -> int:
        return len(self._len)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (ints >= 0) to the current sequence.

        Raises:
            ValueError: a negative token (nothing is appended).
        """
        tokens = list(tokens)
        if tokens and min(tokens) < 0:
            raise ValueError(f"token ids must be >= 0, got {min(tokens)}.")
        for token in tokens:
            self._append(token)

    def separate(self) -> None:
        """End the current sequence: the next token starts a new one (no string spans the two)."""
        self._append(SEPARATOR)

    def _clone(self, q: int, length: int) -> int:
        """A copy of state ``q`` (transitions, link, counts, continuations) for its strings of at most ``length``
        tokens."""
        for values in (self._token, self._to, self._link, self._count, self._end, self._total, self._top):
            values.append(values[q])
        more = self._more[q]
        self._more.append(dict(more) if more is not None else None)
        self._len.append(length)
        self._floor.append(len(self._floor))
        return len(self._floor) - 1

    def _get(self, state: int, token: int) -> int:
        """The target of ``state``'s transition by ``token``, or -1."""
        if self._token[state] == token:
            return self._to[state]
        more = self._more[state]
        return more.get(token, -1) if more is not None else -1

    def _set(self, state: int, token: int, target: int) -> None:
        """Add or redirect ``state``'s transition by ``token``."""
        if self._token[state] == token or self._token[state] == _NO_TOKEN:
            self._token[state], self._to[state] = token, target
        elif self._more[state] is None:
            self._more[state] = {token: target}
        else:
            self._more[state][token] = target

    def _append(self, token: int) -> None:
        token_of, to, more, link, length = self._token, self._to, self._more, self._link, self._len
        count, end, total, top = self._count, self._end, self._total, self._top
        previous, cur = self._last, len(length)
        link.append(0)
        length.append(length[previous] + 1)
        self._floor.append(cur)
        token_of.append(_NO_TOKEN)
        to.append(0)
        more.append(None)
        count.append(0)
        end.append(-1)
        total.append(0)
        top.append(-1)
        p = previous
        while p != -1:  # the suffixes of the text without a transition by ``token`` get one, to ``cur``
            first = token_of[p]
            if first == token:
                break
            if first == _NO_TOKEN:
                token_of[p], to[p] = token, cur
            elif more[p] is None:
                more[p] = {token: cur}
            elif token in more[p]:
                break
            else:
                more[p][token] = cur
            p = link[p]
        if p != -1:
            q = self._get(p, token)
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._clone(q, length[p] + 1)
                while p != -1 and self._get(p, token) == q:
                    self._set(p, token, clone)
                    p = link[p]
                link[q] = link[cur] = clone
        self._last = cur
        position = self._size
        self._size += 1
        if token < 0:
            return  # strings ending with a separator are never read
        # The suffixes of the new text of 1..max_depth tokens are those of the text before, of 0..max_depth - 1
        # tokens (the states on the suffix-link path from the deepest holding max_depth - 1 of them up to the root),
        # each followed by ``token``. Each such suffix gains an occurrence ending here and one more continuation,
        # by ``token``, which becomes its most frequent if it ties or beats the one before (it was seen last).
        # Several states of the path may lead to one state of the new suffixes: they come in a row.
        u, counted = self._resolve_floor(previous), -1
        while u != -1:
            w = to[u] if token_of[u] == token else more[u][token]
            if w != counted:
                count[w] += 1
                end[w] = position
                counted = w
            if u:
                total[u] += 1
                b = top[u]
                if b < 0 or count[w] >= count[to[u] if token_of[u] == b else more[u][b]]:
                    top[u] = token
            u = link[u]

    def _resolve_floor(self, v: int) -> int:
        """The deepest state on ``v``'s suffix-link path (``v`` included) holding a string of at most
        ``max_depth - 1`` tokens (its shortest string, ``len(link) + 1``, is that short): the strings a walk may
        continue, whose continuations are counted.

        ``floor[v]`` is a cached guess: an ancestor-or-self with no qualifying state between. A clone inserted
        later above a state keeps that true (it holds only longer strings when the state below it did not
        qualify), so the answer is found walking up from the guess."""
        link, length, floor, longest = self._link, self._len, self._floor, self.max_depth - 1
        u = floor[v]
        while u and length[link[u]] >= longest:
            u = floor[link[u]]
        floor[v] = u
        return u

    def occurrences(self, pattern: Sequence[int]) -> int:
        """How often ``pattern`` (at most ``max_depth`` tokens, non-empty) occurs in the text."""
        if not 0 < len(pattern) <= self.max_depth:
            raise ValueError(f"pattern must have 1..{self.max_depth} tokens, got {len(pattern)}.")
        v = 0
        for token in pattern:
            v = self._get(v, token)
            if v < 0:
                return 0
        return self._count[v]

    def speculate(self, pattern: Sequence[int], k: int, limits: SpeculationLimits) -> Candidate:
        """The best draft continuing ``pattern`` from the text (the scoring of the module docstring).

        Args:
            pattern: the context's tokens (only the last ``max_depth`` are read).
            k: the most tokens to draft.
            limits: the draft-length knobs.
        """
        token_of, to, more, link, length = self._token, self._to, self._more, self._link, self._len
        v, matched = 0, 0
        for token in pattern[-self.max_depth:]:
            while True:  # the longest suffix of the match so far that goes on with ``token``
                if token_of[v] == token:
                    w = to[v]
                    break
                w = more[v].get(token, -1) if more[v] is not None else -1
                if w >= 0 or not v:
                    break
                v = link[v]
                matched = length[v]
            v, matched = (w, matched + 1) if w > 0 else (0, 0)
        return self._best(v, matched, k, limits)

    def speculate_tail(self, k: int, limits: SpeculationLimits) -> Candidate:
        """:meth:`speculate` with the text's own end as the pattern (a request's structure over its context)."""
        if not self._size:
            return NO_CANDIDATE
        # a match of max_depth tokens would draft none: the longest that can draft is max_depth - 1
        return self._best(self._resolve_floor(self._last), min(self._size, self.max_depth - 1), k, limits)

    def _best(self, v: int, matched: int, k: int, limits: SpeculationLimits) -> Candidate:
        """The best draft over the suffixes of the match: state ``v`` holds the pattern's last ``matched`` tokens,
        and its suffix-link path the shorter suffixes. States are visited longest first, so that on equal scores
        the longer match wins; a state's every length shares one walk."""
        link, length, top, depth = self._link, self._len, self._top, self.max_depth
        best, best_score = NO_CANDIDATE, 0.0
        hi = matched
        while v > 0:
            lo = length[link[v]] + 1
            if limits.spec(hi, k) <= best_score:
                break  # no shorter match can draft enough tokens to score higher
            if top[v] >= 0:
                widest, m = 0, hi  # the most tokens any length lo..hi drafts; below a length whose MAX_SPEC
                while m >= lo and limits.spec(m, k) > widest:  # is within it, none drafts more
                    widest = max(widest, limits.cap(m, k, depth))
                    m -= 1
                if widest:
                    tokens, probs, ends = self._walk(v, widest, limits.min_token_prob)
                    reach = min(widest, len(tokens))
                    score = sum(probs[:reach])
                    if reach and score > best_score:
                        m = hi  # the longest match drafting ``reach`` tokens
                        while limits.cap(m, k, depth) < reach:
                            m -= 1
                        best_score = score
                        best = Candidate(tuple(tokens[:reach]), tuple(probs[:reach]), score, m, ends[reach - 1])
            hi = lo - 1
            v = link[v]
        return best

    def _walk(self, v: int, steps: int, min_prob: float) -> Tuple[List[int], List[float], List[int]]:
        """Follow the most frequent continuations from state ``v`` for at most ``steps`` tokens."""
        get, count, end, total, best = self._get, self._count, self._end, self._total, self._top
        tokens, probs, ends = [], [], []
        prob = 1.0
        for _ in range(steps):
            token = best[v]
            if token < 0:
                break
            w = get(v, token)
            prob *= count[w] / total[v]
            if prob < min_prob:
                break
            tokens.append(token)
            probs.append(prob)
            ends.append(end[w])
            v = w
        return tokens, probs, ends
