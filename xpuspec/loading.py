"""Loading a model: ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``, with
transformers' names.

``from_pretrained`` reads its keyword arguments into one :class:`LoadOptions` of three groups, checking everything
that needs no file: the :class:`Weights` asked for, the :class:`Placement` (backend, one device per pipeline stage)
of the model and of its draft, and the :class:`~xpuspec.speculative.config.SpeculativeConfig`. :func:`load` then runs
the phases in order, each one function below: find the sources, choose the weight format, check the backends, load
the target, attach speculation.
"""

import logging
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from . import formats
from .cache import METADATA_FILE
from .devices import resolve_device
from .errors import DeviceNotFoundError, LowBitConfigError, ModelSourceError, SpeculativeConfigError, XpuspecError
from .hf_folder import check_tokenizer_files
from .lowbit import LowBitConfig, decoder_in_channels, resolve_low_bit
from .modeling import XpuspecModelForCausalLM
from .numerics import check_loaded
from .sources import ModelSource, resolve_source
from .speculative.config import SpeculativeConfig, resolve_speculative
from .speculative.layerskip import layer_skip_draft
from .speculative.pairing import check_draft, check_vocabularies
from .speculative.resident import ReleasableRunner, rss_bytes
from .speculative.vocab import DEFAULT_DRAFT_VOCAB_SIZE, frequent_tokens
from .stages import check_split, resolve_stage_devices, torchrun_pipeline

log = logging.getLogger("xpuspec")

_DTYPE_FORMATS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", "float32": "fp32",
                  "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Weights:
    """The weight format asked for: ``low_bit`` (``None`` keeps the source's precision), or ``auto`` (the fastest
    format within the quality bound, measured once: :mod:`xpuspec.formats`)."""

    low_bit: Optional[LowBitConfig] = None
    auto: bool = False

    @classmethod
    def asked(cls, load_in_low_bit=None, load_in_4bit: bool = False, load_in_8bit: bool = False, dtype=None,
              **nncf) -> "Weights":
        """From ``from_pretrained``'s arguments; ``nncf``: ``group_size``, ``ratio``, ``awq``, ``scale_estimation``.

        Raises:
            LowBitConfigError: an unknown format or dtype, or ``"auto"`` with settings of one format.
        """
        if dtype is not None and load_in_low_bit is None and not (load_in_4bit or load_in_8bit):
            if dtype not in _DTYPE_FORMATS:
                raise LowBitConfigError(f"dtype {dtype} is not supported; use torch.float32, torch.float16 "
                                        "or torch.bfloat16.")
            load_in_low_bit = _DTYPE_FORMATS[dtype]
        auto = isinstance(load_in_low_bit, str) and load_in_low_bit.lower() == formats.AUTO
        if auto and (load_in_4bit or load_in_8bit or any(v is not None for v in nncf.values())):
            raise LowBitConfigError("load_in_low_bit='auto' chooses among the formats at their default settings: drop "
                                    "load_in_4bit/load_in_8bit/group_size/ratio/awq/scale_estimation, or name a format.")
        return cls(resolve_low_bit(None if auto else load_in_low_bit, load_in_4bit, load_in_8bit, **nncf), auto)

    def check_devices(self, devices: Sequence[str]) -> None:
        """Refuse a format that one of ``devices`` cannot run (before any slow work).

        Raises:
            LowBitConfigError: e.g. an NPU rule.
        """
        for name in devices if self.low_bit is not None else ():
            self.low_bit.check_device(name)


@dataclass(frozen=True)
class Placement:
    """Where a model runs: its backend and one resolved device name per pipeline stage (one: no split), and the
    stages' decoder layers (``split``, checked against the model once its config is read)."""

    backend: object
    devices: List[str]
    split: Optional[Sequence[int]] = None

    @classmethod
    def resolve(cls, device, backend: Optional[str], stages: Optional[int], split, spec) -> "Placement":
        """From ``from_pretrained``'s ``device``, ``backend``, ``pipeline_parallel_stages`` and ``split``: one stage
        per process under torchrun (torch backend), else every stage in this process, one device each.

        Raises:
            DeviceNotFoundError, PipelineConfigError: as :func:`xpuspec.stages.resolve_stage_devices` and
                :func:`xpuspec.stages.torchrun_pipeline`.
        """
        if torchrun_pipeline(backend, stages, spec):
            chosen, name = resolve_device(device, "torch")
            return cls(chosen, [name] * stages, split)
        chosen, devices = resolve_stage_devices(device, stages, backend)
        return cls(chosen, devices, split)

    @property
    def device_name(self) -> str:
        """The devices in xpuspec's spelling, comma-separated for pipeline stages."""
        return ",".join(self.devices)


