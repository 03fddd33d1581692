"""``xpuspec doctor``: the installed versions, the backend plugins and whether each loads,
the devices found, and the cache's location and size. Meant to be pasted into a bug report."""

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .cache import cache_root
from .devices import ENTRY_POINT_GROUP, all_devices, backends, unavailable_backends

#: Distributions whose versions decide what works (the IPEX wheel is optional).
PACKAGES = ("xpuspec", "torch", "transformers", "openvino", "openvino-tokenizers", "openvino-genai", "nncf",
            "optimum-intel", "intel-extension-for-pytorch")


def package_versions() -> Dict[str, Optional[str]]:
    """Installed version of each of :data:`PACKAGES`, ``None`` when it is not installed."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def plugin_status() -> List[Tuple[str, str, str]]:
    """Each plugin registered in the ``xpuspec.backends`` entry-point group:
    ``(name, "module:Class", "loads" or "unavailable: why")``."""
    loaded, unavailable = backends(), unavailable_backends()
    return [(ep.name, ep.value,
             "loads" if ep.name in loaded else f"unavailable: {unavailable.get(ep.name, 'unknown reason')}")
            for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)]


def device_lines() -> List[str]:
    """One line per (device, backend) pair, then one per backend that cannot run here."""
    lines = []
    for info in all_devices():
        props = ", ".join(f"{k}={v}" for k, v in info.properties.items())
        lines.append(f"{info.name:<10} {info.backend:<10} {props}")
    for name, reason in unavailable_backends().items():
        lines.append(f"{'-':<10} {name:<10} unavailable: {reason}")
    return lines


def folder_bytes(folder: Path) -> int:
    """Total size of the files under ``folder`` (symbolic links are not followed)."""
    return sum(os.lstat(os.path.join(root, f)).st_size for root, _, files in os.walk(folder) for f in files)


def report() -> str:
    """The doctor's report, as printed by ``xpuspec doctor``."""
    lines = [f"python {platform.python_version()} on {platform.system()} {platform.machine()} ({sys.executable})",
             "packages:"]
    lines += [f"  {name:<28} {v or 'not installed'}" for name, v in package_versions().items()]
    lines.append(f"backend plugins (entry-point group {ENTRY_POINT_GROUP}):")
    lines += [f"  {name:<10} {target:<34} {status}" for name, target, status in plugin_status()]
    lines.append("devices:")
    lines += [f"  {line}" for line in device_lines()]
    root = cache_root()
    source = "$XPUSPEC_CACHE" if os.environ.get("XPUSPEC_CACHE") else "default; set XPUSPEC_CACHE to move it"
    size = folder_bytes(root)
    lines.append(f"cache: {root} ({source}): {size} bytes ({size / 2**30:.2f} GiB)")
    return "\n".join(lines)
