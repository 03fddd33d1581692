"""Each system runs in a process of its own: its imports, thread pools and memory are its own, so
one system's warm caches or allocations cannot help or hurt another, and its memory is measured
alone: the worker's peak RSS minus its RSS before the system loaded (the interpreter and the
``xpuspec`` package, which imports torch and transformers, are common to all and subtracted).

A worker is forked from a multiprocessing forkserver that has imported torch, openvino and transformers (and
run nothing), so that each of a run's workers does not pay those imports again: about 5 s a worker here, most of a
tiny model's load. The parent sends its environment, working folder and import path first (the forkserver
started with the parent's of that moment), then pickled ``(operation, arguments)`` messages over a pipe; the worker
answers ``("ok", value)`` or ``("error", traceback)``. The worker's own stdout and stderr go to a log file. As with any
forkserver, a script that starts workers (through :func:`xpuspec.bench.harness.run`) does so under
``if __name__ == "__main__":``.
"""

import importlib
import multiprocessing
import os
import sys
import traceback
from pathlib import Path

from ..errors import XpuspecError
from .systems import Setup, make

#: Seconds a worker may take to exit after ``close`` before it is killed.
CLOSE_TIMEOUT_S = 30
#: What the forkserver imports once, for every worker it forks: what each system's load would import anyway
#: (transformers' auto classes: reading any model config imports them). xpuspec itself is not preloaded: its
#: settings are read from the environment each worker is sent.
PRELOAD = ["torch", "openvino", "transformers", "transformers.models.auto.modeling_auto"]


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


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
        context = _context()
        self.conn, theirs = context.Pipe()
        self.proc = context.Process(target=_main, args=(theirs, str(self.log)), name=f"xpuspec-bench {name}",
                                    daemon=True)
        self.proc.start()
        theirs.close()
        self.conn.send((dict(os.environ), os.getcwd(), list(sys.path)))
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
            self.proc.join(timeout=CLOSE_TIMEOUT_S)
            code = self.proc.exitcode
            tail = self.log.read_text(errors="replace")[-3000:]
            raise WorkerError(f"{self.name}: worker process ended (exit code {code}). Log tail:\n{tail}") from None
        if status == "error":
            raise WorkerError(f"{self.name} failed:\n{value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close", ()))
            except OSError:
                pass
            self.proc.join(timeout=CLOSE_TIMEOUT_S)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _main(conn, log: str) -> None:
    """A forked worker: its output to ``log``, the parent's environment, working folder and import path (with
    ``$PYTHONPATH``'s folders first, as a new interpreter would have them), then :func:`serve`."""
    with open(log, "ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    environ, cwd, path = conn.recv()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    first = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = first + [p for p in path if p not in first]
    importlib.invalidate_caches()
    serve(conn)


def serve(conn) -> None:
    """The worker's loop: load the system named in the first message, then run calls until ``close``."""
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
