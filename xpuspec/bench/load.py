"""The machine's CPU load: :func:`load_average`, recorded beside every figure, and a competing load for
``xpuspec bench --competing-load N``: N busy-loop processes the bench starts for the measured part of its run and
stops after.

Each process spins in a pure-Python loop (no I/O, no memory traffic to speak of), pinned to one core where the
platform allows it (core ``i`` modulo the cores this process may use), the way another job on a shared machine
takes a core away. :meth:`CompetingLoad.record` says what ran: processes, cores, seconds, and the CPU seconds the
processes actually got, so a run can show the load was there.
"""

import os
import subprocess
import sys
import time
from typing import List, Optional


def load_average() -> Optional[List[float]]:
    """The 1, 5 and 15-minute load averages (``os.getloadavg``), rounded to 0.01; ``None`` where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


#: The busy loop each process runs (pins itself first where ``sched_setaffinity`` exists).
_SPIN = ("import os, sys\n"
         "core = int(sys.argv[1])\n"
         "if core >= 0 and hasattr(os, 'sched_setaffinity'):\n"
         "    os.sched_setaffinity(0, {core})\n"
         "while True:\n"
         "    pass\n")


def _cores() -> List[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of a live process (Linux ``/proc``), else ``None``."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class CompetingLoad:
    """``with CompetingLoad(n):`` runs ``n`` busy loops inside the block (0: none).

    Raises:
        ValueError: ``n`` below 0.
    """

    def __init__(self, processes: int):
        if not isinstance(processes, int) or processes < 0:
            raise ValueError(f"--competing-load takes a number of busy processes >= 0, not {processes!r}.")
        self.processes = processes
        usable = _cores()
        self.cores = [usable[i % len(usable)] for i in range(processes)]
        self._procs: List[subprocess.Popen] = []
        self._started: Optional[float] = None
        self.seconds = 0.0
        self.cpu_seconds: List[Optional[float]] = []

    def __enter__(self) -> "CompetingLoad":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for core in self.cores:
            self._procs.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(core)], stdin=subprocess.DEVNULL,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._started = time.monotonic()

    @property
    def running(self) -> List[int]:
        """Pids of the busy processes still running."""
        return [p.pid for p in self._procs if p.poll() is None]

    def stop(self) -> None:
        """End the busy processes (each by its own pid) and note what they ran."""
        if self._started is None:
            return
        self.seconds = time.monotonic() - self._started
        self.cpu_seconds = [_cpu_seconds(p.pid) for p in self._procs]
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs, self._started = [], None

    def record(self) -> dict:
        """What ran: ``processes``, ``cores`` (one per process), wall ``seconds`` and each process's ``cpu_seconds``
        (``None`` where unknown)."""
        return {"processes": self.processes, "cores": self.cores, "seconds": round(self.seconds, 3),
                "cpu_seconds": [None if c is None else round(c, 3) for c in self.cpu_seconds],
                "method": "pure-Python busy loop per process, pinned to one core"}
