"""Processes started by ``torchrun``: which one this is, and the process group of a layer-split pipeline.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in every
process it starts, and :func:`init` reads them (``init_method="env://"``). Every collective and
point-to-point operation times out after ``$XPUSPEC_DIST_TIMEOUT`` seconds (default 60), and
:func:`lost_rank` turns the error a surviving rank then gets into a :class:`PipelineError` that
names the rank it was waiting for, so a crashed rank ends the others instead of hanging them.
torchrun itself stops the surviving ranks with SIGTERM as soon as one rank fails, often before
they notice; :func:`init` makes SIGTERM raise a :class:`PipelineError` that says so (unless the
script has its own SIGTERM handler).

torch is imported inside the functions, so the CLI can ask :func:`torchrun_world` cheaply.
"""

import contextlib
import os
import signal
import threading
from datetime import timedelta
from typing import Iterator, NamedTuple, Optional

from .errors import PipelineConfigError, PipelineError

TIMEOUT_ENV = "XPUSPEC_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0


class World(NamedTuple):
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_world() -> Optional[World]:
    """``World(rank, world_size, local_rank)`` when started by torchrun with ``WORLD_SIZE`` > 1, else ``None``."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1 or "RANK" not in os.environ:  # torchrun sets both
        return None
    rank = int(os.environ["RANK"])
    return World(rank, size, int(os.environ.get("LOCAL_RANK", rank)))


def timeout_s() -> float:
    """Seconds a collective may wait: ``$XPUSPEC_DIST_TIMEOUT``, else 60.

    Raises:
        PipelineConfigError: the variable is not a number of seconds > 0.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise PipelineConfigError(f"${TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}.")
    return value


def init(device: str) -> World:
    """Join this torchrun job's default process group, once: gloo for ``cpu``, xccl for ``xpu:N``.

    Args:
        device: this rank's device in xpuspec's spelling (``"cpu"``, ``"xpu:1"``); on XPU it becomes
            the current device, as xccl requires.

    Returns:
        this process's :class:`World`.

    Raises:
        PipelineConfigError: not started by torchrun with more than one process.
        PipelineError: the other ranks did not join within the timeout.
    """
    import torch
    import torch.distributed as dist

    world = torchrun_world()
    if world is None:
        raise PipelineConfigError("A pipeline over processes needs torchrun: run `torchrun --nproc-per-node N ...` "
                            "with N the number of stages.")
    if not dist.is_initialized():
        backend = "xccl" if device.startswith("xpu") else "gloo"
        if backend == "xccl":
            torch.xpu.set_device(torch.device(device))
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s()))
        except RuntimeError as exc:  # DistStoreError, DistNetworkError
            raise PipelineError(
                f"rank {world.rank} could not join the {backend} process group of {world.world_size} ranks within "
                f"{timeout_s():g} s: {exc}. Start all ranks together with `torchrun --nproc-per-node "
                f"{world.world_size}` and a free --master-port.") from exc
        _raise_on_sigterm(world)
    return world


def _raise_on_sigterm(world: World) -> None:
    """Turn SIGTERM into a :class:`PipelineError` that says why torchrun sent it (main thread, default handler only)."""
    def stopped(signum, frame):
        raise PipelineError(
            f"rank {world.rank} was stopped by SIGTERM: torchrun stops every rank when one of them fails (or on "
            "Ctrl-C); the failed rank's own error and torchrun's 'Root Cause' report name it. Fix that error and rerun "
            f"all ranks with `torchrun --nproc-per-node {world.world_size} ...`.")

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, stopped)


@contextlib.contextmanager
def lost_rank(rank: int, peer: int, what: str) -> Iterator[None]:
    """Re-raise a failed torch.distributed operation as a :class:`PipelineError` naming the lost ``peer``.

    Args:
        rank: this rank.
        peer: the rank this one waits for in the operation.
        what: the operation, for the message (``"receiving hidden states"``).
    """
    try:
        yield
    except RuntimeError as exc:  # DistBackendError, DistNetworkError: a closed connection or a timeout
        world = torchrun_world()
        raise PipelineError(
            f"rank {rank} lost rank {peer} while {what}: rank {peer} (or one before it in the pipeline) crashed, "
            f"was killed, stalled longer than ${TIMEOUT_ENV}={timeout_s():g} s, or finished generating earlier "
            f"(sampling needs the same seed on every rank). See rank {peer}'s own error, fix it, and rerun all "
            f"ranks with `torchrun --nproc-per-node {world.world_size if world else 'N'} ...`; if it is only slow, "
            f"raise ${TIMEOUT_ENV}. ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})"
        ) from exc


def same_seed() -> int:
    """Seed torch's generator on every rank with one seed drawn on rank 0, and return it.

    Sampling in a pipeline must draw the same numbers on every rank, or the ranks' decode loops diverge.
    """
    import torch
    import torch.distributed as dist

    seed = [torch.seed() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(seed, src=0)
    torch.manual_seed(seed[0])
    return seed[0]