@dataclass(frozen=True)
class LoadOptions:
    """Everything ``from_pretrained`` was asked, read and checked. ``draft``: where a draft model runs (``None``:
    no draft model; an EAGLE-3 head runs beside the target). ``draft_vocab_size`` and ``is_draft`` are set only
    for a draft model's own load (``SpeculativeConfig.draft_vocab_size``; 0: the whole vocabulary)."""

    name: str
    weights: Weights
    placement: Placement
    spec: Optional[SpeculativeConfig] = None
    draft: Optional[Placement] = None
    ov_config: Optional[dict] = None
    prefix_caching: bool = False
    force_download: bool = False
    draft_vocab_size: Optional[int] = 0
    is_draft: bool = False


class AutoModelForCausalLM:
    """Drop-in for ``transformers.AutoModelForCausalLM``; see :meth:`from_pretrained`."""

    def __init__(self):
        raise EnvironmentError("Use AutoModelForCausalLM.from_pretrained(...).")

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *,
        device: Optional[str] = None,
        backend: Optional[str] = None,
        load_in_low_bit=None,
        load_in_4bit: bool = False,
        load_in_8bit: bool = False,
        group_size: Optional[int] = None,
        ratio: Optional[float] = None,
        awq: Optional[bool] = None,
        scale_estimation: Optional[bool] = None,
        ov_config: Optional[dict] = None,
        speculative=None,
        draft_low_bit: Optional[str] = None,
        draft_device: Optional[str] = None,
        draft_backend: Optional[str] = None,
        dtype=None,
        torch_dtype=None,
        pipeline_parallel_stages: Optional[int] = None,
        split: Optional[Sequence[int]] = None,
        gguf_file: Optional[str] = None,
        enable_prefix_caching: bool = False,
        **kwargs,
    ) -> XpuspecModelForCausalLM:
        """Load a causal LM and place it on a device, compressing its weights if asked.

        Args:
            pretrained_model_name_or_path: a built-in name (``"smollm2-135m-instruct"``), a local
                Hugging Face folder, an OpenVINO IR folder, a GGUF file (converted once, like the built-in models,
                and cached under its sha256: :func:`xpuspec.sources.pull_gguf`), or a hub id.
            device: ``"cpu"``, ``"gpu"``, ``"gpu.1"``, ``"npu"``, ``"xpu"``, ``"auto"`` or a ``torch.device``;
                default ``$XPUSPEC_DEVICE``, else ``"auto"``. A list such as ``"gpu.0,gpu.1"`` splits the
                model into pipeline stages, one per device.
            backend: force a backend by entry-point name (``"openvino"``, ``"torch"``).
            load_in_low_bit: ``"int4_sym"``, ``"int4_asym"``, ``"int8_sym"``, ``"int8_asym"``, ``"fp16"``,
                ``"bf16"`` (where the device computes in bfloat16), ``"fp32"``, or a :class:`LowBitConfig`. ``None``
                keeps the source's precision. ``"auto"``: the fastest format on this device whose perplexity stays
                within +5% of fp32's, measured once per model and device (minutes) and cached
                (:mod:`xpuspec.formats`; :attr:`format_choice`).
            load_in_4bit, load_in_8bit: aliases for the default INT4 / INT8 format.
            group_size, ratio, awq, scale_estimation: NNCF weight-compression parameters (INT4).
            ov_config: OpenVINO compile properties (optimum-intel's name).
            speculative: ``True`` (:data:`~xpuspec.speculative.config.DEFAULT_MODE`, prompt lookup: the mode
                measured fastest), ``"self"`` (an INT4 copy of the model drafts, ipex-llm's meaning), ``"layer_skip"`` (the model without some layers drafts; the layers are
                chosen by calibration and cached), ``"prompt_lookup"``, ``"hybrid"``, a draft model path or name, or a
                :class:`SpeculativeConfig`. ``generate`` then decodes speculatively; greedy output
                stays token-identical to plain greedy decoding.
            draft_low_bit: the draft's weight format (default for self-speculation: the draft backend's
                ``self_draft_low_bit``, ``int4_sym`` on OpenVINO and ``fp16`` on torch; the model's own format for
                layer-skip).
            draft_device: the draft's device (default ``$XPUSPEC_DRAFT_DEVICE``, else the target's).
            draft_backend: the draft's backend (default: the target's, where it serves the draft's device; else the
                device's own). Every draft is checked (device, format, architecture) before the target loads, and
                an error about the draft says so.
            dtype, torch_dtype: ``torch.float16`` / ``torch.bfloat16`` / ``torch.float32``, as a format when no low-bit one is given.
            pipeline_parallel_stages: split the decoder layers into this many stages (ipex-llm's name). In one
                process (OpenVINO): on ``gpu``/``xpu`` one per device (gpu.0 .. gpu.N-1), on ``cpu`` all on the CPU;
                a device list sets each stage's device. Under ``torchrun --nproc-per-node N`` (torch backend): one
                stage per process, every rank running the same script (see ``xpuspec_torch.pipeline``).
                See :attr:`device_map`.
            split: decoder layers per stage (e.g. ``[15, 15]``); default: balanced by weight bytes.
            gguf_file: a GGUF file inside the folder ``pretrained_model_name_or_path`` (transformers' argument).
            enable_prefix_caching: requests reuse the KV blocks of earlier requests' common prompt starts (vLLM's
                and openvino_genai's name; :meth:`XpuspecModelForCausalLM.set_prefix_caching`). Default off.
            force_download: (keyword) convert a GGUF file or built-in model again, even if it is cached or its
                conversion is remembered as failed (:func:`xpuspec.sources.pull`).

        Raises:
            ModelSourceError: the model cannot be found or is not a model folder.
            DeviceNotFoundError: the device is unknown or absent.
            LowBitConfigError: an invalid format, parameter, or NPU rule.
            DraftMismatchError: the draft's vocabulary differs from the target's.
            PipelineConfigError: a pipeline that cannot be built: more stages than layers, a ``split`` that
                does not fit them, a torchrun world of another size (see ``xpuspec_torch.pipeline.check_plan``).
            PipelineError: a pipeline rank was lost while loading.
            NumericsError: the loaded model's logits on a fixed sentence contain NaN or infinity (the message names
                the format; another format, e.g. fp32, fixes an fp16 overflow).
            TypeError: an unknown keyword argument.
            ValueError: ``enable_prefix_caching`` where the runner has no paged KV cache.
        """
        name = _with_gguf_file(pretrained_model_name_or_path, gguf_file)
        spec = resolve_speculative(speculative, draft_low_bit=draft_low_bit, draft_device=draft_device)
        if ov_config is not None and not isinstance(ov_config, dict):
            raise TypeError(f"ov_config must be a dict of OpenVINO properties, e.g. {{'PERFORMANCE_HINT': 'LATENCY'}}, "
                            f"got {type(ov_config).__name__} {ov_config!r}.")
        force_download = bool(kwargs.pop("force_download", False))  # transformers' name: convert a GGUF again
        if kwargs:
            raise TypeError(f"from_pretrained() got unexpected keyword arguments: {', '.join(sorted(kwargs))}.")
        weights = Weights.asked(load_in_low_bit, load_in_4bit, load_in_8bit, dtype if dtype is not None else torch_dtype,
                                group_size=group_size, ratio=ratio, awq=awq, scale_estimation=scale_estimation)
        placement = Placement.resolve(device, backend, pipeline_parallel_stages, split, spec)
        weights.check_devices(placement.devices)
        draft = _draft_placement(spec, draft_backend, placement)
        return load(LoadOptions(name, weights, placement, spec, draft, ov_config, enable_prefix_caching,
                                force_download))

    @classmethod
    def load_low_bit(cls, path, *, device: Optional[str] = None, backend: Optional[str] = None,
                     ov_config: Optional[dict] = None, speculative=None, draft_low_bit: Optional[str] = None,
                     draft_device: Optional[str] = None) -> XpuspecModelForCausalLM:
        """Load a folder written by :meth:`XpuspecModelForCausalLM.save_low_bit` (ipex-llm's name).

        ``speculative``, ``draft_low_bit`` and ``draft_device`` as for :meth:`from_pretrained`; a self or layer-skip
        draft is built from the model the folder was saved from.

        Raises:
            ModelSourceError: the folder was not written by ``save_low_bit`` or ``xpuspec export``.
            SpeculativeConfigError: a self or layer-skip draft whose original model is not found.
        """
        if resolve_source(path).saved_low_bit is None:
            raise ModelSourceError(f"{path} was not written by save_low_bit or `xpuspec export` (no low_bit in {METADATA_FILE}).")
        return cls.from_pretrained(path, device=device, backend=backend, ov_config=ov_config, speculative=speculative,
                                   draft_low_bit=draft_low_bit, draft_device=draft_device)


