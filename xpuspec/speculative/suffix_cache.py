"""The global suffix cache of SuffixDecoding: the outputs of earlier requests, for one target model.

SuffixDecoding (Oliaro et al., arXiv 2411.04975) keeps a global suffix tree over the outputs of
earlier requests beside each request's own tree. :class:`SuffixCache` is that global structure for
one loaded model: a :class:`~xpuspec.speculative.suffix.SuffixAutomaton` over the cached outputs,
held to ``max_tokens`` tokens (each output and its end marker) by evicting the least recently
used outputs (added, or drafted from and accepted). An automaton cannot forget text, so eviction
rebuilds it from the outputs kept, down to :data:`LOW_WATER` of the bound: a rebuild costs time
linear in the tokens kept and comes at most once per ``(1 - LOW_WATER) * max_tokens`` tokens added.

With ``cache_dir`` the outputs are saved after every :meth:`SuffixCache.add` (written to a
temporary file, then renamed over the old one) and read back on construction. The file holds a
magic string, :data:`FORMAT_VERSION`, the model key, the outputs in least-recently-used order and
a sha256 of all that; it never holds more than ``max_tokens`` tokens. A file that is truncated,
corrupt, of another version, for another model or larger than the bound gives one
:class:`SuffixCacheWarning` and an empty cache, which the next save writes over it.

All methods may be called from several threads.
"""

import bisect
import hashlib
import os
import re
import struct
import sys
import tempfile
import threading
import warnings
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import List, Sequence, Tuple, Union

from ..errors import SpeculativeConfigError
from .suffix import DEFAULT_MAX_DEPTH, Candidate, SpeculationLimits, SuffixAutomaton

#: Tokens a cache holds by default (outputs plus one end marker each): a few hundred answers.
DEFAULT_MAX_TOKENS = 1 << 17
#: Share of ``max_tokens`` an eviction leaves, so that rebuilds stay rare.
LOW_WATER = 0.75
FORMAT_VERSION = 1
MAGIC = b"XPSUFFIX"
_HEADER = struct.Struct("<8sII")  # magic, version, key bytes
_COUNTS = struct.Struct("<IQ")  # outputs, tokens
_DIGEST = hashlib.sha256().digest_size


class SuffixCacheWarning(UserWarning):
    """A saved suffix cache could not be used and is rebuilt from nothing."""


class SuffixCache:
    """The outputs of earlier requests of one target model, for drafting (see the module docstring).

    Args:
        key: identifies the target model (its path or hub id, and revision); a saved cache for another key is
            not read.
        max_tokens: the most tokens held, end markers included (>= 2).
        max_depth: the deepest string counted (:class:`~xpuspec.speculative.suffix.SuffixAutomaton`).
        cache_dir: where the cache is saved and restored (``None``: in memory only).

    Raises:
        SpeculativeConfigError: an empty key, or a bound below 2.
    """

    def __init__(self, key: str, max_tokens: int = DEFAULT_MAX_TOKENS, max_depth: int = DEFAULT_MAX_DEPTH,
                 cache_dir: Union[str, os.PathLike, None] = None):
        if not isinstance(key, str) or not key:
            raise SpeculativeConfigError(f"SuffixCache needs the target model's key (a non-empty str), got {key!r}.")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
            raise SpeculativeConfigError(f"max_tokens must be an int >= 2, got {max_tokens!r}.")
        self.key, self.max_tokens, self.max_depth = key, max_tokens, max_depth
        self.path = Path(cache_dir) / _file_name(key) if cache_dir is not None else None
        self._lock = threading.Lock()
        self._outputs: "OrderedDict[int, Tuple[int, ...]]" = OrderedDict()  # least recently used first
        self._next_id = 0
        self._live = 0  # tokens of the outputs kept, end markers included
        self._automaton = SuffixAutomaton(max_depth)
        self._starts: List[int] = []  # where each output begins in the automaton's text
        self._ids: List[int] = []
        if self.path is not None and self.path.exists():
            self._load()

    def __len__(self) -> int:
        """Tokens in the structure, end markers included (at most ``max_tokens``)."""
        return len(self._automaton)

    @property
    def outputs(self) -> int:
        """Outputs held."""
        return len(self._outputs)

    @property
    def states(self) -> int:
        """States of the structure (at most ``2 * len(self) + 1``): its memory is linear in them."""
        return self._automaton.states

    def add(self, tokens: Sequence[int]) -> None:
        """Cache one request's output (its last ``LOW_WATER * max_tokens - 1`` tokens when longer); saves when
        there is a ``cache_dir``.

        Raises:
            ValueError: a negative token id (nothing is added).
        """
        tokens = tuple(int(t) for t in tokens)[-max(1, int(self.max_tokens * LOW_WATER) - 1):]
        if not tokens:
            return
        if min(tokens) < 0:
            raise ValueError(f"token ids must be >= 0, got {min(tokens)}.")
        with self._lock:
            if len(self._automaton) + len(tokens) + 1 > self.max_tokens:
                while self._outputs and self._live + len(tokens) + 1 > self.max_tokens * LOW_WATER:
                    self._live -= len(self._outputs.popitem(last=False)[1]) + 1
                self._rebuild()
            self._insert(self._next_id, tokens)
            self._outputs[self._next_id] = tokens
            self._next_id += 1
            self._live += len(tokens) + 1
            if self.path is not None:
                self._save()

    def speculate(self, pattern: Sequence[int], k: int, limits: SpeculationLimits) -> Candidate:
        """The best draft after ``pattern`` from the cached outputs (:meth:`SuffixAutomaton.speculate`)."""
        with self._lock:
            return self._automaton.speculate(pattern, k, limits)

    def touch(self, position: int) -> None:
        """Mark the output holding text position ``position`` (a :attr:`Candidate.end`) as just used (after an
        eviction in between, the output now at that position)."""
        with self._lock:
            i = bisect.bisect_right(self._starts, position) - 1
            if i >= 0 and self._ids[i] in self._outputs:
                self._outputs.move_to_end(self._ids[i])

    def clear(self) -> None:
        """Forget every output (and save the empty cache when there is a ``cache_dir``)."""
        with self._lock:
            self._outputs.clear()
            self._live = 0
            self._rebuild()
            if self.path is not None:
                self._save()

    def _insert(self, output_id: int, tokens: Tuple[int, ...]) -> None:
        self._starts.append(len(self._automaton))
        self._ids.append(output_id)
        self._automaton.extend(tokens)
        self._automaton.separate()

    def _rebuild(self) -> None:
        self._automaton = SuffixAutomaton(self.max_depth)
        self._starts, self._ids = [], []
        for output_id, tokens in self._outputs.items():
            self._insert(output_id, tokens)

    def _save(self) -> None:
        key = self.key.encode()
        lengths = array("I", (len(t) for t in self._outputs.values()))
        tokens = array("i", (token for t in self._outputs.values() for token in t))
        _little_endian(lengths, tokens)
        body = b"".join((_HEADER.pack(MAGIC, FORMAT_VERSION, len(key)), key,
                         _COUNTS.pack(len(lengths), len(tokens)), lengths.tobytes(), tokens.tobytes()))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body + hashlib.sha256(body).digest())
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise

    def _load(self) -> None:
        try:
            outputs = _read(self.path, self.key, self.max_tokens)
        except (OSError, ValueError) as exc:
            warnings.warn(f"Suffix cache {self.path} is not usable ({exc}); starting from an empty cache, "
                          "which replaces it at the next save.", SuffixCacheWarning, stacklevel=3)
            return
        for tokens in outputs:
            self._outputs[self._next_id] = tokens
            self._insert(self._next_id, tokens)
            self._next_id += 1
            self._live += len(tokens) + 1


