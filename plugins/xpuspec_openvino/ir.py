"""Building OpenVINO IR folders: optimum-intel's exporter for fp32, NNCF for low-bit, all cached.

Cache layout under ``<cache>/ov/<source fingerprint>/``: ``fp32/`` is the exported
stateful IR with its tokenizer; every other entry is one low-bit variant keyed by
its settings. Each folder is a complete IR folder (model, tokenizers, configs).
"""

import contextlib
import json
import logging
import shutil
from pathlib import Path

from xpuspec.cache import METADATA_FILE, cache_root, cached_folder, digest, folder_fingerprint, manifest_damage
from xpuspec.errors import LowBitConfigError, ModelSourceError, UnsupportedArchitectureError
from xpuspec.hf_folder import check_tokenizer_files
from xpuspec.lowbit import LowBitConfig
from xpuspec.progress import phase
from xpuspec.sources import ModelSource

log = logging.getLogger("xpuspec")

MODEL_XML = "openvino_model.xml"
MODEL_BIN = "openvino_model.bin"
TOKENIZER_FILES = ("openvino_tokenizer.xml", "openvino_tokenizer.bin",
                   "openvino_detokenizer.xml", "openvino_detokenizer.bin")
#: Short calibration text for AWQ / scale estimation (no hub datasets are reachable).
CALIBRATION_TEXT = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The history of the printing press begins in the fifteenth century, when movable type spread across Europe.",
    "import os\n\ndef list_files(root):\n    for name in sorted(os.listdir(root)):\n        print(name)\n",
    "Rivers carry sediment from the mountains to the sea, shaping valleys and deltas over thousands of years.",
]


def read_ir(core, folder: Path):
    """``core.read_model`` on an IR folder, refusing a damaged folder with a clear error.

    Files are compared with the folder's manifest by size first; when OpenVINO still cannot
    read the model, by sha256, and OpenVINO's reason is given if they agree.

    Raises:
        ModelSourceError: a file is missing, truncated or altered, or OpenVINO cannot read the model.
    """
    folder = Path(folder)
    damage = manifest_damage(folder)
    if damage is None:
        try:
            return core.read_model(folder / MODEL_XML)
        except RuntimeError as exc:
            reason = [line for line in str(exc).splitlines() if line.strip()][-1]
            damage = manifest_damage(folder, checksums=True) or f"OpenVINO cannot read it ({reason})"
    if folder.resolve().is_relative_to(cache_root().resolve()):
        fix = f"Delete {folder}; xpuspec rebuilds it on the next load."
    else:
        fix = "Write it again with `xpuspec export` or save_low_bit."
    raise ModelSourceError(f"The OpenVINO IR in {folder} is damaged: {damage}. {fix}")


def _copy_side_files(src: Path, dst: Path) -> None:
    """Copy everything but the model weights (configs, HF and OpenVINO tokenizers)."""
    for f in src.iterdir():
        if f.is_file() and f.name not in (MODEL_XML, MODEL_BIN, METADATA_FILE) and not f.name.endswith(".lock"):
            shutil.copy2(f, dst / f.name)


def _write_metadata(folder: Path, source: ModelSource, low_bit) -> None:
    meta = {"source": source.name, "low_bit": low_bit.as_dict() if low_bit else {"format": "fp32"}}
    (folder / METADATA_FILE).write_text(json.dumps(meta, indent=2))


#: optimum-intel's task for a stateful causal LM with a KV cache.
EXPORT_TASK = "text-generation-with-past"


#: Architectures whose optimum-intel export config caps transformers below the pinned series, but whose export
#: under that series computes what the torch model computes (``tests/test_architectures.py``: IR logits vs torch,
#: greedy identity in fp32 and INT8, speculative identity), with the series they were measured on.
#: optimum-intel 2.1.0 set ``MAX_TRANSFORMERS_VERSION = "5.0"`` on its Gemma config (inherited by Gemma-2 and
#: Gemma-3) in the change that added transformers 5.5 support, and its tests skip the capped architectures: the
#: cap marks them untested on 5.5, not known broken. Gemma-2's export computes attention without the logit
#: soft-capping, as transformers' default SDPA attention does (and optimum-intel's export does under every
#: transformers version); eager attention applies it.
EXPORT_VERIFIED_PAST_CAP = {"gemma2": "5.5", "gemma3_text": "5.5"}


