"""Checks that a Hugging Face model folder is whole before anything loads it: a readable
config.json and weight files that are present and, for safetensors, not truncated."""

import json
import struct
from pathlib import Path
from typing import Optional

from .errors import ModelSourceError

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_damage(path: Path) -> Optional[str]:
    """Why a ``.safetensors`` file is unreadable or truncated (a sentence), or ``None`` if it is whole.

    Reads only the header: its length, its JSON, and the end offset of the last tensor,
    which must equal the data size.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                return f"{path.name} is truncated (its header alone claims {header_len} bytes)"
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError) as exc:
        return f"{path.name} is not a safetensors file ({type(exc).__name__})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return f"{path.name} is truncated: {size} bytes, {expected} expected"
    return None


def check_hf_folder(path: Path, name: str) -> None:
    """Refuse a Hugging Face folder whose config or weights are broken.

    Raises:
        ModelSourceError: config.json is not a JSON object with ``model_type``; no weight files
            (``*.safetensors`` or ``pytorch_model*.bin``); a shard named in the index is missing;
            a safetensors file is truncated or not safetensors.
    """
    fix = "Copy the complete model folder again (or pull it again: `xpuspec pull NAME --force`)."
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{name!r}: config.json is not valid JSON ({exc}). {fix}") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelSourceError(f"{name!r}: config.json has no model_type, so it is not a transformers config. {fix}")
    safetensors = sorted(path.glob("*.safetensors"))
    if not safetensors and not list(path.glob("pytorch_model*.bin")):
        raise ModelSourceError(
            f"{name!r} has config.json but no weights (model.safetensors or pytorch_model.bin). {fix}")
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError) as exc:
            raise ModelSourceError(f"{name!r}: {SAFETENSORS_INDEX} is unreadable ({exc}). {fix}") from exc
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelSourceError(f"{name!r}: weight shards {', '.join(missing)} are missing. {fix}")
    for file in safetensors:
        damage = safetensors_damage(file)
        if damage:
            raise ModelSourceError(f"{name!r}: {damage}. {fix}")


#: Files that carry a tokenizer's vocabulary, in the formats transformers reads.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                         "sentencepiece.bpe.model")


def check_tokenizer_files(path: Path, name: str) -> None:
    """Refuse a folder without a tokenizer vocabulary (transformers would build an empty 3-token tokenizer).

    Raises:
        ModelSourceError: none of :data:`TOKENIZER_VOCAB_FILES` is in ``path``.
    """
    if not any((path / f).is_file() for f in TOKENIZER_VOCAB_FILES):
        raise ModelSourceError(
            f"{name!r} has no tokenizer (none of {', '.join(TOKENIZER_VOCAB_FILES)}). Copy tokenizer.json and "
            "tokenizer_config.json from the original model into it, or export it again with `xpuspec export`, "
            "which writes them.")
