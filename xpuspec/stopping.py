"""Stop strings over streamed text: where to cut, and what may be shown before the cut is known.

A decode loop hands text to :class:`StopStringMatcher` in whatever increments its tokens decode to (one token, a
block of accepted drafts, a piece of a multi-byte character that completes later). The matcher says which part of
the text is safe to show now, and whether a stop string has appeared. It holds back the end of the text while that
end could still be the start of a stop string, so a stop string split across tokens or inside a block of accepted
drafts is cut exactly where it begins (the problem sglang PR #23802 fixed for its speculative decoding).

The cut does not depend on how the text was split: the stop string that completes first in the text wins (the
point where a decode loop checking after every character would stop), and of those completing at the same
character, the longest. The output ends just before it, as in the OpenAI API's ``stop`` (the stop string itself is
not returned).
"""

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class StopCheck:
    """What :meth:`StopStringMatcher.feed` found.

    Attributes:
        text: text safe to show now, following what earlier calls returned (never part of a stop string).
        stop_string: the stop string that appeared, or ``None``.
        start, end: where it lies, in characters of all the text fed so far (``None`` without one). The text
            before ``start`` is the output; a caller that keeps the stop string (transformers'
            ``stop_strings``) keeps up to ``end``.
    """

    text: str
    stop_string: Optional[str] = None
    start: Optional[int] = None
    end: Optional[int] = None

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None


class StopStringMatcher:
    """Finds the first stop string in text fed in increments.

    Args:
        stop: the stop strings; empty strings are not allowed.

    Raises:
        ValueError: a stop string is empty, or not a string.
    """

    def __init__(self, stop: Sequence[str] = ()):
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}.")
        self.stop = tuple(dict.fromkeys(stop))
        self._held = ""  # text not yet returned: the end of the text fed that may start a stop string
        self._fed = 0  # characters fed so far
        self._stopped: Optional[StopCheck] = None

    @property
    def stopped(self) -> bool:
        return self._stopped is not None

    def feed(self, text: str) -> StopCheck:
        """Add ``text`` (the next piece of the output). After a stop, every later call returns the same check
        with no text.

        Returns:
            :class:`StopCheck`: the text to show now and, once one has appeared, the stop string.
        """
        if self._stopped is not None:
            return StopCheck("", self._stopped.stop_string, self._stopped.start, self._stopped.end)
        buffer = self._held + text
        base = self._fed - len(self._held)  # where the buffer begins in all the text fed
        self._fed += len(text)
        found = [(i + len(s), -len(s), i, s) for s in self.stop for i in [buffer.find(s)] if i >= 0]
        if found:  # the earliest end; at one end, the longest
            end, _, start, s = min(found)
            self._held = ""
            self._stopped = StopCheck(buffer[:start], s, base + start, base + end)
            return self._stopped
        keep = self._partial_length(buffer)
        self._held = buffer[len(buffer) - keep:]
        return StopCheck(buffer[:len(buffer) - keep])

    def flush(self) -> str:
        """The text held back, once the output has ended without a stop string ('' after a stop)."""
        held, self._held = self._held, ""
        return "" if self._stopped is not None else held

    def _partial_length(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins some stop string (and is shorter than it)."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
