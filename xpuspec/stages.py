"""Pipeline-parallel stage planning: which device each stage runs on, and how many layers it holds.

Triggers (ipex-llm's and our own spellings): ``pipeline_parallel_stages=N``, a device list
``device="gpu.0,gpu.1"``, or ``XPUSPEC_DEVICE=gpu.0,gpu.1``. The backend then splits the model's
decoder layers over the stages (balanced by weight bytes unless ``split=`` says otherwise).
"""

from typing import List, Optional, Sequence, Tuple

from .devices import Backend, requested_device, resolve_device
from .distributed import torchrun_world
from .errors import DeviceNotFoundError, PipelineConfigError

#: Device kinds that have numbered instances; ``pipeline_parallel_stages=N`` on ``gpu`` means gpu.0 .. gpu.N-1.
NUMBERED_KINDS = {"gpu": ".", "xpu": ":"}


def stage_device_names(device=None, stages: Optional[int] = None) -> List[str]:
    """The device spelling of each stage, before resolution.

    Args:
        device: a device, a comma-separated device list, a ``torch.device``, or ``None`` (``$XPUSPEC_DEVICE``).
        stages: ``pipeline_parallel_stages``; ``None`` takes the list's length.

    Raises:
        DeviceNotFoundError: an empty entry in the list.
        PipelineConfigError: ``stages`` < 1, or a list whose length differs from ``stages``.
    """
    spec = requested_device(device)
    names = [name.strip() for name in spec.split(",")]
    if not all(names):
        raise DeviceNotFoundError(f"Device list {spec!r} has an empty entry; write it like 'gpu.0,gpu.1'.")
    if stages is None:
        return names
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise PipelineConfigError(f"pipeline_parallel_stages must be an integer >= 1, got {stages!r}.")
    if len(names) > 1:
        if len(names) != stages:
            raise PipelineConfigError(
                f"pipeline_parallel_stages={stages} but the device list {spec!r} names {len(names)} devices; "
                "give one device per stage, or drop one of the two.")
        return names
    sep = NUMBERED_KINDS.get(names[0])
    return [f"{names[0]}{sep}{i}" for i in range(stages)] if sep and stages > 1 else names * stages


def resolve_stage_devices(device=None, stages: Optional[int] = None,
                          backend: Optional[str] = None) -> Tuple[Backend, List[str]]:
    """Resolve every stage's device; all must be served by one backend.

    Returns:
        ``(backend, device_names)`` with one resolved name per stage (a single name: no split).

    Raises:
        DeviceNotFoundError: an unknown or absent device (naming it), or stages on different backends.
    """
    resolved = [resolve_device(name, backend) for name in stage_device_names(device, stages)]
    backends = {b.name for b, _ in resolved}
    if len(backends) > 1:
        where = ", ".join(f"{d} ({b.name})" for b, d in resolved)
        raise DeviceNotFoundError(f"Pipeline stages must run on one backend, but they resolve to {where}. "
                                  "Pass backend='openvino' or pick devices of one backend.")
    return resolved[0][0], [d for _, d in resolved]


def check_split(split: Optional[Sequence[int]], stages: int, num_layers: int) -> Optional[List[int]]:
    """Validate the pipeline plan against the model before any slow work.

    Args:
        split: layers per stage, or ``None`` (balanced by the backend).
        stages: number of stages.
        num_layers: the model's decoder layers (``config.num_hidden_layers``).

    Returns:
        ``split`` as a list, or ``None``.

    Raises:
        PipelineConfigError: more stages than layers; a split with another number of entries, an entry < 1,
            or a sum other than ``num_layers``.
    """
    if stages > num_layers:
        raise PipelineConfigError(f"{stages} pipeline stages for a model of {num_layers} layers: every stage needs at least "
                         f"one layer. Use at most {num_layers} stages.")
    if split is None:
        return None
    if isinstance(split, (str, bytes)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in split):
        raise PipelineConfigError(f"split must be a list of integer layer counts such as [15, 15], got {split!r}.")
    split = list(split)
    if stages == 1 or len(split) != stages:
        raise PipelineConfigError(f"split={split} gives {len(split)} stages for a pipeline of {stages}: give one layer "
                                  "count per stage, with pipeline_parallel_stages or a device list of the same length.")
    if any(not isinstance(n, int) or n < 1 for n in split) or sum(split) != num_layers:
        raise PipelineConfigError(f"split={split} must give every stage at least 1 layer and sum to the model's "
                         f"{num_layers} layers.")
    return split


def balanced_split(layer_bytes: Sequence[int], embed_bytes: int, head_bytes: int, stages: int) -> List[int]:
    """Layer counts per stage (contiguous, each >= 1) that minimise the largest stage's weight bytes.

    Args:
        layer_bytes: weight bytes of each decoder layer, in order.
        embed_bytes: bytes the first stage holds besides its layers (the embedding).
        head_bytes: bytes the last stage holds besides its layers (final norm and LM head).
        stages: number of stages, 1 <= stages <= len(layer_bytes).
    """
    n = len(layer_bytes)
    prefix = [0]
    for size in layer_bytes:
        prefix.append(prefix[-1] + size)
    best = {(0, 0): (0, 0)}  # (stages used, layers placed) -> (largest stage bytes, start of the last stage)
    for s in range(1, stages + 1):
        extra = (embed_bytes if s == 1 else 0) + (head_bytes if s == stages else 0)
        for i in range(s, n - (stages - s) + 1):
            best[s, i] = min((max(best[s - 1, a][0], prefix[i] - prefix[a] + extra), a)
                             for a in range(s - 1, i) if (s - 1, a) in best)
    counts, end = [], n
    for s in range(stages, 0, -1):
        start = best[s, end][1]
        counts.append(end - start)
        end = start
    return counts[::-1]


def torchrun_pipeline(backend: Optional[str], stages: Optional[int], spec) -> bool:
    """True when this process is one stage of a torchrun pipeline (torch backend, one stage per rank):
    started by torchrun with ``pipeline_parallel_stages`` >= 2.

    Raises:
        PipelineConfigError: another backend forced, or a speculative mode that loads a draft model
            (only prompt lookup runs in lockstep on every rank).
    """
    if torchrun_world() is None or not isinstance(stages, int) or stages < 2:
        return False
    if backend not in (None, "torch"):
        raise PipelineConfigError(f"A torchrun pipeline runs on the torch backend, not {backend!r}; drop backend=.")
    if spec is not None and spec.uses_model:
        raise PipelineConfigError(f"speculative={spec.mode!r} would load a draft model on every rank; a torchrun "
                                  "pipeline supports speculative='prompt_lookup' only for now.")
    return True
