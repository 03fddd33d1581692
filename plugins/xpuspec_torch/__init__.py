"""xpuspec backend on native PyTorch: ``cpu`` and Intel GPUs through ``torch.xpu``.

Registered as the ``torch`` entry point in the ``xpuspec.backends`` group. It runs
Hugging Face folders in fp32 or fp16; for INT8/INT4 weights use the OpenVINO backend.
"""

from typing import List

from xpuspec.devices import Backend, DeviceInfo
from xpuspec.errors import LowBitConfigError, ModelSourceError


def _xpu_available() -> bool:
    import torch

    return hasattr(torch, "xpu") and torch.xpu.is_available()


class TorchBackend(Backend):
    """Runs transformers models eagerly with a ``DynamicCache``."""

    priority = 50
    #: No INT4 here: a self-draft is an fp16 copy (half the weight bytes of fp32).
    self_draft_low_bit = "fp16"

    def devices(self) -> List[DeviceInfo]:
        import torch

        found = [DeviceInfo("cpu", self.name, {"torch": torch.__version__,
                                                "threads": str(torch.get_num_threads())})]
        if _xpu_available():
            for i in range(torch.xpu.device_count()):
                found.append(DeviceInfo(f"xpu:{i}", self.name, {"FULL_DEVICE_NAME": torch.xpu.get_device_name(i)}))
        return found

    def matches(self, info: DeviceInfo, requested: str) -> bool:
        aliases = {info.name, info.name.replace(":", ".")}
        if info.name == "xpu:0":
            aliases.add("xpu")
        return requested in aliases

    def check(self, source, device: str, low_bit) -> None:
        """Refuse an OpenVINO IR source and a format other than fp32/fp16/bf16 (see :meth:`load`)."""
        self._check(source, low_bit, pipeline=False)

    def _check(self, source, low_bit, pipeline: bool) -> None:
        if source.kind != "hf":
            raise ModelSourceError(
                f"The torch backend needs a Hugging Face folder, but {source.name!r} is an OpenVINO IR. "
                "Load it on an OpenVINO device (device='cpu' with backend='openvino'), or pass the original model."
            )
        fmt = low_bit.format if low_bit else None
        if fmt not in (None, "fp32", "fp16", "bf16"):
            raise LowBitConfigError(
                f"A torchrun pipeline runs fp32 or fp16 weights only, not {fmt}: pass load_in_low_bit=None or "
                "'fp16' (CLI: --low-bit none or fp16). For INT8/INT4 weights split over several devices, run one "
                "process without torchrun on the OpenVINO backend, e.g. device='gpu.0,gpu.1' (CLI: --device "
                "gpu.0,gpu.1)." if pipeline else
                f"The torch backend runs fp32, fp16 and bf16 only, not {fmt}. For INT8/INT4 weights use the OpenVINO "
                "backend (backend='openvino', devices cpu/gpu/npu)."
            )

    def load(self, source, device: str, low_bit, stages=None, split=None, **_):
        """A :class:`TorchRunner`, or with ``stages`` (one device per stage) this torchrun rank's
        :class:`TorchPipelineRunner` over ``split`` (decoder layers per stage; default balanced by weight bytes).

        Raises:
            ModelSourceError: ``source`` is an OpenVINO IR.
            LowBitConfigError: a format other than fp32/fp16/bf16.
            PipelineConfigError, PipelineError: see :func:`xpuspec_torch.pipeline.load_stage`.
        """
        import torch
        from transformers import AutoModelForCausalLM

        from .runner import TorchRunner

        self._check(source, low_bit, stages is not None)
        dtypes = {None: torch.float32, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        fmt = low_bit.format if low_bit else None
        if stages is not None:
            from xpuspec.distributed import torchrun_world

            from .pipeline import load_stage

            return load_stage(source.path, source.config, stages, split, dtypes[fmt], torchrun_world())
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtypes[fmt]).to(device).eval()
        return TorchRunner(model, device)

    def save_low_bit(self, runner, folder) -> None:
        """Refused: ``save_low_bit`` writes OpenVINO IR, and NNCF-compressed torch weights do not survive
        transformers' ``save_pretrained`` (their uint8 values reload as float32 0..255)."""
        raise NotImplementedError(
            "The torch backend cannot save_low_bit: it runs fp32/fp16 weights only and writes no IR, and xpuspec "
            "does not ship NNCF-compressed torch checkpoints. Load the model with backend='openvino' to save it, "
            "or keep the original Hugging Face folder for the torch backend."
        )

