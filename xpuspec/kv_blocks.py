"""The KV blocks of one paged runner, and the prefix cache over them.

A runner with a paged KV cache (the OpenVINO paged runner) owns tensors of ``blocks`` blocks of ``block_size``
tokens. :class:`BlockPool` keeps the book of those blocks; the runner keeps the tensors. A block is, at any time:

* **free**: holds nothing;
* **held** by one or more sequences (a reference count), and then possibly also **cached**;
* **cached and idle**: a full block whose tokens every sequence has left, kept for a later prompt that starts with
  the same tokens and evicted least recently used first when blocks run short.

**Prefix caching** (vLLM's automatic prefix caching; openvino_genai's ``enable_prefix_caching``): a full block is
keyed by a hash of its own tokens chained to the hash of every block before it, so a key names the whole prefix up
to the block's end (causal attention makes a block's keys and values a function of exactly those tokens). A
sequence :meth:`publishes <BlockPool.publish>` its full blocks once their tokens are accepted (a prompt after its
prefill, the accepted output when the request ends): a speculative draft never becomes shareable. A new sequence
:meth:`matches <BlockPool.match>` the longest run of cached blocks its prompt starts with and holds them; a
sequence never writes into a cached block or one another sequence holds (:meth:`BlockPool.shared`): the runner
copies such a block first (copy on write), so a rollback and rewrite in one sequence cannot change another's
keys and values.

Nothing here touches tensors; :class:`BlockPool` calls the runner's ``grow(blocks)`` to make the tensors larger.
"""

import hashlib
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .errors import KVBudgetError


def block_hashes(tokens: Sequence[int], block_size: int) -> List[bytes]:
    """One key per full block of ``tokens``: a 16-byte BLAKE2b digest of the previous block's key and this block's
    token ids (int64). Equal keys mean equal token prefixes (up to a hash collision, ~2**-64 per pair)."""
    keys, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = np.asarray(tokens[start:start + block_size], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


class BlockPool:
    """The book of a runner's KV blocks: free ones, reference counts, and the prefix cache (module docstring).

    Args:
        block_size: tokens per block.
        grow: ``grow(blocks)`` makes the runner's tensors hold at least ``blocks`` blocks (it may make more) and
            returns the number it holds; called when no free or idle cached block is left.

    Attributes:
        prefix_caching: whether :meth:`match` and :meth:`publish` do anything (off: every block is private).
        queries, hits: prompt tokens looked up in the cache and tokens found there, since the pool was made
            (vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``).
        evicted: cached blocks evicted since the pool was made.
    """

    def __init__(self, block_size: int, grow: Callable[[int], int]):
        self.block_size = block_size
        self._grow = grow
        self.blocks = 0  # blocks the tensors hold
        self._free: List[int] = []
        self._refs: Dict[int, int] = {}  # held blocks: how many sequences hold each
        self._key_of: Dict[int, bytes] = {}  # cached blocks (held or idle): their keys
        self._block_of: Dict[bytes, int] = {}
        self._idle: "OrderedDict[int, None]" = OrderedDict()  # cached blocks no sequence holds, least recent first
        self.budget: Optional[int] = None  # at most this many blocks held
        self.prefix_caching = False
        self.queries = 0
        self.hits = 0
        self.evicted = 0

    # -- counts -------------------------------------------------------------------------------------------------
    @property
    def in_use(self) -> int:
        """Blocks held by sequences (an idle cached block is not in use: it is evicted when a block is needed)."""
        return len(self._refs)

    @property
    def cached(self) -> int:
        """Blocks in the prefix cache, held or idle."""
        return len(self._key_of)

    def add(self, blocks: int) -> None:
        """The tensors now hold ``blocks`` blocks; the new ones are free."""
        self._free = sorted(self._free + list(range(self.blocks, blocks)))
        self.blocks = blocks

    # -- taking and giving back ---------------------------------------------------------------------------------
    def take(self, n: int, message: Callable[[int], str]) -> List[int]:
        """Hold ``n`` new private blocks: free ones first, then idle cached ones (least recently used first, leaving
        the cache), then new ones (the tensors grow). Idle cached blocks are evicted too where held and cached
        blocks together would exceed the :attr:`budget`.

        Raises:
            KVBudgetError: more than :attr:`budget` blocks would be held (``message(blocks needed)`` says so);
                nothing is taken.
        """
        if n <= 0:
            return []
        if self.budget is not None and self.in_use + n > self.budget:
            raise KVBudgetError(message(self.in_use + n))
        while self._idle and (len(self._free) < n or (self.budget is not None and
                                                      self.in_use + len(self._idle) + n > self.budget)):
            block = self._idle.popitem(last=False)[0]  # evict: held and cached blocks stay within the budget
            del self._block_of[self._key_of.pop(block)]
            self._free.append(block)
            self.evicted += 1
        if len(self._free) < n:
            self.add(self._grow(self.blocks + n - len(self._free)))
        taken, self._free = self._free[:n], self._free[n:]
        for block in taken:
            self._refs[block] = 1
        return taken

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence lets go of ``blocks`` (in its order): a cached block no one holds becomes idle, any other block
        no one holds becomes free. The last block becomes idle first, so a sequence's tail is evicted before its
        head, which more prompts share (vLLM frees in the same order)."""
        for block in reversed(blocks):
            refs = self._refs.pop(block) - 1
            if refs:
                self._refs[block] = refs
            elif block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)
        self._free.sort()

    def shared(self, block: int) -> bool:
        """Whether a sequence must copy ``block`` before writing into it: it is cached, or held by another."""
        return block in self._key_of or self._refs.get(block, 0) > 1

    # -- the prefix cache ---------------------------------------------------------------------------------------
    def set_prefix_caching(self, on: bool) -> None:
        """Turn prefix caching on or off; off empties the cache (idle blocks become free)."""
        self.prefix_caching = bool(on)
        if not on:
            self._free = sorted(self._free + list(self._idle))
            self._idle.clear()
            self._key_of.clear()
            self._block_of.clear()

    def match(self, tokens: Sequence[int]) -> List[int]:
        """Hold the cached blocks of the longest run of full blocks that ``tokens`` starts with (none when prefix
        caching is off), and count ``len(tokens)`` queries and the matched tokens as hits."""
        if not self.prefix_caching:
            return []
        found = []
        for key in block_hashes(tokens, self.block_size):
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        for block in found:
            self._idle.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        self.queries += len(tokens)
        self.hits += len(found) * self.block_size
        return found

    def publish(self, blocks: Sequence[int], tokens: Sequence[int]) -> None:
        """Make the full blocks of a sequence shareable: ``blocks[i]`` holds the keys and values of
        ``tokens[i * block_size:(i + 1) * block_size]``, after every token before them (only accepted tokens: the
        caller cuts its drafts off). A block whose prefix is cached already in another block stays private."""
        if not self.prefix_caching:
            return
        for block, key in zip(blocks, block_hashes(tokens, self.block_size)):
            if key in self._block_of or block in self._key_of:
                continue
            self._key_of[block], self._block_of[key] = key, block
