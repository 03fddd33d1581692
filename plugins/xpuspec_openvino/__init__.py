"""xpuspec backend on the OpenVINO runtime: CPU, GPU, GPU.N and NPU.

Registered as the ``openvino`` entry point in the ``xpuspec.backends`` group.
"""

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import List, Optional, Sequence

from xpuspec.cache import METADATA_FILE, cache_root, read_metadata
from xpuspec.devices import Backend, DeviceInfo
from xpuspec.errors import DeviceNotFoundError, PipelineConfigError
from xpuspec.lowbit import LowBitConfig
from xpuspec.progress import phase

log = logging.getLogger("xpuspec")

#: NPU runs an LLM through OpenVINO's NPUW LLM pipeline with static prompt and response windows.
NPU_MAX_PROMPT_LEN = 1024
NPU_MIN_RESPONSE_LEN = 128
#: Comma-separated extra names under which OpenVINO's CPU plugin is registered a second time, e.g.
#: ``cpux``: one CPU then shows as two real devices (``cpu``, ``cpux``) for multi-device runs.
CPU_ALIASES_ENV = "XPUSPEC_CPU_ALIASES"
#: openvino_genai's property for the attention implementation, taken from ``ov_config`` (not compiled).
ATTENTION_BACKEND = "ATTENTION_BACKEND"


#: OpenVINO's own device and meta-device names, which an alias must not take.
RESERVED_DEVICE_NAMES = {"cpu", "gpu", "npu", "auto", "hetero", "multi", "batch", "template"}


def cpu_aliases() -> List[str]:
    """The extra CPU device names from ``$XPUSPEC_CPU_ALIASES`` (lowercase).

    Raises:
        DeviceNotFoundError: a name OpenVINO already uses, or one that is not letters, digits and ``_``.
    """
    raw = os.environ.get(CPU_ALIASES_ENV, "")
    aliases = [a.strip().lower() for a in raw.split(",") if a.strip()]
    for alias in aliases:
        if alias in RESERVED_DEVICE_NAMES or not re.fullmatch(r"[a-z][a-z0-9_]*", alias):
            raise DeviceNotFoundError(
                f"{CPU_ALIASES_ENV}={raw!r}: {alias!r} cannot name a second CPU device (it is an OpenVINO device "
                "name, or has characters other than letters, digits and _). Use a new name such as 'cpux'.")
    return aliases


def _kind(device: str) -> str:
    base = device.split(".")[0]
    return "cpu" if base in cpu_aliases() else base


def compile_config(device: str, user_config: Optional[dict] = None, paged: bool = False,
                   bf16: bool = False) -> dict:
    """OpenVINO compile properties for ``device``, overridden by ``user_config`` (optimum-intel's ``ov_config``).

    Every device: ``PERFORMANCE_HINT=LATENCY`` (batch size 1). CPU:

    - ``KV_CACHE_PRECISION=f32``: with the default u8 cache a k-token verify pass differs from
      single-token decoding at near-ties; with f32 they agree within about 1e-4.
    - ``INFERENCE_PRECISION_HINT=f32``: the bf16 default of CPUs with AVX512-BF16 or AMX refuses an
      f32 KV cache in paged attention. With ``bf16`` (the ``bf16`` format, :func:`check_bf16`) both the inference
      precision and the KV cache are bf16, which paged attention takes together.
    - Dynamic quantization (the default on CPUs with AVX512-VNNI or AMX) stays on for paged attention
      (``paged``: a whole model and pipeline stages alike, so both compute one function), which pads its 1-token
      passes where they compute differently from wider ones (:mod:`.paged`). The stateful model
      (``ATTENTION_BACKEND="SDPA"``) runs with ``DYNAMIC_QUANTIZATION_GROUP_SIZE=0``: its SDPA rounds differently by
      query width, which dynamic quantization magnifies to logit differences up to about 0.5, so its verify passes
      would not compute as its steps (``benchmarks/results/stage-numerics.md``).
    - ``ENABLE_CPU_PINNING=False``: a pinned inference thread cannot leave a core that other work also runs on
      (another process, a job under ``taskset``, a second CPU plugin instance registered through
      ``$XPUSPEC_CPU_ALIASES``, which pins to the same cores), so every parallel region waits for that core's time
      slice. Unpinned, the operating system moves the thread to a free core. The outputs are the same either way
      (``benchmarks/cpu_pinning.py`` checks them, and measures the speeds in ``benchmarks/results/cpu-pinning.md``).

    GPU and NPU cache their compiled blobs under the cache folder; the NPU runs NPUW's LLM pipeline with
    :data:`NPU_MAX_PROMPT_LEN` and :data:`NPU_MIN_RESPONSE_LEN`. The measurements behind these settings:
    ``benchmarks/results/HISTORY.md`` ("Measurements that stood in docstrings").
    """
    kind = _kind(device)
    config = {"PERFORMANCE_HINT": "LATENCY"}
    if kind == "cpu":
        config["KV_CACHE_PRECISION"] = "bf16" if bf16 else "f32"
        config["INFERENCE_PRECISION_HINT"] = "bf16" if bf16 else "f32"
        if not paged:
            config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
        config["ENABLE_CPU_PINNING"] = False
    else:
        config["CACHE_DIR"] = str(cache_root() / "ov_compiled")
    if kind == "npu":
        config.update({"NPU_USE_NPUW": "YES", "NPUW_LLM": "YES",
                       "NPUW_LLM_MAX_PROMPT_LEN": NPU_MAX_PROMPT_LEN,
                       "NPUW_LLM_MIN_RESPONSE_LEN": NPU_MIN_RESPONSE_LEN})
    config.update(user_config or {})
    return config


