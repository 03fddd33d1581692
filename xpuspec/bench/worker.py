"""Each system runs in a process of its own: its imports, thread pools and memory are its own, so
one system's warm caches or allocations cannot help or hurt another, and its memory is measured
alone: the worker's peak RSS minus its RSS before the system loaded (the interpreter and the
``xpuspec`` package, which imports torch and transformers, are common to all and subtracted).

The parent starts ``python -m xpuspec.bench.worker FD`` with one end of a socket pair and sends
pickled ``(operation, arguments)`` messages; the worker answers ``("ok", value)`` or
``("error", traceback)``. The worker's own stdout and stderr go to a log file.
"""

import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from ..errors import XpuspecError
from .systems import Setup, make

#: Seconds a worker may take to exit after ``close`` before it is killed.
CLOSE_TIMEOUT_S = 30


class WorkerError(XpuspecError, RuntimeError):
    """A system failed inside its worker process; the message carries its traceback or log tail."""


class Worker:
    """A system loaded in its own process. Use as a context manager; ``call(op, *args)`` runs a
    :class:`xpuspec.bench.systems.System` method there and returns its result. The process starts
    loading at once; ``info`` (or the first call) waits for it, so several workers load side by side.

    Attributes:
        info: from loading: ``settings`` (what the system was configured with), ``weight_bytes``,
            and ``idle_rss_bytes`` (peak RSS of the worker before loading: Python and xpuspec's imports).
    """

    def __init__(self, name: str, setup: Setup, log: Path):
        self.name, self.log = name, Path(log)
        ours, theirs = socket.socketpair()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "xpuspec.bench.worker", str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((name, setup))
        self._info = None

    @property
    def info(self) -> dict:
        if self._info is None:
            try:
                self._info = self._reply()
            except BaseException:
                self.close()
                raise
        return self._info

    def call(self, op: str, *args):
        self.info  # loaded first
        self.conn.send((op, args))
        return self._reply()

    def _reply(self):
        try:
            status, value = self.conn.recv()
        except (EOFError, ConnectionError):
            code = self.proc.wait(timeout=CLOSE_TIMEOUT_S)
            tail = self.log.read_text(errors="replace")[-3000:]
            raise WorkerError(f"{self.name}: worker process ended (exit code {code}). Log tail:\n{tail}") from None
        if status == "error":
            raise WorkerError(f"{self.name} failed:\n{value}")
        return value

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.conn.send(("close", ()))
                self.proc.wait(timeout=CLOSE_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(fd: int) -> None:
    """The worker's loop: load the system named in the first message, then run calls until ``close``."""
    conn = Connection(fd)
    name, setup = conn.recv()
    try:
        system = make(name, setup)
        idle = system.peak_rss_bytes()
        settings = system.load()
        conn.send(("ok", {"settings": settings, "weight_bytes": system.weight_bytes, "idle_rss_bytes": idle}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        op, args = conn.recv()
        if op == "close":
            return
        try:
            conn.send(("ok", getattr(system, op)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


if __name__ == "__main__":
    serve(int(sys.argv[1]))
