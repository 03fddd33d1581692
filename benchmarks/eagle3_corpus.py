"""Write a training corpus for ``xpuspec train-draft`` from text on this machine that no benchmark judges with.

The rows (a ``.jsonl`` file) come from the Python standard library's own source and docstrings (raw text to
continue: ``{"prompt": ...}``), and from instruction templates over a fixed list of topics (chat rows:
``{"messages": [{"role": "user", ...}]}``, which ``train-draft`` renders with the target's chat template); the target
then continues or answers each one (``train-draft --continue-tokens N``), so the head learns the target's own
outputs (self-distillation).

Kept out, so that a head trained on this corpus can be judged on the benchmarks' text:
- the held-out news reports (the Lee corpus, ``heldout``), HumanEval (``code``) and ``pydoc_data.topics`` (``prose``);
- every standard-library module the ``edit`` and ``session`` prompt sets take functions from;
- the standard library's tests, and its ``pydoc_data`` and ``idlelib`` folders.

Usage::

    python benchmarks/eagle3_corpus.py --out /tmp/eagle3-corpus.jsonl [--count 960]

The corpus is fixed by ``--seed``: the same machine's Python gives the same file.
"""

import argparse
import ast
import json
import os
import random
import sysconfig
from pathlib import Path

from xpuspec.bench.prompts import EDIT_FUNCTIONS, SESSION_EDIT_CHAINS, SESSION_TRANSFORM_CHAINS

SKIP_DIRS = {"test", "tests", "pydoc_data", "idlelib", "site-packages", "lib2to3", "turtledemo", "ensurepip"}
SKIP_MODULES = {m for m, *_ in EDIT_FUNCTIONS} | {m for m, _ in SESSION_EDIT_CHAINS + SESSION_TRANSFORM_CHAINS}

TOPICS = (
    "a new bridge opening in a small town", "a drought affecting farmers", "a local football club winning a cup",
    "a museum exhibition of old maps", "rising rents in a large city", "a volunteer rescue at sea",
    "a school that bans phones", "a breakthrough in battery research", "a storm that closes an airport",
    "an election for a city mayor", "a factory closing after fifty years", "a new public library",
    "a rare bird seen in a park", "a train strike", "a charity marathon", "a wildfire near a village",
    "a startup that recycles plastic", "a record harvest of apples", "a hospital hiring more nurses",
    "a city planting ten thousand trees", "a power cut across a region", "a festival of street music",
    "a lighthouse keeper", "a lost dog that finds its way home", "two sisters who open a bakery",
    "a robot that learns to paint", "a sailor in a storm", "an old clockmaker", "a child who finds a map",
    "a detective in a rainy city", "a village on a mountain", "a journey across a desert",
    "how rainbows form", "why the sky is blue", "how vaccines work", "the water cycle",
    "how a bicycle stays upright", "what inflation is", "how bees make honey", "how a compiler works",
    "what a hash table is", "how the internet routes packets", "photosynthesis", "the causes of earthquakes",
    "how to plan a vegetable garden", "how to learn a new language", "how to write a good email",
    "the history of the printing press", "the life of a honeybee colony", "how tides work",
)

TEMPLATES = (
    "Write a short news report about {topic}.",
    "Write a news article about {topic}. Include a quote from a local official.",
    "Tell a short story about {topic}.",
    "Write the opening paragraph of a novel about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Write a short encyclopedia entry about {topic}.",
    "Write a blog post about {topic}.",
    "Describe {topic} in three paragraphs.",
)

CODE_TASKS = (
    "reverses the words in a sentence", "checks whether a string is a palindrome", "merges two sorted lists",
    "counts the vowels in a string", "returns the n-th prime number", "flattens a nested list",
    "parses a date written as YYYY-MM-DD", "computes the median of a list", "removes duplicates keeping order",
    "converts Celsius to Fahrenheit", "finds the longest common prefix of strings", "validates an email address",
    "reads a CSV file into a list of dicts", "computes a moving average", "groups words by their first letter",
    "returns the factorial of n iteratively", "implements binary search", "rotates a matrix by 90 degrees",
    "counts word frequencies in a text", "checks balanced parentheses", "computes the GCD of two numbers",
    "converts a number to Roman numerals", "chunks a list into pieces of size n", "transposes a matrix",
)

CODE_TEMPLATES = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Add a docstring and a short example.",
    "# Python 3\n# A function that {task}.\ndef ",
)


def stdlib_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if parts & SKIP_DIRS or path.stem in SKIP_MODULES or path.stem.startswith("test"):
            continue
        yield path


def docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and 300 <= len(doc) <= 1500:
                yield doc


def _ask(instruction: str, kind: str) -> dict:
    """An instruction as a chat row: ``train-draft`` renders it with the target's chat template and the target
    answers it (given as raw text, an instruct model often ends its turn at once)."""
    return {"messages": [{"role": "user", "content": instruction}], "kind": kind}


def prompts(seed: int, count: int):
    rng = random.Random(seed)
    code, docs = [], []
    for path in stdlib_files():
        text = path.read_text(errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        docs += list(docstrings(tree))
        lines = text.splitlines()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.end_lineno - node.lineno >= 6:
                code.append("\n".join(lines[node.lineno - 1:node.lineno + 11]))
    rng.shuffle(code)
    rng.shuffle(docs)
    made = []
    quarter = count // 4
    made += [{"prompt": c, "kind": "code continuation"} for c in code[:quarter]]
    for doc in docs[:quarter // 2]:
        made.append(_ask(f"Summarize the following text in two sentences.\n\n{doc}", "summary"))
    made += [{"prompt": d[:600], "kind": "docstring continuation"} for d in docs[quarter // 2:quarter]]
    writing = [t.format(topic=topic) for t in TEMPLATES for topic in TOPICS]
    rng.shuffle(writing)
    made += [_ask(w, "writing") for w in writing[:quarter]]
    tasks = [t.format(task=task) for t in CODE_TEMPLATES for task in CODE_TASKS]
    rng.shuffle(tasks)
    made += [_ask(t, "code task") if t.startswith("Write") else {"prompt": t, "kind": "code task"}
             for t in tasks[:count - len(made)]]
    rng.shuffle(made)
    return made


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--count", type=int, default=960)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = prompts(args.seed, args.count)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, args.out)
    kinds = {}
    for row in rows:
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
    print(f"{args.out}: {len(rows)} prompts ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})")


if __name__ == "__main__":
    main()
