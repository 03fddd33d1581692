"""A draft model's runner that can give its memory back while the speculation policy leaves the draft out.

:class:`ReleasableRunner` wraps the runner of a draft model that ``from_pretrained`` loaded. :meth:`release` drops
the wrapped runner (its compiled models, infer requests and KV cache: the draft's weights in memory); the next call
that computes (``forward``, ``expect_mixed_widths``, ...) loads it again with the loader given, which reads the
compressed IR from the cache and compiles it (seconds, no compression). The wrapper's own identity, and what does
not change between loads (device, vocabulary, weight bytes, traits), stay, so the policy's cross-request memory,
keyed by this runner (:class:`xpuspec.speculative.policy.PolicyBook`), survives a release.

A released draft is loaded again for a probe only once the wall time since its release is at least
``1 / RELOAD_TIME_SHARE`` times what a load takes (:meth:`ReleasableRunner.probe_affordable`): reloads then cost at
most that share of the time, however often the policy would probe (in a batch, every row is a request).
"""

import gc
import logging
import time
from typing import Callable, List, Optional, Sequence

import torch

from ..runner import Runner

log = logging.getLogger("xpuspec")

#: What a release keeps: attributes that are the same for every load of one draft.
_KEPT = ("device", "vocab_size", "weight_bytes", "num_layers", "max_length", "max_prompt_len", "traits", "head_tokens")
#: ... and those a backend's runner may have (the IR folder, the KV cache's block size), kept where it has them.
_KEPT_IF_THERE = ("folder", "block_size")
#: The most of the wall time that reloading a released draft may take.
RELOAD_TIME_SHARE = 0.05


class ReleasableRunner(Runner):
    """``runner``, loaded again by ``load()`` (a fresh runner of the same model) after :meth:`release`.

    Args:
        load_s: seconds the first load took, the reload's cost until a reload is timed.

    Attributes:
        releases, reloads: how often the wrapped runner was released and loaded again.
    """

    def __init__(self, runner: Runner, load: Callable[[], Runner], name: str = "draft model", load_s: float = 0.0):
        self._inner: Optional[Runner] = runner
        self._load, self._name = load, name
        for key in _KEPT + tuple(k for k in _KEPT_IF_THERE if hasattr(runner, k)):
            setattr(self, key, getattr(runner, key))
        self.releases = self.reloads = 0
        self._load_s = 0.0  # seconds of the last reload not yet reported by expect_mixed_widths
        self._load_cost_s = load_s  # what a load takes (the last one timed)
        self._released_at = 0.0  # time.monotonic() of the last release

    @property
    def resident(self) -> bool:
        """Whether the wrapped runner is in memory."""
        return self._inner is not None

    def release(self) -> int:
        """Drop the wrapped runner; returns its weight bytes (0 if it was released already)."""
        if self._inner is None:
            return 0
        self._inner = None
        gc.collect()
        _trim_heap()
        self.releases += 1
        self._released_at = time.monotonic()
        return self.weight_bytes

    def probe_affordable(self) -> bool:
        """Whether a request may draft with the model now: it is loaded, or it was released long enough ago that
        loading it again takes at most :data:`RELOAD_TIME_SHARE` of the time since."""
        if self._inner is not None:
            return True
        return (time.monotonic() - self._released_at) * RELOAD_TIME_SHARE >= self._load_cost_s

    @property
    def runner(self) -> Runner:
        """The wrapped runner, loaded again if it was released."""
        if self._inner is None:
            start = time.perf_counter()
            self._inner = self._load()
            self._load_s = self._load_cost_s = time.perf_counter() - start
            self.reloads += 1
            log.info("%s loaded again (%.1f s): the speculation policy drafts with it again", self._name, self._load_s)
        return self._inner

    def __getattr__(self, name: str):  # a backend's own attributes (``folder``, ``compiled_copies``, ...)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.runner, name)

    @property
    def length(self) -> int:
        return self._inner.length if self._inner is not None else 0

    @property
    def device_map(self) -> List[dict]:
        return self.runner.device_map

    def forward(self, tokens: Sequence[int], logits_to_keep: Optional[int] = None, exact: bool = True) -> torch.Tensor:
        return self.runner.forward(tokens, logits_to_keep, exact)

    def native_greedy(self, *args, **kwargs):
        return self.runner.native_greedy(*args, **kwargs)

    def expect_mixed_widths(self) -> float:
        """As the wrapped runner's, plus the seconds a reload took just before (setup of this request)."""
        spent = self.runner.expect_mixed_widths() + self._load_s
        self._load_s = 0.0
        return spent

    def rollback(self, n: int) -> None:
        self.runner.rollback(n)

    def reset(self) -> None:
        if self._inner is not None:
            self._inner.reset()


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere). Without it a
    released model's memory, freed in one thread's arena, stays resident in a threaded server, and each reload adds
    to it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> Optional[int]:
    """This process's resident memory in bytes (``VmRSS`` of ``/proc/self/status``), or ``None`` where unreadable."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