@dataclass(frozen=True)
class _Sources:
    """What :func:`load` reads before it loads: the target's source, a draft model's (``None`` without one), the
    source a self or layer-skip draft is built from, an EAGLE-3 head's taps, the checked pipeline split."""

    target: ModelSource
    draft: Optional[ModelSource]
    draft_origin: ModelSource
    head_taps: Optional[Sequence[int]]
    split: Optional[List[int]]


def load(options: LoadOptions) -> XpuspecModelForCausalLM:
    """Load the model ``options`` describe, in phases: find the sources, choose the format, check the backends,
    load the target, attach speculation, turn prefix caching on. Every check that needs only a config runs before
    a backend loads anything, and an error about the draft says so.

    Raises:
        as :meth:`AutoModelForCausalLM.from_pretrained`.
    """
    found = _find_sources(options)
    low_bit, choice = _choose_format(options, found.target)
    draft_format = _check_backends(options, found, low_bit)
    model = _load_target(options, found, low_bit)
    model.format_choice = choice
    if options.spec is not None:
        _attach_speculation(model, options, found, draft_format)
    if options.prefix_caching:
        model.set_prefix_caching(True)
    return model


def _find_sources(options: LoadOptions) -> _Sources:
    """Resolve the target's source (and a draft model's, checking their vocabularies), read the target's config, and
    check an EAGLE-3 head and the pipeline split against it.

    Raises:
        ModelSourceError, DraftMismatchError, PipelineConfigError, SpeculativeConfigError.
    """
    spec = options.spec
    source = resolve_source(options.name, force=options.force_download)
    config = source.config  # a config transformers cannot read fails here, before a backend loads
    head_taps = _check_eagle3_head(spec, config)  # a head that does not fit fails before the target loads
    draft_source = None
    if spec is not None and spec.draft and spec.mode != "eagle3":
        with _naming_the_draft(spec):  # a missing draft fails before the target compiles, after a missing target
            draft_source = resolve_source(spec.draft)
            check_vocabularies(source, draft_source)
    origin = _self_draft_origin(spec, source) if options.draft is not None else source
    split = check_split(options.placement.split, len(options.placement.devices), config.num_hidden_layers)
    return _Sources(source, draft_source, origin, head_taps, split)