def check_bf16(core, device: str) -> None:
    """Refuse the ``bf16`` format on an OpenVINO device that does not compute in bfloat16: only a CPU whose plugin
    reports the ``BF16`` optimization capability (AVX512-BF16 or AMX) does.

    Raises:
        LowBitConfigError: another device, or a CPU without the capability.
    """
    from xpuspec.errors import LowBitConfigError

    capabilities = []
    if _kind(device) == "cpu":
        capabilities = [str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
    if "BF16" not in capabilities:
        raise LowBitConfigError(
            f"bf16 on OpenVINO {device}: the device does not compute in bfloat16 (OpenVINO runs bf16 only on CPUs "
            "with AVX512-BF16 or AMX; this one reports " + (", ".join(capabilities) or "no CPU capabilities") +
            "). Use fp16 or fp32 here, or backend='torch' with bf16.")


def uses_paged_attention(requested: Optional[str], devices: Sequence[str]) -> bool:
    """Whether a model runs with paged attention (:class:`.paged.PagedRunner`, and
    :class:`.paged_stages.PagedStagesRunner` for pipeline stages) rather than on the stateful SDPA model
    (:class:`.runner.OpenVINORunner`): ``ov_config={"ATTENTION_BACKEND": "PA" | "SDPA"}``, openvino_genai's
    property. By default a model on CPUs and GPUs is paged, whole or split into stages, so it computes one function
    either way; the NPU (NPUW runs its own LLM pipeline) runs the stateful model.

    Raises:
        PipelineConfigError: ``"PA"`` asked for the NPU.
        ValueError: a value other than ``"PA"`` and ``"SDPA"``.
    """
    can_page = not any(_kind(d) == "npu" for d in devices)
    if requested is None:
        return can_page
    value = str(requested).upper()
    if value not in ("PA", "SDPA"):
        raise ValueError(f"ov_config {ATTENTION_BACKEND}={requested!r}: use 'PA' (paged attention) or 'SDPA'.")
    if value == "PA" and not can_page:
        raise PipelineConfigError(
            f"ov_config {ATTENTION_BACKEND}='PA' cannot run on {','.join(devices)}: the NPU runs the stateful SDPA "
            f"model. Drop {ATTENTION_BACKEND}, or run the model on CPUs or GPUs.")
    return value == "PA"


_FP32 = LowBitConfig("fp32")


class OpenVINOBackend(Backend):
    """Runs stateful OpenVINO IRs; compresses weights with NNCF; exports IR folders."""

    priority = 10
    can_export = True

    def __init__(self):
        import openvino as ov

        self.core = ov.Core()

    def _register_cpu_aliases(self) -> None:
        """Register the CPU plugin under each name in ``$XPUSPEC_CPU_ALIASES`` not yet known."""
        import openvino as ov

        for alias in cpu_aliases():
            if alias.upper() not in self.core.available_devices:
                self.core.register_plugin(str(_cpu_plugin_library(ov)), alias.upper())

    def devices(self) -> List[DeviceInfo]:
        self._register_cpu_aliases()
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

    def identity(self, device: str) -> dict:
        import openvino as ov

        return {**super().identity(device), "openvino": ov.__version__}

    def can_cut_head(self, device: str) -> bool:
        """CPU and GPU: the LM head's weight is cut in the graph (:func:`.graph.keep_head_rows`); the NPU's NPUW
        pipeline builds its own head."""
        return _kind(device) != "npu"

    def load(self, source, device: str, low_bit, ov_config: Optional[dict] = None,
             stages: Optional[Sequence[str]] = None, split: Optional[Sequence[int]] = None,
             head_tokens: Optional[Sequence[int]] = None, **_):
        """Compile ``source`` on ``device``, or split into pipeline stages on ``stages`` (one device each);
        ``head_tokens``: score only these token ids (see :meth:`can_cut_head`).

        Raises:
            DeviceNotFoundError: an NPU among several stages (NPUW runs a whole LLM).
            ValueError: ``split`` does not fit the stages or the model's layers, or ``ov_config`` asks for a KV-cache
                precision the CPU's paged attention refuses (:func:`.paged.check_cpu_cache_precision`).
        """
        from .ir import prepare_ir
        from .paged import PagedRunner, check_cpu_cache_precision
        from .paged_stages import PagedStagesRunner
        from .runner import OpenVINORunner

        devices = list(stages or [device])
        if len(devices) > 1 and any(_kind(d) == "npu" for d in devices):
            raise DeviceNotFoundError(
                f"The NPU runs a whole LLM through OpenVINO's NPUW pipeline and cannot hold one stage of {devices}. "
                "Put the stages on CPU/GPU devices, and use the NPU for the draft (draft_device='npu').")
        ov_config = dict(ov_config or {})
        paged = uses_paged_attention(ov_config.pop(ATTENTION_BACKEND, None), devices)
        bf16 = (low_bit or source.saved_low_bit or _FP32).format == "bf16"
        for d in devices if bf16 else ():
            check_bf16(self.core, d)
        folder = prepare_ir(source, low_bit)
        configs = [compile_config(d, ov_config, paged=paged, bf16=bf16) for d in devices]
        if paged:
            for d, config in zip(devices, configs):
                if _kind(d) == "cpu":
                    check_cpu_cache_precision(self.core, d, config)
        fmt = (low_bit or source.saved_low_bit or _FP32).format
        with phase(f"compile {source.name} ({fmt}) for {','.join(devices)}") as bar:
            if paged and len(devices) > 1:
                runner = PagedStagesRunner(self.core, folder, devices, configs, split, head_tokens=head_tokens,
                                           is_cpu=[_kind(d) == "cpu" for d in devices])
            elif paged:
                runner = PagedRunner(self.core, folder, devices[0], configs[0], head_tokens=head_tokens,
                                     is_cpu=_kind(devices[0]) == "cpu")
            else:
                runner = OpenVINORunner(self.core, folder, devices, configs, split, head_tokens=head_tokens)
            bar.update(1)
        return runner

    def check(self, source, device: str, low_bit) -> None:
        """Refuse an architecture optimum-intel cannot export (a Hugging Face source) and bf16 where the device
        does not compute in it, before any export or compile."""
        from .ir import check_exportable

        if source.kind == "hf":
            check_exportable(source.config.model_type)
        if (low_bit or source.saved_low_bit or _FP32).format == "bf16":
            check_bf16(self.core, device)

    def save_low_bit(self, runner, folder) -> None:
        _copy_files(runner.folder, Path(folder))

    def export_ir(self, source, folder, low_bit, device: str) -> None:
        from .ir import ensure_tokenizer_files, prepare_ir

        _copy_files(prepare_ir(source, low_bit), Path(folder))
        ensure_tokenizer_files(Path(folder), source.name)
        if low_bit is not None and low_bit.format == "bf16":  # fp32 weights that xpuspec compiles to compute in bf16
            meta = read_metadata(Path(folder))
            meta["low_bit"] = low_bit.as_dict()
            (Path(folder) / METADATA_FILE).write_text(json.dumps(meta, indent=2))


def _cpu_plugin_library(ov) -> Path:
    found = sorted((Path(ov.__file__).parent / "libs").glob("*openvino_intel_cpu_plugin*"))
    if not found:
        raise DeviceNotFoundError(f"{CPU_ALIASES_ENV} is set, but OpenVINO's CPU plugin library is not in "
                                  f"{Path(ov.__file__).parent / 'libs'}. Unset {CPU_ALIASES_ENV}.")
    return found[0]


def _copy_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".lock"):
            shutil.copy2(f, dst / f.name)
