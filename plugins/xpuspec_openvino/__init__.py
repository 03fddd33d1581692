"""xpuspec backend on the OpenVINO runtime: CPU, GPU, GPU.N and NPU.

Registered as the ``openvino`` entry point in the ``xpuspec.backends`` group.
"""

import logging
import shutil
from pathlib import Path
from typing import List, Optional

from xpuspec.cache import cache_root
from xpuspec.devices import Backend, DeviceInfo

log = logging.getLogger("xpuspec")

#: NPU runs an LLM through OpenVINO's NPUW LLM pipeline with static prompt and response windows.
NPU_MAX_PROMPT_LEN = 1024
NPU_MIN_RESPONSE_LEN = 128


def compile_config(device: str, user_config: Optional[dict] = None) -> dict:
    """OpenVINO compile properties for ``device``, overridden by ``user_config`` (optimum-intel's ``ov_config``).

    CPU uses an f32 KV cache: with the default u8 cache a k-token verify pass differs from
    single-token decoding at near-ties (measured, ../shared/OPENVINO-NOTES.md), at no
    measurable speed cost for f32 at this size. GPU and NPU cache compiled blobs.
    """
    kind = device.split(".")[0]
    config = {"PERFORMANCE_HINT": "LATENCY"}
    if kind == "cpu":
        config["KV_CACHE_PRECISION"] = "f32"
    else:
        config["CACHE_DIR"] = str(cache_root() / "ov_compiled")
    if kind == "npu":
        config.update({"NPU_USE_NPUW": "YES", "NPUW_LLM": "YES",
                       "NPUW_LLM_MAX_PROMPT_LEN": NPU_MAX_PROMPT_LEN,
                       "NPUW_LLM_MIN_RESPONSE_LEN": NPU_MIN_RESPONSE_LEN})
    config.update(user_config or {})
    return config


class OpenVINOBackend(Backend):
    """Runs stateful OpenVINO IRs; compresses weights with NNCF; exports IR folders."""

    priority = 10
    can_export = True

    def __init__(self):
        import openvino as ov

        self.core = ov.Core()

    def devices(self) -> List[DeviceInfo]:
        found = []
        for name in self.core.available_devices:
            props = {}
            for key in ("FULL_DEVICE_NAME", "DEVICE_TYPE", "OPTIMIZATION_CAPABILITIES"):
                try:
                    props[key] = str(self.core.get_property(name, key))
                except Exception:  # some plugins lack a property; list what they have
                    continue
            found.append(DeviceInfo(name.lower(), self.name, props))
        return found

    def matches(self, info: DeviceInfo, requested: str) -> bool:
        # OpenVINO names a lone GPU "GPU"; accept "gpu.0" for it and "gpu" for "gpu.0".
        aliases = {info.name}
        if info.name in ("gpu", "gpu.0"):
            aliases |= {"gpu", "gpu.0"}
        return requested in aliases

    def load(self, source, device: str, low_bit, ov_config: Optional[dict] = None, **_):
        from .ir import prepare_ir
        from .runner import OpenVINORunner

        folder = prepare_ir(source, low_bit)
        return OpenVINORunner(self.core, folder, device, compile_config(device, ov_config))

    def save_low_bit(self, runner, folder) -> None:
        _copy_files(runner.folder, Path(folder))

    def export_ir(self, source, folder, low_bit, device: str) -> None:
        from .ir import ensure_tokenizer_files, prepare_ir

        _copy_files(prepare_ir(source, low_bit), Path(folder))
        ensure_tokenizer_files(Path(folder), source.name)


def _copy_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".lock"):
            shutil.copy2(f, dst / f.name)
