"""xpuspec: Hugging Face causal-LM code, fast on Intel hardware, by changing one import.

    from xpuspec import AutoModelForCausalLM, AutoTokenizer
"""

from .errors import (
    BackendUnavailableError,
    CorpusError,
    DeviceNotFoundError,
    DraftMismatchError,
    LowBitConfigError,
    ModelSourceError,
    OutputExistsError,
    PullError,
    XpuspecError,
)
from .evaluation import evaluate
from .export import export
from .lowbit import FORMATS, LowBitConfig
from .modeling import AutoModelForCausalLM, AutoTokenizer, XpuspecModelForCausalLM
from .sources import BUILTIN_MODELS, pull
from .speculative.config import SpeculativeConfig

__version__ = "0.1.0"

__all__ = [
    "AutoModelForCausalLM", "AutoTokenizer", "XpuspecModelForCausalLM", "LowBitConfig", "FORMATS",
    "BUILTIN_MODELS", "pull", "export", "evaluate", "XpuspecError", "DeviceNotFoundError", "BackendUnavailableError",
    "ModelSourceError", "LowBitConfigError", "PullError", "CorpusError", "OutputExistsError", "DraftMismatchError",
    "SpeculativeConfig",
]
