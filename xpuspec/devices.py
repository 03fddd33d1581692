"""Device plugin layer: backend discovery through entry points, and device resolution.

A backend is any object registered in the ``xpuspec.backends`` entry-point group
that subclasses :class:`Backend`. The core never imports a backend by name.
"""

import difflib
import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .errors import BackendUnavailableError, DeviceNotFoundError

log = logging.getLogger("xpuspec")

ENTRY_POINT_GROUP = "xpuspec.backends"
DEVICE_ENV = "XPUSPEC_DEVICE"
#: ``auto`` takes the first of these kinds that some backend offers.
AUTO_PREFERENCE = ("gpu", "xpu", "cpu")


@dataclass
class DeviceInfo:
    """One device as a backend sees it.

    Attributes:
        name: xpuspec's lowercase spelling, e.g. ``"cpu"``, ``"gpu.1"``, ``"npu"``, ``"xpu:0"``.
        backend: the entry-point name of the backend that serves it.
        properties: what the backend reports (full name, type, precisions, ...).
    """

    name: str
    backend: str
    properties: Dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.name.split(".")[0].split(":")[0]


class Backend(ABC):
    """A backend plugin. Subclasses are registered in the ``xpuspec.backends`` entry-point group.

    ``priority`` orders backends that serve the same device (lower wins).
    """

    name: str = ""
    priority: int = 100
    #: True when :meth:`export_ir` is implemented.
    can_export: bool = False
    #: The weight format of a self-speculation draft (an INT4 copy of the model where the backend has INT4).
    self_draft_low_bit: str = "int4_sym"

    def unavailable_reason(self) -> Optional[str]:
        """``None`` when the backend can run here, else a sentence saying why not."""
        return None

    @abstractmethod
    def devices(self) -> List[DeviceInfo]:
        """Devices this backend can run models on, on this machine."""

    def matches(self, info: DeviceInfo, requested: str) -> bool:
        """True if the user spelling ``requested`` (lowercase) names ``info``."""
        return requested == info.name

    @abstractmethod
    def load(self, source, device: str, low_bit, **options):
        """Load ``source`` (a :class:`xpuspec.sources.ModelSource`) on ``device`` and return a Runner.

        ``low_bit`` is a :class:`xpuspec.lowbit.LowBitConfig` or ``None`` (keep the source's precision);
        ``options`` are backend-specific (``ov_config`` for OpenVINO, ``dtype`` for torch) and
        each backend ignores the others'.
        """

    def check(self, source, device: str, low_bit) -> None:
        """Raise, before any slow work, the error :meth:`load` would raise for ``source`` (a
        :class:`xpuspec.sources.ModelSource`) on ``device`` in ``low_bit`` (an architecture or format the backend
        cannot run). Default: nothing to check."""

    def identity(self, device: str) -> dict:
        """What identifies the kernels a model gets on ``device`` (this backend's spelling), for caches of what was
        measured there: the backend's name, the device's properties (:meth:`devices`) and, on a CPU, its
        instruction-set flags (:func:`cpu_flags`: CPUs of one name differ in AVX-512, VNNI and AMX). A backend adds
        its library's version."""
        found = {"backend": self.name, "device": device}
        for info in self.devices():
            if self.matches(info, device):
                found.update(info.properties)
                break
        if device.split(".")[0].split(":")[0] == "cpu":
            found["cpu_flags"] = cpu_flags()
        return found

    def can_cut_head(self, device: str) -> bool:
        """Whether :meth:`load` takes ``head_tokens`` (score only those token ids, the others' logits
        ``-inf``: a draft's LM head cut to frequent tokens, :mod:`xpuspec.speculative.vocab`) on ``device``."""
        return False

    def save_low_bit(self, runner, folder) -> None:
        """Write the runner's (compressed) weights to ``folder`` so :meth:`load` can read them back."""
        raise NotImplementedError(f"The {self.name} backend cannot save low-bit models.")

    def export_ir(self, source, folder, low_bit, device: str) -> None:
        """Write an OpenVINO IR folder (model, tokenizer, detokenizer, configs) into ``folder``."""
        raise NotImplementedError(f"The {self.name} backend cannot export OpenVINO IR.")


