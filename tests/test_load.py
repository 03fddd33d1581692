"""The bench's competing load (xpuspec.bench.load): busy processes start, take CPU, stop, and are recorded."""

import os
import time

import pytest

from xpuspec.bench.harness import BenchSettings
from xpuspec.bench.load import CompetingLoad


def test_competing_load_runs_busy_processes_and_stops_them():
    load = CompetingLoad(2)
    with load:
        pids = load.running
        assert len(pids) == 2
        time.sleep(1.0)
        if hasattr(os, "sched_getaffinity"):  # each pinned to one of the cores this process may use
            assert [os.sched_getaffinity(pid) for pid in pids] == [{c} for c in load.cores]
    assert load.running == []
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    record = load.record()
    assert record["processes"] == 2 and len(record["cores"]) == 2 and record["seconds"] >= 1.0
    assert all(c is not None and c > 0.2 for c in record["cpu_seconds"]), record  # they did spin


def test_no_load_and_bad_counts():
    with CompetingLoad(0) as load:
        assert load.running == []
    assert load.record()["processes"] == 0 and load.record()["cpu_seconds"] == []
    with pytest.raises(ValueError, match="--competing-load"):
        CompetingLoad(-1)
    with pytest.raises(ValueError, match="--competing-load"):
        BenchSettings(systems=["xpuspec"], competing_load=-2).check()
