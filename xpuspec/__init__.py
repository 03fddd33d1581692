"""xpuspec: Hugging Face causal-LM code, fast on Intel hardware, by changing one import.

    from xpuspec import AutoModelForCausalLM, AutoTokenizer

The names that need torch are imported on first use (PEP 562), so ``import xpuspec.cli``
stays light: the ``xpuspec`` command starts at once, and a Ctrl-C while torch loads ends it cleanly.
"""

import importlib

from .errors import (
    BackendUnavailableError,
    BatchNotSupportedError,
    CacheNotWritableError,
    CorpusError,
    DeviceNotFoundError,
    DiskFullError,
    DraftMismatchError,
    GenerationConfigError,
    GGUFTokenizerError,
    InvalidInputError,
    KVBudgetError,
    LowBitConfigError,
    ModelSourceError,
    OutputExistsError,
    PipelineConfigError,
    PipelineError,
    PromptTooLongError,
    ResponseFormatError,
    PullError,
    NumericsError,
    SpeculativeConfigError,
    UnsupportedArchitectureError,
    XpuspecError,
)
from .export import export
from .lowbit import FORMATS, LowBitConfig
from .sources import BUILTIN_MODELS, pull
from .version import __version__  # noqa: F401 - the package's version

#: Names imported on first use -> the submodule that defines them (they import torch).
_LAZY = {"AutoModelForCausalLM": "loading", "AutoTokenizer": "loading", "XpuspecModelForCausalLM": "modeling",
         "SpeculativeConfig": "speculative.config", "evaluate": "evaluation"}

__all__ = [
    "AutoModelForCausalLM", "AutoTokenizer", "XpuspecModelForCausalLM", "LowBitConfig", "FORMATS",
    "BUILTIN_MODELS", "pull", "export", "evaluate", "XpuspecError", "DeviceNotFoundError", "BackendUnavailableError",
    "ModelSourceError", "LowBitConfigError", "PullError", "CorpusError", "OutputExistsError", "DraftMismatchError",
    "InvalidInputError", "PromptTooLongError", "ResponseFormatError", "GenerationConfigError", "UnsupportedArchitectureError",
    "PipelineConfigError", "PipelineError", "SpeculativeConfig", "SpeculativeConfigError", "KVBudgetError",
    "BatchNotSupportedError", "NumericsError", "DiskFullError", "CacheNotWritableError", "GGUFTokenizerError",
]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'xpuspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