def _choose_format(options: LoadOptions, source: ModelSource):
    """``(low_bit, format_choice)``: the format asked for, or the one ``auto`` measured (``format_choice``, else
    ``None``), fitted to the model's layer widths; ``low_bit`` is ``None`` to keep the source's precision.

    Raises:
        LowBitConfigError: ``auto`` on weights that are compressed already; a format the layers cannot take.
    """
    placement, low_bit, choice = options.placement, options.weights.low_bit, None
    identity = placement.backend.identity(placement.devices[0])
    if options.weights.auto:
        if source.saved_low_bit is not None:
            raise LowBitConfigError(f"{source.path} holds {source.saved_low_bit.format} weights already; "
                                    "load_in_low_bit='auto' needs the original model. Load that, or drop 'auto'.")
        one_device = Placement(placement.backend, placement.devices[:1])

        def candidate(fmt):
            weights = Weights.asked(fmt)
            weights.check_devices(one_device.devices)
            return load(LoadOptions(options.name, weights, one_device, ov_config=options.ov_config))

        choice = formats.auto_format(source.path, identity, candidate,
                                     lambda: AutoTokenizer.from_pretrained(options.name), options.ov_config)
        low_bit = resolve_low_bit(choice.format)
    elif low_bit is not None and not options.is_draft and low_bit == resolve_low_bit(low_bit.format):  # defaults
        formats.note_quality(source.path, identity, low_bit.format, options.ov_config)
    if low_bit is not None:
        low_bit = low_bit.fitted(decoder_in_channels(source.config), placement.devices[0])
    return low_bit, choice


