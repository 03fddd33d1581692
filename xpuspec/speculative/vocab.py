"""A draft's LM head cut to the most frequent tokens (FR-Spec).

A draft model spends much of each step in its LM head when the vocabulary is large: Qwen2.5-0.5B's
head is 151936 x 896, 42% of the bytes an int4 step reads. A draft whose head scores only the N most
frequent tokens reads fewer bytes per step and proposes the same token wherever the target's next token
is among them; where it is not, the draft misses and the target's verify pass gives the token, so
greedy output stays the target's own. Under sampling the draft distribution is the softmax over the N
tokens (0 elsewhere), and rejection sampling stays exact for any draft distribution (Leviathan et al.
2023). Source: Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling".

Frequencies are counted once per tokenizer over the Python standard library's own sources (the
running interpreter's ``Lib/``, tests, installed packages and ``pydoc_data`` left out: code with English
docstrings and comments, about 3 M tokens) and cached under ``<cache>/vocab/``. On text that is not counted
(``pydoc_data.topics``, the HumanEval prompts) the 32768 most frequent Qwen2.5 tokens cover about 97-99% of the
tokens, more than the 32768 lowest ids do, and cut a 0.5B draft's step by about a sixth
(benchmarks/results/HISTORY.md).
"""

import json
import logging
import sysconfig
from collections import Counter
from pathlib import Path
from typing import List

from ..cache import cache_root, digest, file_sha256, write_text_atomic

log = logging.getLogger("xpuspec")

#: Tokens a cut draft head scores by default (FR-Spec's choice for Llama-3's 128k vocabulary, too).
DEFAULT_DRAFT_VOCAB_SIZE = 32768


#: Parts of the standard library left out of the count: tests, installed packages, and ``pydoc_data`` (the
#: documentation text the benchmark's prose prompts come from, :mod:`xpuspec.bench.prompts`).
_LEFT_OUT = ("site-packages", "dist-packages", "pydoc_data")


def _corpus_files() -> List[Path]:
    """The standard library's Python sources but :data:`_LEFT_OUT`, in a stable order."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in lib.rglob("*.py")
                  if not any(part in _LEFT_OUT or part.startswith("test") for part in p.relative_to(lib).parts))


def token_ranking(tokenizer_folder) -> List[int]:
    """Every token id of the tokenizer in ``tokenizer_folder``, most frequent first: the special and added
    tokens (end of sequence and chat markers), then by count over the corpus of the module docstring,
    then by id. Counted on first use and cached.

    Raises:
        OSError: the folder has no tokenizer transformers can load.
    """
    from transformers import AutoTokenizer

    folder = Path(tokenizer_folder)
    key = digest(sorted((p.name, file_sha256(p)) for p in folder.glob("tokenizer*.json")),
                 sysconfig.get_python_version(), _LEFT_OUT)
    cached = cache_root() / "vocab" / f"{key}.json"
    if cached.is_file():
        try:
            return json.loads(cached.read_text())
        except ValueError:  # a damaged file (a copy cut short): count again
            log.warning("token ranking %s is damaged; counting again", cached)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    counts = Counter()
    for path in _corpus_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        counts.update(tokenizer(text, add_special_tokens=False).input_ids)
    first = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    ranking = sorted(range(len(tokenizer)), key=lambda i: (i not in first, -counts[i], i))
    write_text_atomic(cached, json.dumps(ranking), "recording the draft's token ranking")
    return ranking


def frequent_tokens(tokenizer_folder, size: int, vocab_size: int) -> List[int]:
    """The ``size`` most frequent token ids (:func:`token_ranking`) below ``vocab_size`` (the head's rows), sorted.

    Raises:
        ValueError: ``size`` < 1.
    """
    if size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1 (or 0 for the whole vocabulary), got {size}.")
    return sorted([i for i in token_ranking(tokenizer_folder) if i < vocab_size][:size])