def cpu_flags() -> str:
    """The instruction-set flags of this machine's first CPU (``/proc/cpuinfo``), sorted and space-separated, or
    ``""`` where unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


_BACKENDS: Optional[Dict[str, Backend]] = None
_UNAVAILABLE: Dict[str, str] = {}


def _discover() -> Dict[str, Backend]:
    global _BACKENDS
    if _BACKENDS is None:
        _UNAVAILABLE.clear()
        found = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                backend = ep.load()()
                reason = backend.unavailable_reason()
            except Exception as exc:  # a broken plugin must not break the others
                reason = f"failed to load: {type(exc).__name__}: {exc}"
            if reason:
                _UNAVAILABLE[ep.name] = reason
                log.debug("backend %s unavailable: %s", ep.name, reason)
            else:
                backend.name = ep.name
                found[ep.name] = backend
        _BACKENDS = dict(sorted(found.items(), key=lambda kv: kv[1].priority))
    return _BACKENDS


def backends() -> Dict[str, Backend]:
    """Loaded, usable backends by entry-point name, highest priority first."""
    return dict(_discover())


def unavailable_backends() -> Dict[str, str]:
    """Installed backends that cannot run here, with the reason for each."""
    _discover()
    return dict(_UNAVAILABLE)


def get_backend(name: str) -> Backend:
    """The usable backend registered as ``name``.

    Raises:
        BackendUnavailableError: it is installed but cannot run here.
        DeviceNotFoundError: no backend of that name is installed.
    """
    found = _discover()
    if name in found:
        return found[name]
    if name in _UNAVAILABLE:
        raise BackendUnavailableError(f"Backend {name!r} cannot run here: {_UNAVAILABLE[name]}")
    raise DeviceNotFoundError(
        f"No backend named {name!r}. Installed and usable: {', '.join(found) or 'none'}."
    )


def _unusable_hint() -> str:
    """A sentence naming the installed backends that failed to load and why, or ``""`` when none did."""
    broken = unavailable_backends()
    if not broken:
        return ""
    return " Installed backends that cannot run here: " + "; ".join(f"{k}: {v}" for k, v in broken.items()) + "."


def all_devices() -> List[DeviceInfo]:
    """Every (device, backend) pair available on this machine, highest-priority backend first."""
    return [info for backend in _discover().values() for info in backend.devices()]


def requested_device(device=None) -> str:
    """The device spelling in force: ``device`` (a string or a ``torch.device``), else
    ``$XPUSPEC_DEVICE``, else ``"auto"``.

    Raises:
        DeviceNotFoundError: ``device`` is neither a string nor a ``torch.device``.
    """
    if device is not None and not isinstance(device, str):
        import torch

        if not isinstance(device, torch.device):
            raise DeviceNotFoundError(
                f"device must be a name such as 'cpu', 'gpu' or 'xpu:0', or a torch.device; got {device!r}.")
        device = str(device)
    return (device or os.environ.get(DEVICE_ENV) or "auto").strip().lower()


def _describe(devices: List[DeviceInfo]) -> str:
    return ", ".join(f"{d.name} ({d.backend})" for d in devices) or "none"


def resolve_device(device=None, backend: Optional[str] = None) -> Tuple[Backend, str]:
    """Pick the backend and device for one model.

    Args:
        device: ``"cpu"``, ``"gpu"``, ``"gpu.1"``, ``"npu"``, ``"xpu"``, ``"xpu:0"`` or ``"auto"``, or a
            ``torch.device`` (``torch.device("cpu")``, ``torch.device("xpu", 0)``); ``None`` reads ``$XPUSPEC_DEVICE``, and ``"auto"`` if that is unset.
        backend: restrict the choice to this backend's entry-point name (``"openvino"``, ``"torch"``).

    Returns:
        ``(backend, device_name)`` where ``device_name`` is the backend's own spelling in lowercase.

    Raises:
        DeviceNotFoundError: the spelling is unknown (with the closest valid one suggested),
            or the device is absent here (with the devices that exist listed).
        DeviceNotFoundError: a comma-separated list was given where one device is needed.
    """
    spec = requested_device(device)
    available = all_devices()
    if backend is not None:
        get_backend(backend)
        available = [d for d in available if d.backend == backend]
    if "," in spec:
        raise DeviceNotFoundError(
            f"Device list {spec!r} names pipeline stages, but this model runs on one device (a draft model "
            "always does). Give a single device here; device lists apply to the target's from_pretrained."
        )
    if spec == "auto":
        for kind in AUTO_PREFERENCE:
            for info in available:
                if info.kind == kind:
                    return _discover()[info.backend], info.name
        raise DeviceNotFoundError(f"No device available for 'auto'. Backends unavailable: {unavailable_backends()}")
    for info in available:
        if _discover()[info.backend].matches(info, spec):
            return _discover()[info.backend], info.name
    vocabulary = ["auto", "cpu", "gpu", "npu", "xpu"] + [d.name for d in all_devices()]
    base = spec.split(".")[0].split(":")[0]
    if base in ("cpu", "gpu", "npu", "xpu"):
        where = f" with backend {backend!r}" if backend else ""
        raise DeviceNotFoundError(
            f"Device {spec!r} is not available on this machine{where}. Available: {_describe(available)}. "
            f"Set {DEVICE_ENV} or device= to one of these.{_unusable_hint()}"
        )
    close = [c for c in difflib.get_close_matches(spec, vocabulary, n=2, cutoff=0.5) if c != spec][:1]
    hint = f" Did you mean {close[0]!r}?" if close else ""
    if spec.startswith("cpu"):
        hint += (" A second CPU device for multi-device runs on one CPU comes from the OpenVINO backend: set "
                 f"XPUSPEC_CPU_ALIASES={spec}.")
    raise DeviceNotFoundError(
        f"Unknown device {spec!r}.{hint} Valid spellings: cpu, gpu, gpu.N, npu, xpu, xpu:N, auto. "
        f"Available here: {_describe(available)}."
    )