def _check_backends(options: LoadOptions, found: _Sources, low_bit) -> Optional[LowBitConfig]:
    """Ask the target's backend (unsplit; a split is checked by the backend's load, which knows its stages) and the
    draft's whether they can run what was asked, before anything compiles. Returns the draft's format (``None``:
    its source's precision, or no draft model).

    Raises:
        LowBitConfigError, DeviceNotFoundError, ModelSourceError: from a backend's ``check``; a draft's error says so.
    """
    placement, spec, where = options.placement, options.spec, options.draft
    if len(placement.devices) == 1:
        placement.backend.check(found.target, placement.devices[0], low_bit)
    if where is None:
        return None
    asked = spec.draft_low_bit or _default_draft_low_bit(spec, low_bit or found.target.saved_low_bit, where.backend)
    with _naming_the_draft(spec, asked, where.device_name, where.backend.name):
        draft_format = resolve_low_bit(asked)
        Weights(draft_format).check_devices(where.devices)
        where.backend.check(found.draft or found.draft_origin, where.device_name, draft_format)
    return draft_format


def _load_target(options: LoadOptions, found: _Sources, low_bit) -> XpuspecModelForCausalLM:
    """Load the runner on the backend and check its logits on a fixed sentence.

    Raises:
        NumericsError: NaN or infinity in the logits; ModelSourceError and the backend's errors.
    """
    placement, source = options.placement, found.target
    backend, device = placement.backend, placement.devices[0]
    stages = dict(stages=placement.devices, split=found.split) if len(placement.devices) > 1 else {}
    head = _draft_head_tokens(options.draft_vocab_size, backend, device, source)
    try:
        runner = backend.load(source, device, low_bit, ov_config=options.ov_config, **stages,
                              **({} if head is None else {"head_tokens": head}))
    except ModelSourceError as exc:
        if head is None or options.draft_vocab_size is not None:  # not the default cut: the user asked for it
            raise
        log.info("the draft's LM head stays whole: %s", exc)
        runner = backend.load(source, device, low_bit, ov_config=options.ov_config, **stages)
    if low_bit is None:
        low_bit = source.saved_low_bit
    check_loaded(runner, source.path, f"{source.name} in {low_bit.format if low_bit else 'its source precision'} "
                                      f"on {placement.device_name} ({backend.name} backend)",
                 low_bit)
    log.info("loaded %s on %s (%s backend)", source.name, placement.device_name, backend.name)
    return XpuspecModelForCausalLM(source, backend, placement.device_name, runner, low_bit)


def _attach_speculation(model: XpuspecModelForCausalLM, options: LoadOptions, found: _Sources,
                        draft_format: Optional[LowBitConfig]) -> None:
    """Give ``model`` its speculative config and its EAGLE-3 head or draft model, prepare what the first speculative
    request would otherwise set up, and record the memory that speculation added (``draft_memory_bytes``)."""
    spec = options.spec
    model.speculative_config = spec
    before = rss_bytes()
    if found.head_taps is not None:
        model.eagle3_head = _load_eagle3_head(spec, found.head_taps, found.target, model.runner)
    elif options.draft is not None:
        model.draft_model = _load_draft(model, options, found, draft_format)
    model._prepare_speculation()
    after = rss_bytes()
    model.draft_memory_bytes = None if before is None or after is None else max(0, after - before)
    weights = model.draft_model.runner.weight_bytes if model.draft_model is not None else 0
    log.info("speculative mode %s on %s: %s of extra memory (draft weights %.1f MiB)", spec.mode,
             (options.draft or options.placement).device_name,
             "unknown" if model.draft_memory_bytes is None else f"{model.draft_memory_bytes / 2**20:.1f} MiB",
             weights / 2**20)


