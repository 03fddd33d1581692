"""Low-bit weight policy: format names, NNCF parameters, group-size fitting, NPU rules.

This module decides *what* to compress and how; a backend applies it with
``nncf.compress_weights`` (OpenVINO plugin). Weight-only compression: activations
and the KV cache keep their precision.
"""

import logging
import numbers
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Optional

from .errors import LowBitConfigError

log = logging.getLogger("xpuspec")

#: Every accepted ``load_in_low_bit`` value.
FORMATS = ("int4_sym", "int4_asym", "int8_sym", "int8_asym", "fp16", "bf16", "fp32")
#: Format chosen by ``load_in_4bit=True`` / ``load_in_8bit=True``.
DEFAULT_4BIT = "int4_asym"
DEFAULT_8BIT = "int8_asym"
#: Group sizes tried, largest first, when the requested one does not divide a layer.
FALLBACK_GROUP_SIZES = (128, 64, 32)
DEFAULT_INT4_GROUP_SIZE = 128
CHANNEL_WISE = -1


@dataclass(frozen=True)
class LowBitConfig:
    """Weight-compression settings for one model.

    Attributes:
        format: one of :data:`FORMATS`. ``bf16`` runs where the backend and device compute in bfloat16 (OpenVINO:
            CPUs whose plugin reports the ``BF16`` capability, i.e. AVX512-BF16 or AMX; torch: any device).
        group_size: INT4 quantisation group along the input channels; ``-1`` is
            channel-wise. ``None`` means 128 for INT4. INT8 is always channel-wise.
        ratio: fraction of the INT4-eligible layers compressed to INT4, the rest
            go to INT8 (NNCF's ``ratio``), in (0, 1].
        awq: NNCF's data-aware AWQ (INT4 only; calibrated on built-in text).
        scale_estimation: NNCF's data-aware scale estimation (INT4 only).
    """

    format: str
    group_size: Optional[int] = None
    ratio: float = 1.0
    awq: bool = False
    scale_estimation: bool = False

    def __post_init__(self):
        if self.format not in FORMATS:
            raise LowBitConfigError(
                f"Unknown low-bit format {self.format!r}. Choose one of: {', '.join(FORMATS)}."
            )
        if self.group_size is not None:
            if isinstance(self.group_size, bool) or not isinstance(self.group_size, numbers.Integral):
                raise LowBitConfigError(f"group_size must be an integer (or -1, channel-wise), got {self.group_size!r}.")
            object.__setattr__(self, "group_size", int(self.group_size))  # a NumPy integer too
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, numbers.Real):
            raise LowBitConfigError(f"ratio must be a number in (0, 1], got {self.ratio!r}.")
        for flag in ("awq", "scale_estimation"):
            if not isinstance(getattr(self, flag), bool):
                raise LowBitConfigError(f"{flag} must be True or False, got {getattr(self, flag)!r}.")
        if not self.is_int4:
            if self.group_size not in (None, CHANNEL_WISE):
                raise LowBitConfigError(
                    f"group_size={self.group_size} applies to INT4 only; {self.format} is channel-wise. "
                    "Drop group_size or pick an int4 format."
                )
            if self.ratio != 1.0 or self.awq or self.scale_estimation:
                raise LowBitConfigError(
                    f"ratio, awq and scale_estimation apply to INT4 only, not {self.format}."
                )
        elif self.group_size is not None and self.group_size != CHANNEL_WISE and self.group_size <= 0:
            raise LowBitConfigError(
                f"group_size must be a positive integer or -1 (channel-wise), got {self.group_size}."
            )
        if not 0.0 < self.ratio <= 1.0:
            raise LowBitConfigError(f"ratio must be in (0, 1], got {self.ratio}.")

    @property
    def is_int4(self) -> bool:
        return self.format.startswith("int4")

    @property
    def is_float(self) -> bool:
        return self.format in ("fp16", "bf16", "fp32")

    @property
    def symmetric(self) -> bool:
        return self.format.endswith("_sym")

    def fitted(self, in_channels: Iterable[int], device: str = "cpu") -> "LowBitConfig":
        """Return a copy whose group size divides every layer's input channels.

        Args:
            in_channels: the input-channel counts of the compressed linear layers
                (for a decoder: hidden size, MLP intermediate size, heads x head_dim).
            device: target device; ``npu`` enforces the NPU rules.

        The requested group size (default 128) is kept if it divides every entry.
        Otherwise the largest of 128, 64 and 32 that divides them all is used, or
        channel-wise if none does, and one INFO line says so. On NPU only 128 and
        channel-wise are allowed, and INT4 must be symmetric.

        Raises:
            LowBitConfigError: an NPU rule is broken (asymmetric INT4, or an explicit
                group size other than 128 / -1).
        """
        self.check_device(device)
        if not self.is_int4:
            return self
        npu = device.lower().startswith("npu")
        requested = DEFAULT_INT4_GROUP_SIZE if self.group_size is None else self.group_size
        if requested == CHANNEL_WISE:
            return replace(self, group_size=CHANNEL_WISE)
        channels = sorted(set(in_channels))
        if all(c % requested == 0 for c in channels):
            return replace(self, group_size=requested)
        candidates = (DEFAULT_INT4_GROUP_SIZE,) if npu else FALLBACK_GROUP_SIZES
        fitted = next((g for g in candidates if all(c % g == 0 for c in channels)), CHANNEL_WISE)
        log.debug(  # shown with -vv; model.low_bit.group_size holds the group size used
            "group_size %d does not divide input channels %s; using %s",
            requested, channels, "channel-wise" if fitted == CHANNEL_WISE else fitted,
        )
        return replace(self, group_size=fitted)

    def check_device(self, device: str) -> None:
        """Raise :class:`LowBitConfigError` if these settings break ``device``'s rules (NPU: INT4 must be
        symmetric, with group size 128 or channel-wise)."""
        if not (self.is_int4 and device.lower().startswith("npu")):
            return
        if not self.symmetric:
            raise LowBitConfigError(
                f"NPU runs INT4 weights only as symmetric: use load_in_low_bit='int4_sym' instead of {self.format!r}."
            )
        if self.group_size not in (None, DEFAULT_INT4_GROUP_SIZE, CHANNEL_WISE):
            raise LowBitConfigError(f"NPU needs INT4 group size 128 or -1 (channel-wise), got {self.group_size}.")

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_low_bit(
    load_in_low_bit: Optional[str] = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    **params,
) -> Optional[LowBitConfig]:
    """Turn the ``from_pretrained`` keyword arguments into a :class:`LowBitConfig` or ``None``.

    ``load_in_4bit`` / ``load_in_8bit`` keep their transformers / ipex-llm meaning
    and map to :data:`DEFAULT_4BIT` / :data:`DEFAULT_8BIT`. ``params`` are the other
    :class:`LowBitConfig` fields (``group_size``, ``ratio``, ``awq``, ``scale_estimation``).

    Raises:
        LowBitConfigError: conflicting flags or an invalid format or parameter.
    """
    chosen = [f for f, on in ((load_in_low_bit, load_in_low_bit is not None),
                              (DEFAULT_4BIT, load_in_4bit), (DEFAULT_8BIT, load_in_8bit)) if on]
    params = {k: v for k, v in params.items() if v is not None}
    if len(chosen) > 1:
        raise LowBitConfigError(
            "Give only one of load_in_low_bit=, load_in_4bit=True and load_in_8bit=True."
        )
    if not chosen:
        if params:
            raise LowBitConfigError(
                f"{', '.join(sorted(params))} given without a low-bit format: add load_in_low_bit='int4_asym' (or another)."
            )
        return None
    if isinstance(chosen[0], LowBitConfig):
        return replace(chosen[0], **params)
    return LowBitConfig(format=str(chosen[0]).lower(), **params)


def decoder_in_channels(config) -> list:
    """Input-channel counts of a decoder's linear layers, from its HF config."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    return [hidden, config.intermediate_size, config.num_attention_heads * head_dim]
