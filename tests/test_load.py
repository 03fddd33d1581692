"""The bench's competing load (xpuspec.bench.load): busy processes start, take CPU, stop, and are recorded."""

import os
import time

import pytest

from xpuspec.bench.harness import BenchSettings
from xpuspec.bench.load import CompetingLoad


def _cpu_ticks(pid: int) -> int:
    """User + system clock ticks of ``pid``, read from /proc here (independently of xpuspec.bench.load)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads CPU time from Linux /proc")
@pytest.mark.timeout(300)
def test_competing_load_runs_busy_processes_and_stops_them():
    """Deterministic, not timed: each process is seen to take CPU time (the kernel's tick counter, read here) before
    the load stops, and the record's CPU seconds are at least what was seen then."""
    tick = os.sysconf("SC_CLK_TCK")
    load = CompetingLoad(2)
    with load:
        pids = load.running
        assert len(pids) == 2
        if hasattr(os, "sched_getaffinity"):  # each pins itself, first thing, to one of the cores we may use
            while [os.sched_getaffinity(pid) for pid in pids] != [{c} for c in load.cores]:
                assert load.running == pids  # the loops started; pytest's timeout is the hang guard
                time.sleep(0.01)
        pinned = [_cpu_ticks(pid) for pid in pids]
        seen = pinned
        while any(n < p + 5 for n, p in zip(seen, pinned)):  # each spins on after pinning (5 ticks more)
            assert load.running == pids  # a busy loop does not end by itself
            time.sleep(0.05)
            seen = [_cpu_ticks(pid) for pid in pids]
    assert load.running == []
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    record = load.record()
    assert record["processes"] == 2 and len(record["cores"]) == 2 and record["seconds"] > 0
    assert all(c is not None and c >= n / tick for c, n in zip(record["cpu_seconds"], seen)), (record, seen)


def test_no_load_and_bad_counts():
    with CompetingLoad(0) as load:
        assert load.running == []
    assert load.record()["processes"] == 0 and load.record()["cpu_seconds"] == []
    with pytest.raises(ValueError, match="--competing-load"):
        CompetingLoad(-1)
    with pytest.raises(ValueError, match="--competing-load"):
        BenchSettings(systems=["xpuspec"], competing_load=-2).check()