def _load_draft(model: XpuspecModelForCausalLM, options: LoadOptions, found: _Sources,
                draft_format: Optional[LowBitConfig]) -> XpuspecModelForCausalLM:
    """Load the draft model (a layer-skip draft from its calibrated folder), check it against ``model``, and wrap its
    runner so that the policy can release it and load it again."""
    spec, where = options.spec, options.draft
    with ExitStack() as stack:
        if spec.mode == "layer_skip":  # a calibrated folder that no draft loads from is removed again
            draft_from = stack.enter_context(layer_skip_draft(found.draft_origin, spec.skip_layers))
        else:
            draft_from = spec.draft or (options.name if found.draft_origin is found.target else found.draft_origin.path)
        draft_options = LoadOptions(str(draft_from), Weights(draft_format), where, ov_config=options.ov_config,
                                    draft_vocab_size=spec.draft_vocab_size, is_draft=True)
        with _naming_the_draft(spec, draft_format, where.device_name, where.backend.name):
            start = time.perf_counter()
            draft = load(draft_options)
            load_s = time.perf_counter() - start
        check_draft(model, draft)

    def reload_draft():
        runner = load(draft_options).runner
        if model.prefix_caching and hasattr(runner, "set_prefix_caching"):
            runner.set_prefix_caching(True)
        return runner

    draft.runner = ReleasableRunner(draft.runner, reload_draft, f"draft model {draft.name_or_path}", load_s)
    return draft


def _draft_placement(spec: Optional[SpeculativeConfig], draft_backend: Optional[str],
                     placement: Placement) -> Optional[Placement]:
    """Where the draft model runs (``None`` without one): ``draft_backend`` (a backend name), else the target's
    backend where it serves the draft's device, else the backend that serves it. Checked before the target loads.

    Raises:
        DeviceNotFoundError: no backend (or not ``draft_backend``) serves the draft's device.
        SpeculativeConfigError: ``draft_backend`` without a draft model.
    """
    if spec is None or not spec.uses_model or spec.mode == "eagle3":
        if draft_backend is not None:
            raise SpeculativeConfigError(
                f"draft_backend={draft_backend!r} given without a draft model: add speculative='self' (or another "
                "mode with a draft model), or drop draft_backend.")
        return None
    with _naming_the_draft(spec):
        device = spec.resolved_draft_device or placement.devices[0]
        if draft_backend is not None:
            backend, name = resolve_device(device, draft_backend)
        else:
            try:
                backend, name = resolve_device(device, placement.backend.name)
            except DeviceNotFoundError:
                backend, name = resolve_device(device)
        resolve_low_bit(spec.draft_low_bit)
    return Placement(backend, [name])


def _check_eagle3_head(spec: Optional[SpeculativeConfig], config):
    """The taps of ``spec``'s EAGLE-3 head, checked against the target's ``config`` (``None`` without a head).

    Raises:
        DraftMismatchError: the head's hidden size, vocabulary or taps do not fit the target.
        ModelSourceError: no head at the path.
    """
    if spec is None or spec.mode != "eagle3":
        return None
    from .speculative.eagle3 import check_head_for

    return check_head_for(spec.draft, config)


def _load_eagle3_head(spec: SpeculativeConfig, taps, source, runner):
    """Load the head (its embeddings from the target's safetensors where the head has none) in its drafting format
    (``spec.draft_low_bit``, default int8) and make the target's runner keep the tapped layers' hidden states."""
    from .speculative.eagle3 import HEAD_FORMATS, Eagle3Head, read_head, target_embeddings

    head = Eagle3Head.load(read_head(spec.draft), taps, lambda: target_embeddings(source.path))
    head.quantized(spec.draft_low_bit or HEAD_FORMATS[0])
    runner.set_taps(taps)
    return head


def _with_gguf_file(name_or_path, gguf_file: Optional[str]):
    """``name_or_path`` joined with transformers' ``gguf_file`` argument (a file inside that folder), if given.

    Raises:
        ModelSourceError: no such GGUF file in the folder.
    """
    if gguf_file is None:
        return name_or_path
    path = Path(str(name_or_path)).expanduser() / str(gguf_file)
    if not path.is_file():
        raise ModelSourceError(f"gguf_file={str(gguf_file)!r}: no such file in {str(name_or_path)!r} ({path}).")
    return str(path)