def _little_endian(*arrays: array) -> None:
    """Swap ``arrays`` between the machine's byte order and the file's (little-endian, 4-byte items)."""
    if sys.byteorder == "big":
        for a in arrays:
            a.byteswap()


def _file_name(key: str) -> str:
    """A file name for ``key``: its readable part and a hash of the whole."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", key)[-48:].strip("._") or "model"
    return f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.xpsuffix"


def _read(path: Path, key: str, max_tokens: int) -> List[Tuple[int, ...]]:
    """The outputs saved in ``path``, oldest first.

    Raises:
        ValueError: the file is truncated, corrupt, of another version or model, or holds more than ``max_tokens``.
        OSError: it cannot be read.
    """
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise ValueError("truncated header")
        magic, version, key_len = _HEADER.unpack(head)
        if magic != MAGIC:
            raise ValueError("not a suffix cache file")
        if version != FORMAT_VERSION:
            raise ValueError(f"format version {version}, this xpuspec reads {FORMAT_VERSION}")
        if key_len > 4096:
            raise ValueError("corrupt header")
        saved_key, counts = f.read(key_len), f.read(_COUNTS.size)
        if len(counts) < _COUNTS.size:
            raise ValueError("truncated header")
        if saved_key != key.encode():
            raise ValueError(f"saved for model {saved_key.decode(errors='replace')!r}, not {key!r}")
        n_outputs, n_tokens = _COUNTS.unpack(counts)
        if n_tokens + n_outputs > max_tokens:
            raise ValueError(f"holds {n_tokens + n_outputs} tokens, more than max_tokens={max_tokens}")
        rest = f.read(4 * (n_outputs + n_tokens) + _DIGEST + 1)
    if len(rest) != 4 * (n_outputs + n_tokens) + _DIGEST:
        raise ValueError("truncated" if len(rest) < 4 * (n_outputs + n_tokens) + _DIGEST else "trailing bytes")
    body, digest = head + saved_key + counts + rest[:-_DIGEST], rest[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch")
    lengths, tokens = array("I"), array("i")
    lengths.frombytes(rest[:4 * n_outputs])
    tokens.frombytes(rest[4 * n_outputs:-_DIGEST])
    _little_endian(lengths, tokens)
    if sum(lengths) != n_tokens or min(tokens, default=0) < 0:
        raise ValueError("inconsistent contents")
    outputs, start = [], 0
    for n in lengths:
        outputs.append(tuple(tokens[start:start + n]))
        start += n
    return outputs
