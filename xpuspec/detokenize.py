"""Token ids to text, incrementally, for streaming.

Decoding each new token alone loses what depends on its neighbours (SentencePiece's leading space, a multi-byte
character split over byte-level BPE tokens). :class:`IncrementalDetokenizer` decodes a short window of the last
tokens instead and returns the text the new ones add, holding back text that ends in an incomplete character (the
replacement character U+FFFD), as transformers' ``TextStreamer`` and vLLM's detokenizer do. The pieces it returns
join to ``tokenizer.decode(ids, skip_special_tokens=...)`` of all the ids.
"""

from typing import List, Sequence

#: What a tokenizer decodes an incomplete UTF-8 sequence to.
REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Text of a growing list of token ids, piece by piece.

    Args:
        tokenizer: a transformers tokenizer (``decode``).
        skip_special_tokens: as ``tokenizer.decode``'s (default ``True``: EOS and chat markers give no text).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: List[int] = []
        self._prefix = 0  # the window decoded starts here ...
        self._read = 0  # ... and the text of ids[_prefix:_read] has been returned

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: Sequence[int]) -> str:
        """Append ``ids`` and return the text they complete ('' while it ends in an incomplete character)."""
        self.ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end of the output, as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(before) or (text.endswith(REPLACEMENT_CHARACTER) and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before):]
