"""Roofline of plain decoding: each new token reads every weight once, so memory bandwidth caps
the speed at ``bandwidth / weight bytes per token`` tokens/s.

Bandwidth is measured as the best of several timed sums over an array much larger than the
last-level cache, one thread per CPU core (numpy releases the GIL inside the reduction). On a
shared machine other processes lower it, so it can be given instead (``--bandwidth``).
"""

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

#: Bytes read per timed pass: well beyond a 32 MiB L3.
DEFAULT_ARRAY_BYTES = 512 * 2**20
DEFAULT_PASSES = 7


def read_bandwidth(array_bytes: int = DEFAULT_ARRAY_BYTES, passes: int = DEFAULT_PASSES,
                   threads: Optional[int] = None) -> float:
    """Measured read bandwidth in bytes/s: the fastest of ``passes`` timed float32 sums over
    ``array_bytes`` bytes, split across ``threads`` threads (default: one per CPU core)."""
    threads = threads or os.cpu_count() or 1
    data = np.ones(array_bytes // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))  # touch every page once before timing
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def roofline_tokens_per_s(bandwidth: float, weight_bytes: int) -> float:
    """Tokens/s plain decoding reaches when it only streams its weights: ``bandwidth / weight_bytes``
    (bytes/s divided by bytes read per token)."""
    if bandwidth <= 0 or weight_bytes <= 0:
        raise ValueError(f"bandwidth ({bandwidth}) and weight_bytes ({weight_bytes}) must be positive.")
    return bandwidth / weight_bytes


def percent_of_roofline(tokens_per_s: float, bandwidth: float, weight_bytes: int) -> float:
    """``tokens_per_s`` as a percentage of :func:`roofline_tokens_per_s`. Speculative decoding can
    exceed 100%: it gains several tokens per pass over the weights."""
    return 100.0 * tokens_per_s / roofline_tokens_per_s(bandwidth, weight_bytes)