def check_exportable(model_type: str) -> None:
    """Refuse an architecture that the installed optimum-intel cannot export to OpenVINO IR.

    Raises:
        UnsupportedArchitectureError: ``model_type`` has no OpenVINO export config for :data:`EXPORT_TASK`.
    """
    import optimum.exporters.openvino  # noqa: F401  (registers the OpenVINO export configs)
    from optimum.exporters.tasks import TasksManager
    from optimum.intel.version import __version__ as optimum_intel_version

    try:
        tasks = TasksManager.get_supported_tasks_for_model_type(model_type, exporter="openvino",
                                                                library_name="transformers")
    except KeyError:
        tasks = {}
    instead = ("Run it with the torch backend (from_pretrained(..., backend='torch'), fp32, fp16 or bf16), or pick a model "
               "of a supported architecture.")
    if EXPORT_TASK not in tasks:
        raise UnsupportedArchitectureError(
            f"optimum-intel {optimum_intel_version} cannot export architecture {model_type!r} to OpenVINO IR, so "
            f"it cannot run on the OpenVINO backend or be exported. {instead}")
    _check_transformers_range(TasksManager.get_exporter_config_constructor(
        exporter="openvino", model_type=model_type, task=EXPORT_TASK, library_name="transformers"), model_type, instead)


def _check_transformers_range(constructor, model_type: str, instead: str) -> None:
    """Refuse, before any work, an export config that declares a transformers range the installed one is outside
    of (optimum-intel's exporter would raise a bare ValueError after loading the model). Versions compare as
    optimum-intel compares them (``packaging`` versions: ``5.0.0 == 5.0``, so 5.0.0 is inside "up to 5.0").

    Raises:
        UnsupportedArchitectureError: transformers is older than the config's ``MIN_TRANSFORMERS_VERSION`` or newer
            than its ``MAX_TRANSFORMERS_VERSION``.
    """
    import transformers
    from packaging.version import Version

    config = getattr(constructor, "func", constructor)
    installed = Version(transformers.__version__)
    low, high = (getattr(config, name, None) for name in ("MIN_TRANSFORMERS_VERSION", "MAX_TRANSFORMERS_VERSION"))
    low, high = (None if v is None else Version(str(v)) for v in (low, high))
    if _verified_past_cap(model_type):
        high = None
    if (low is not None and installed < low) or (high is not None and installed > high):  # optimum-intel's test
        raise UnsupportedArchitectureError(
            f"optimum-intel exports architecture {model_type!r} only with transformers "
            f"{low or 'any'} to {high or 'any'}; this environment has {installed}. {instead}")


def _verified_past_cap(model_type: str) -> bool:
    """Whether ``model_type`` is in :data:`EXPORT_VERIFIED_PAST_CAP` for the installed transformers series."""
    import transformers
    from packaging.version import Version

    series = EXPORT_VERIFIED_PAST_CAP.get(model_type)
    return series is not None and Version(transformers.__version__).release[:2] == Version(series).release[:2]


@contextlib.contextmanager
def _cap_lifted(model_type: str):
    """Lift the export config's ``MAX_TRANSFORMERS_VERSION`` for the block where ``model_type`` is verified past
    it (:data:`EXPORT_VERIFIED_PAST_CAP`); restored afterwards. Elsewhere, nothing changes."""
    if not _verified_past_cap(model_type):
        yield
        return
    from optimum.exporters.tasks import TasksManager

    constructor = TasksManager.get_exporter_config_constructor(
        exporter="openvino", model_type=model_type, task=EXPORT_TASK, library_name="transformers")
    config = getattr(constructor, "func", constructor)
    own = config.__dict__.get("MAX_TRANSFORMERS_VERSION", _ABSENT)
    config.MAX_TRANSFORMERS_VERSION = None
    try:
        yield
    finally:
        if own is _ABSENT:
            del config.MAX_TRANSFORMERS_VERSION
        else:
            config.MAX_TRANSFORMERS_VERSION = own


_ABSENT = object()


def _export_fp32(source: ModelSource, tmp: Path) -> None:
    from optimum.exporters.openvino import main_export
    from optimum.intel import OVConfig

    model_type = source.config.model_type
    check_exportable(model_type)
    with phase(f"export {source.name} to OpenVINO IR") as bar, _cap_lifted(model_type):
        log.info("exporting %s to OpenVINO IR (fp32) with optimum-intel", source.name)
        main_export(str(source.path), tmp, task=EXPORT_TASK,
                    ov_config=OVConfig(dtype="fp32"), convert_tokenizer=True)
        bar.update(1)


def base_ir(source: ModelSource) -> Path:
    """The fp32 stateful IR folder of ``source`` (the source itself when it already is an IR)."""
    if source.kind == "ir":
        return source.path
    folder = cache_root() / "ov" / folder_fingerprint(source.path) / "fp32"

    def build(tmp: Path) -> None:
        _export_fp32(source, tmp)
        _write_metadata(tmp, source, None)

    return cached_folder(folder, build)


