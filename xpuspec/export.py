"""``xpuspec export``: write an OpenVINO IR folder (model, tokenizer, detokenizer, configs).

The folder is built in a temporary sibling and renamed into place at the end, so an
interrupted export leaves nothing behind; an existing non-empty folder is replaced
only with ``force``.
"""

import os
from pathlib import Path
from typing import Optional

from .cache import atomic_folder, refuse_replacing, refuse_replacing_anything_kept, write_manifest
from .devices import backends
from .errors import BackendUnavailableError, DeviceNotFoundError, OutputExistsError
from .lowbit import LowBitConfig, decoder_in_channels
from .sources import resolve_source

#: Device kinds an exported IR can target (it need not be present on this machine).
EXPORT_DEVICES = ("cpu", "gpu", "npu")


def export(model, output, weight_format: str = "int4_asym", group_size: Optional[int] = None,
           ratio: Optional[float] = None, awq: bool = False, scale_estimation: bool = False,
           device: str = "cpu", force: bool = False) -> Path:
    """Export ``model`` to an OpenVINO IR folder at ``output`` and return its path.

    Args:
        model: built-in name, Hugging Face folder, IR folder or hub id.
        output: the folder to write.
        weight_format: a :data:`xpuspec.lowbit.FORMATS` name.
        group_size, ratio, awq, scale_estimation: NNCF INT4 parameters.
        device: the device the IR is meant for (``cpu``, ``gpu``, ``gpu.N``, ``npu``); NPU rules apply.
        force: replace a non-empty ``output``.

    Raises:
        OutputExistsError: ``output`` is not empty and ``force`` is false (checked before any work), or ``output`` is,
            or holds, the model's own folder, xpuspec's cache (or lies inside it) or the current folder (refused even
            with ``force``; :func:`xpuspec.cache.refuse_replacing_anything_kept`).
        OSError: the temporary folder beside ``output`` cannot be created (made before any work).
        ValueError: ``output`` is an empty string.
        LowBitConfigError: an invalid format or parameter, or an NPU rule broken.
        DeviceNotFoundError: ``device`` is not an OpenVINO device spelling.
        ModelSourceError: the model cannot be found.
    """
    if not str(output).strip():
        raise ValueError("The output folder is an empty string; name the folder to write.")
    out = Path(os.path.abspath(Path(output).expanduser()))  # "." gets a name; a link stays a link
    local = Path(str(model)).expanduser()
    refuse_replacing_anything_kept(out, *([local] if local.is_dir() else []))  # before "pass --force" is suggested
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise OutputExistsError(f"{out} exists and is not empty; pass --force (force=True) to replace it.")
    kind = device.lower().split(".")[0]
    if kind not in EXPORT_DEVICES:
        raise DeviceNotFoundError(f"Export targets OpenVINO devices {', '.join(EXPORT_DEVICES)} (or gpu.N), not {device!r}.")
    params = {k: v for k, v in dict(group_size=group_size, ratio=ratio).items() if v is not None}
    low_bit = LowBitConfig(format=weight_format.lower(), awq=awq, scale_estimation=scale_estimation, **params)
    low_bit.check_device(device)
    exporters = [b for b in backends().values() if b.can_export]
    if not exporters:
        raise BackendUnavailableError("No installed backend can export OpenVINO IR; install xpuspec with its openvino plugin.")
    with atomic_folder(out, overwrite=force) as tmp:  # first, so that an unwritable output fails before any work
        source = resolve_source(model)
        refuse_replacing(out, source.path, "the model's own folder")  # a built-in name or hub id has its folder now
        low_bit = low_bit.fitted(decoder_in_channels(source.config), device)
        exporters[0].export_ir(source, tmp, low_bit, device.lower())
        write_manifest(tmp)
    return out
