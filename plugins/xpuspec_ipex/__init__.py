"""Optional xpuspec backend on Intel Extension for PyTorch (IPEX).

IPEX was retired after 2.8 and needs torch 2.8, so this plugin loads only where
``intel_extension_for_pytorch`` imports; elsewhere it reports why it cannot run.
Registered as the ``ipex`` entry point in the ``xpuspec.backends`` group.
"""

from typing import List, Optional

from xpuspec.devices import Backend, DeviceInfo


class IPEXBackend(Backend):
    """The torch backend with ``ipex.optimize`` applied to the model."""

    priority = 40

    def unavailable_reason(self) -> Optional[str]:
        try:
            import intel_extension_for_pytorch  # noqa: F401
        except Exception as exc:
            return (f"intel_extension_for_pytorch does not import ({type(exc).__name__}: {exc}); "
                    "IPEX needs torch 2.8 and was retired after 2.8")
        return None

    def devices(self) -> List[DeviceInfo]:
        from xpuspec_torch import TorchBackend

        return [DeviceInfo(d.name, self.name, d.properties) for d in TorchBackend().devices()]

    def load(self, source, device: str, low_bit, **options):
        import intel_extension_for_pytorch as ipex
        from xpuspec_torch import TorchBackend

        runner = TorchBackend().load(source, device, low_bit, **options)
        runner.model = ipex.optimize(runner.model, dtype=runner.model.dtype)
        return runner
