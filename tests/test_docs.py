"""Every code block of README.md and docs/*.md runs, and every relative link leads somewhere, so the docs
cannot drift from the code.

- ```python blocks run in one subprocess, one after another, each in a fresh namespace (so each needs its own
  imports and runs alone), with the working folder and the environment restored after each.
- ```bash blocks whose commands are all ``xpuspec ...`` calls run in bash, ``xpuspec`` being this interpreter's
  ``python -m xpuspec``, each in a fresh working folder that links ``benchmarks/`` and ``examples/``.
- A block that cannot run here (an Intel GPU or NPU, torchrun, pip, minutes of work) carries
  ``<!-- not run: REASON -->`` on the line before its fence.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")
#: Fence languages that hold code to run; every other fence (text, toml) is shown, not run.
RUN_LANGUAGES = ("python", "bash")
#: Links to the web are not followed; the docs point inside the repository.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: Optional[str]  # the reason, when marked

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> List[Block]:
    """The fenced blocks of a markdown page, in order."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a code fence is never closed"
        marker = NOT_RUN.match(lines[i - 1].strip()) if i else None
        found.append(Block(page, i + 1, opening.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           marker.group(1) if marker else None))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.language == "python" and b.not_run is None]
BASH = [b for b in ALL if b.language == "bash" and b.not_run is None]


def commands(code: str) -> List[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_the_pages_exist_and_the_readme_is_short():
    assert {p.name for p in PAGES} >= {"README.md", "speculative.md", "devices.md", "low-bit.md", "export.md",
                                        "bench.md", "errors.md", "design.md"}
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_block_runs_or_says_why():
    problems = []
    for b in ALL:
        if not b.language:
            problems.append(f"{b.name}: name the fence's language (python, bash, text, ...)")
        elif b.not_run is not None and not b.not_run:
            problems.append(f"{b.name}: `<!-- not run: -->` needs a reason")
        elif b.not_run is not None and b.language not in RUN_LANGUAGES:
            problems.append(f"{b.name}: a {b.language} block is never run; drop its `not run` marker")
        elif b.language == "bash" and b.not_run is None:
            others = [c for c in commands(b.code) if not c.startswith("xpuspec ")]
            if others:
                problems.append(f"{b.name}: runs {others[0]!r}; only xpuspec commands run here, so mark the block "
                                "with `<!-- not run: REASON -->` on the line before it")
    assert not problems, "\n".join(problems)
    assert PYTHON and BASH


def test_the_install_and_test_commands_stay_in_the_readme():
    """CI runs the README's test command; a user copies its install command."""
    codes = [b.code.strip() for b in ALL if b.page.name == "README.md" and b.language == "bash"]
    assert 'pip install -e . && xpuspec generate "def fibonacci(n):"' in codes
    assert 'pip install -e ".[dev]" && python -m pytest -q -n auto --dist loadfile' in codes


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set:
    seen, anchors, fenced = {}, set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_relative_links_lead_to_files_and_headings():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _workdir(tmp: Path) -> Path:
    """A fresh working folder in which the docs' relative paths (benchmarks/, examples/) resolve."""
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("benchmarks", "examples"):
        (tmp / name).symlink_to(ROOT / name)
    return tmp


#: Runs the python blocks given as a JSON list in argv[1]; writes one JSON line per block to argv[2].
RUNNER = textwrap.dedent("""
    import contextlib, io, json, os, sys, time, traceback
    blocks = json.load(open(sys.argv[1]))
    with open(sys.argv[2], "w") as report:
        for block in blocks:
            cwd, env, out = os.getcwd(), dict(os.environ), io.StringIO()
            start = time.perf_counter()
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(block["code"], block["name"], "exec"), {"__name__": "__main__"})
                error = None
            except BaseException:
                error = traceback.format_exc()
            finally:
                os.chdir(cwd)
                os.environ.clear()
                os.environ.update(env)
            report.write(json.dumps({"name": block["name"], "error": error, "stdout": out.getvalue()[-2000:],
                                     "seconds": time.perf_counter() - start}) + "\\n")
            report.flush()
""")


@pytest.fixture(scope="module")
def python_results(tmp_path_factory, smollm2_path):
    """Each python block's outcome, from one subprocess that runs them all (the imports are paid once)."""
    work = _workdir(tmp_path_factory.mktemp("docs-python") / "work")
    given, report = work.parent / "blocks.json", work.parent / "report.jsonl"
    given.write_text(json.dumps([{"name": b.name, "code": b.code} for b in PYTHON]))
    done = subprocess.run([sys.executable, "-c", RUNNER, str(given), str(report)], cwd=work, capture_output=True,
                          text=True, timeout=1800)
    results = {}
    if report.exists():
        results = {r["name"]: r for r in map(json.loads, report.read_text().splitlines())}
    return results, done


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.name)
def test_python_block_runs(block, python_results):
    results, done = python_results
    if block.name not in results:
        pytest.fail(f"the block runner stopped before {block.name} (status {done.returncode}):\n{done.stderr[-3000:]}")
    result = results[block.name]
    assert result["error"] is None, f"{block.name} raised:\n{result['error']}\nstdout:\n{result['stdout']}"


@pytest.fixture(scope="module")
def xpuspec_on_path(tmp_path_factory):
    """A folder holding an ``xpuspec`` command that runs this checkout with this interpreter."""
    folder = tmp_path_factory.mktemp("bin")
    shim = folder / "xpuspec"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m xpuspec "$@"\n')
    shim.chmod(0o755)
    return folder


@pytest.mark.parametrize("block", BASH, ids=lambda b: b.name)
def test_bash_block_runs(block, xpuspec_on_path, tmp_path, smollm2_path):
    env = {**os.environ, "PATH": f"{xpuspec_on_path}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=_workdir(tmp_path / "work"), env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{block.name} exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
