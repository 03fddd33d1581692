"""Exception types. Each names what is wrong and how to fix it.

Every type also derives from the built-in exception a transformers user would
catch for the same mistake (``ValueError``, ``FileNotFoundError``, ...).
"""


class XpuspecError(Exception):
    """Base class of every error xpuspec raises on purpose."""


class DeviceNotFoundError(XpuspecError, ValueError):
    """The requested device is unknown, absent on this machine, or served by no loaded backend."""


class BackendUnavailableError(XpuspecError, RuntimeError):
    """A backend plugin is installed but cannot run here (for example IPEX without its wheel)."""


class ModelSourceError(XpuspecError, FileNotFoundError):
    """A model path, hub id or built-in name does not lead to a loadable model."""


class LowBitConfigError(XpuspecError, ValueError):
    """A low-bit format or its parameters are invalid, or break a device's rules (NPU)."""


class PullError(XpuspecError, RuntimeError):
    """``xpuspec pull`` failed: download, checksum, conversion or the plausibility gate."""


class CorpusError(XpuspecError, RuntimeError):
    """The evaluation text could not be had: the HumanEval download or its checksum failed."""


class OutputExistsError(XpuspecError, FileExistsError):
    """An output folder exists and is not empty, and ``force`` was not given."""


class DraftMismatchError(XpuspecError, ValueError):
    """A draft model cannot draft for this target: another vocabulary or other special tokens."""


class InvalidInputError(XpuspecError, ValueError):
    """``input_ids`` or ``attention_mask`` is malformed: empty, not integer ids, ids outside the
    vocabulary, or a mask whose shape differs from the ids'."""


class PromptTooLongError(InvalidInputError):
    """The prompt does not fit the model's context, or the NPU's static prompt window."""


class GenerationConfigError(XpuspecError, ValueError):
    """A generation argument has an invalid value (``max_new_tokens < 1``, sampling at temperature 0, ...)."""


class ResponseFormatError(XpuspecError, ValueError):
    """A ``response_format`` that cannot constrain output: an unknown type, a missing field, a JSON schema that is not
    valid or not supported, a grammar or regex that does not compile (the message names the problem)."""


class SpeculativeConfigError(XpuspecError, ValueError):
    """Speculative-decoding settings that cannot work together: an unknown mode, a draft length below 1,
    an unknown schedule, n-gram sizes out of order, overlap without a draft model."""


class UnsupportedArchitectureError(XpuspecError, ValueError):
    """The model's architecture cannot be exported to OpenVINO IR by the installed optimum-intel."""


class PipelineConfigError(XpuspecError, ValueError):
    """A layer-split pipeline cannot be built as asked: more stages than layers, a split that does not
    sum to the layers, a world size other than the number of stages, or an unsupported architecture."""


class PipelineError(XpuspecError, RuntimeError):
    """A multi-process pipeline failed while it ran: a rank was lost (crashed, killed, timed out),
    or the ranks' decode loops diverged."""


class KVBudgetError(XpuspecError, MemoryError):
    """A request's KV-cache blocks do not fit the KV budget set on the model's runner (``set_kv_budget``): the
    message names the budget, what the request needs, and what to change (a larger budget, a shorter prompt or
    ``max_new_tokens``, a smaller batch)."""


class BatchNotSupportedError(XpuspecError, NotImplementedError):
    """No longer raised: since every request is a row of the one engine, a batch on a runner of one sequence (the
    torch backend, pipeline stages, the NPU) runs its rows one after another. Kept so that code catching it still
    imports."""


class NumericsError(XpuspecError, FloatingPointError):
    """A model's logits contain NaN or infinity in the format it was loaded in (fp16 activations that overflow,
    damaged weights): its output would be garbage, so it is refused rather than used."""


class DiskFullError(XpuspecError, OSError):
    """The disk ran out of space while xpuspec wrote into a folder (``errno.ENOSPC``): the message names the folder,
    the space the step needs and what is free; what the step had written is removed."""

    def __init__(self, message: str, folder=None):
        super().__init__(message)
        self.errno, self.filename = 28, None if folder is None else str(folder)  # errno.ENOSPC

    def __str__(self) -> str:
        return self.args[0]


class CacheNotWritableError(XpuspecError, PermissionError):
    """Something must be written into xpuspec's cache (a conversion, an export, a measurement) and its folder cannot
    be written (a read-only file system or mount, no permission): the message names the folder and
    ``XPUSPEC_CACHE``. A cache that already holds everything a load needs is read without writing."""

    def __init__(self, message: str, folder=None):
        super().__init__(message)
        self.errno, self.filename = 30, None if folder is None else str(folder)  # errno.EROFS

    def __str__(self) -> str:
        return self.args[0]


class GGUFTokenizerError(PullError):
    """The tokenizer converted from a GGUF file encodes text differently from the tokenizer its own metadata describes
    (vocabulary, scores or merges, token types, BOS/EOS, pre-tokenizer), and rebuilding it from that metadata did not
    fix it: the message names the text, the first differing token and both ids."""
