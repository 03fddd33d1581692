"""The machine's memory during a bench run.

``--interleave prompt`` keeps every system's worker loaded at once. Where their memory nears the machine's, Linux
(without swap) evicts the pages of the workers' code and mapped weights and reads them back on every pass: a pass
then takes seconds instead of milliseconds, and its timing measures the disk, not the system. So the harness loads
the workers one after another and checks what is left after each, and it records what was available when each timed
call began; :func:`xpuspec.bench.report.markdown` names the calls that began short of memory.
"""

from typing import Optional, Sequence, Tuple

from ..errors import XpuspecError

#: The share of the machine's memory that must stay available; below it a run is said to be short of memory.
LOW_MEMORY_SHARE = 0.05


class BenchMemoryError(XpuspecError, MemoryError):
    """The workers loaded side by side leave the machine short of memory."""


def memory_mib() -> Optional[Tuple[float, float]]:
    """``(available, total)`` MiB of the machine's memory (Linux ``/proc/meminfo``: ``MemAvailable``,
    ``MemTotal``), or ``None`` where it cannot be read."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) / 1024  # kB
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def is_short(available_mib: Optional[float], total_mib: Optional[float]) -> bool:
    """Whether ``available_mib`` of ``total_mib`` is below :data:`LOW_MEMORY_SHARE` (``False`` where unknown)."""
    return available_mib is not None and bool(total_mib) and available_mib < LOW_MEMORY_SHARE * total_mib


def check_loaded(loaded: Sequence[str], memory: Optional[Tuple[float, float]]) -> None:
    """Refuse to go on with the systems ``loaded`` side by side when ``memory`` (:func:`memory_mib`) is short.

    Raises:
        BenchMemoryError: naming the systems, the memory left, and what to run instead.
    """
    if memory is None or not is_short(*memory):
        return
    available, total = memory
    raise BenchMemoryError(
        f"With {len(loaded)} systems loaded side by side ({', '.join(loaded)}), {available:.0f} MiB of the machine's "
        f"{total:.0f} MiB is available, under {100 * LOW_MEMORY_SHARE:.0f}%: the machine would page the workers' "
        "code in and out, and the timings would measure the disk. Pass --interleave repeat (one system loaded at a "
        "time), or fewer --systems.")