def _calibration_dataset(source: ModelSource):
    import nncf
    import numpy as np
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.path)
    items = []
    for text in CALIBRATION_TEXT:
        ids = tokenizer(text, return_tensors="np").input_ids.astype(np.int64)
        n = ids.shape[1]
        items.append({"input_ids": ids, "attention_mask": np.ones_like(ids),
                      "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)})
    return nncf.Dataset(items)


#: NNCF compresses each weight either with numpy or with a small OpenVINO model compiled for that weight (its
#: "optimized" path, taken for weights of 10000 elements or more). The compile costs about 40-60 ms per weight
#: (NNCF switches its cache of compiled models off while it writes the model), which the compute saved repays only
#: on large weights. Measured on 2 cores of an AMD EPYC with AVX-512 (``benchmarks/results/first-run.md``), ms per
#: weight, optimized against numpy: int8_asym 576x576 48/19, 1536x576 57/26, 4864x896 61/38; int4_asym 4864x896
#: 71/127, 8960x1536 155/357. Both paths give bit-identical IRs. A model whose MLP weight (hidden x intermediate)
#: is below this many elements is compressed on the numpy path (``NNCF_DISABLE_OPTIMIZED_COMPRESSION``, NNCF's own
#: switch); larger models keep NNCF's default.
NUMPY_COMPRESSION_MAX_ELEMENTS = 2_000_000


@contextlib.contextmanager
def _nncf_path_for(config):
    """Within the block, NNCF compresses on its numpy path when ``config``'s MLP weight is small
    (:data:`NUMPY_COMPRESSION_MAX_ELEMENTS`). A user's own ``NNCF_DISABLE_OPTIMIZED_COMPRESSION`` is left alone."""
    import os

    key = "NNCF_DISABLE_OPTIMIZED_COMPRESSION"
    size = getattr(config, "hidden_size", 0) * (getattr(config, "intermediate_size", 0) or 0)
    if key in os.environ or not 0 < size < NUMPY_COMPRESSION_MAX_ELEMENTS:
        yield
        return
    os.environ[key] = "1"
    try:
        yield
    finally:
        os.environ.pop(key, None)


def _compress(source: ModelSource, base: Path, low_bit: LowBitConfig, tmp: Path) -> None:
    import nncf
    import openvino as ov

    model = read_ir(ov.Core(), base)
    if low_bit.format == "fp16":
        ov.save_model(model, tmp / MODEL_XML, compress_to_fp16=True)
    else:
        kwargs = {"mode": nncf.CompressWeightsMode[low_bit.format.upper()]}
        if low_bit.is_int4:
            kwargs.update(group_size=low_bit.group_size, ratio=low_bit.ratio)
            if low_bit.awq or low_bit.scale_estimation:
                kwargs.update(awq=low_bit.awq, scale_estimation=low_bit.scale_estimation,
                              dataset=_calibration_dataset(source), subset_size=len(CALIBRATION_TEXT))
        with phase(f"compress {source.name} to {low_bit.format}") as bar, _nncf_path_for(source.config):
            log.info("compressing weights with NNCF: %s", low_bit.as_dict())
            ov.save_model(nncf.compress_weights(model, **kwargs), tmp / MODEL_XML, compress_to_fp16=False)
            bar.update(1)
    _copy_side_files(base, tmp)
    _write_metadata(tmp, source, low_bit)


def prepare_ir(source: ModelSource, low_bit) -> Path:
    """Return an IR folder for ``source`` compressed as ``low_bit`` (``None``: as it is).

    ``low_bit`` must already be fitted to the model and device (:meth:`LowBitConfig.fitted`).

    Raises:
        LowBitConfigError: the source is an IR already compressed to another format, or an NPU rule is broken.
    """
    if low_bit is None:
        return base_ir(source)
    already = source.saved_low_bit.format if source.saved_low_bit else "fp32"
    if already != "fp32":
        if already == low_bit.format:
            return source.path
        raise LowBitConfigError(
            f"{source.name} is an IR already compressed to {already}; it cannot be re-compressed to "
            f"{low_bit.format}. Load it without load_in_low_bit, or start from the original model."
        )
    if low_bit.format in ("fp32", "bf16"):  # bf16: fp32 weights, compiled to compute in bf16 (compile_config)
        return base_ir(source)
    base = base_ir(source)
    folder = cache_root() / "ov" / folder_fingerprint(source.path) / digest(low_bit.as_dict())
    return cached_folder(folder, lambda tmp: _compress(source, base, low_bit, tmp))


def ensure_tokenizer_files(folder: Path, name: str) -> None:
    """Write ``openvino_tokenizer/detokenizer`` into an IR folder that lacks them, from its HF tokenizer
    (``name``: the model it was made from, for the message).

    Raises:
        ModelSourceError: the folder has no Hugging Face tokenizer files either.
    """
    if all((folder / f).is_file() for f in TOKENIZER_FILES):
        return
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    check_tokenizer_files(folder, name)
    tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(folder), with_detokenizer=True)
    ov.save_model(tok, folder / "openvino_tokenizer.xml")
    ov.save_model(detok, folder / "openvino_detokenizer.xml")