def _draft_head_tokens(size: Optional[int], backend, device: str, source) -> Optional[List[int]]:
    """The token ids a draft's cut LM head scores (:mod:`xpuspec.speculative.vocab`), or ``None`` for the whole
    vocabulary. ``size``: a draft's ``SpeculativeConfig.draft_vocab_size`` (``None``: the default cut, which a
    head that cannot be cut skips with a log line), 0 for the whole vocabulary and for every model that is no draft.

    Raises:
        SpeculativeConfigError: a ``draft_vocab_size`` the draft's backend cannot apply on ``device``.
    """
    vocab = source.config.vocab_size
    if size is None:
        size = DEFAULT_DRAFT_VOCAB_SIZE if backend.can_cut_head(device) and vocab >= 2 * DEFAULT_DRAFT_VOCAB_SIZE else 0
    if size == 0 or size >= vocab:
        return None
    if not backend.can_cut_head(device):
        raise SpeculativeConfigError(
            f"draft_vocab_size={size}: the {backend.name} backend cannot cut the draft's LM head on {device}. "
            "Set draft_vocab_size=0 (the whole vocabulary), or run the draft on an OpenVINO CPU or GPU device.")
    return frequent_tokens(source.path, size, vocab)


def _self_draft_origin(spec: SpeculativeConfig, source):
    """The source a self or layer-skip draft is built from: ``source``, or, where it is an IR that xpuspec saved
    compressed (``save_low_bit``, ``xpuspec export``), the model it was saved from, when that is still found.

    Raises:
        SpeculativeConfigError: the saved model's origin is not found (its weights cannot be compressed again).
    """
    saved = source.saved_low_bit
    if spec.draft or saved is None or saved.format == "fp32":
        return source
    origin = source.metadata.get("source")
    try:
        found = resolve_source(origin) if origin else None
    except ModelSourceError:
        found = None
    if found is None or found.saved_low_bit is not None:
        raise SpeculativeConfigError(
            f"speculative mode {spec.mode!r} builds its draft from the original weights, but {source.path} holds "
            f"{saved.format} weights saved from {origin!r}, which is not found here. Load the original model with "
            "speculative=..., or use speculative='prompt_lookup' or a separate draft model (speculative='<path>').")
    return found


def _default_draft_low_bit(spec: SpeculativeConfig, target_low_bit, draft_backend):
    """The draft backend's self-draft format (INT4 on OpenVINO) for a self-draft, the target's own format for
    layer-skip, the source's for a draft model."""
    if spec.mode == "layer_skip":
        return target_low_bit
    return None if spec.draft else draft_backend.self_draft_low_bit


@contextmanager
def _naming_the_draft(spec: SpeculativeConfig, fmt=None, device: Optional[str] = None,
                      backend: Optional[str] = None):
    """Re-raise an xpuspec error of the block as the same type, its message saying it is about the draft."""
    try:
        yield
    except XpuspecError as exc:
        what = spec.draft or {"self": "a low-bit copy of the model", "layer_skip": "the model without some layers",
                              "hybrid": "a low-bit copy of the model"}.get(spec.mode, spec.mode)
        fmt = fmt.format if isinstance(fmt, LowBitConfig) else fmt
        where = ", ".join(filter(None, (fmt and f"in {fmt}", device and f"on {device}",
                                        backend and f"{backend} backend")))
        try:
            renamed = type(exc)(f"The draft of speculative={spec.mode!r} ({what}{', ' + where if where else ''}) "
                                f"cannot load: {exc} Or change the draft: draft_low_bit=, draft_device=, "
                                "draft_backend=, or another speculative mode.")
        except TypeError:  # an error type with another constructor: keep it as it is
            raise exc from None
        raise renamed from exc


class AutoTokenizer:
    """Drop-in for ``transformers.AutoTokenizer`` that also resolves built-in model names, IR folders and GGUF files
    (the tokenizer of the converted folder; ``gguf_file=`` as in transformers)."""

    def __init__(self):
        raise EnvironmentError("Use AutoTokenizer.from_pretrained(...).")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Return ``transformers.AutoTokenizer.from_pretrained`` on the resolved folder.

        Raises:
            ModelSourceError: the model cannot be found, or its folder has no tokenizer files.
        """
        from transformers import AutoTokenizer as HFAutoTokenizer

        source = resolve_source(_with_gguf_file(pretrained_model_name_or_path, kwargs.pop("gguf_file", None)))
        check_tokenizer_files(source.path, source.name)
        return HFAutoTokenizer.from_pretrained(source.path, *args, **kwargs)
