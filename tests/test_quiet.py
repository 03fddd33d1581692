"""The first run at the command line's default verbosity: one progress bar per long phase and at most a few log lines
(the start, the chosen format and why, where it is cached, the device); NNCF's tables, the export's warnings,
OpenVINO's logs and internal hashes only with ``-v`` (xpuspec/progress.py, issue 40).

On a tiny random Llama in an empty cache, so that every phase runs (export, four NNCF compressions, the measurement
of the formats, compile), and on the real SmolLM2 GGUF for the conversion."""

import json
import os
import re
import subprocess
import sys

import pytest

from tiny import tiny_model

#: What must not reach the terminal at the default verbosity.
NOISE = re.compile(r"nncf|Statistics of the bitwidth|Weight Compression|Warning|warn|deprecated|Traceback|"
                   r"Converting and de-quantizing|Loading weights|Writing model shards|Convert Huggingface|"
                   r"TracerWarning|\b[0-9a-f]{16}\b", re.IGNORECASE)
#: A tqdm bar as :func:`xpuspec.progress.phase` and the pull draw it (the last state of a line of \r updates).
BAR = re.compile(r"^[\w .,()/-]+: +\d+%\|")


def _run(*args, cache, timeout=900):
    """The command's result, its output decoded as it was written (text mode would turn a bar's \r into \n)."""
    done = subprocess.run([sys.executable, "-m", "xpuspec", *map(str, args)], capture_output=True, timeout=timeout,
                          env={**os.environ, "XPUSPEC_CACHE": str(cache)})
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def _lines(stderr: str):
    """stderr as the terminal shows it: each line's last \\r-separated state, empty ones dropped."""
    shown = (line.split("\r")[-1].strip() for line in stderr.split("\n"))  # str.splitlines would split at \r too
    return [line for line in shown if line]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama whose context holds the perplexity windows ``auto`` measures with (rotary positions: the
    longer context needs no new weights)."""
    folder = tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_first_auto_run_shows_bars_and_a_few_lines(tiny, tmp_path):
    done = _run("generate", "w1 w2 w3 w1 w2", "--model", tiny, "--max-new-tokens", "4", cache=tmp_path / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = _lines(done.stderr)
    noisy = [line for line in lines if NOISE.search(line)]
    assert not noisy, noisy
    bars = [line for line in lines if BAR.match(line)]
    logs = [line for line in lines if not BAR.match(line)]
    phases = [b.split(":")[0] for b in bars]
    assert len(phases) == 2 and phases[0] == "measure 6 weight formats", bars  # export and compress run inside it
    assert phases[1].startswith(f"compile {tiny} (") and phases[1].endswith(") for cpu"), bars
    assert all(line.startswith("xpuspec: ") for line in logs), logs
    start, *after = logs
    assert "measures 6 weight formats once (about" in start, start
    assert len(after) <= 3 and "load_in_low_bit='auto' chose" in after[0] and "cached in" in after[1], after
    assert f"loaded {tiny} on cpu" in after[2], after
    out = done.stdout.splitlines()  # the answer and its figures only: NNCF writes its tables to stdout
    assert out[0].startswith("w1 w2 w3 w1 w2") and out[-1].startswith("[prompt tokens") and len(out) == 2, out


def test_verbose_shows_the_libraries_output(tiny, tmp_path):
    """The same kind of run with -v: NNCF's table and the export's warnings come back (so the test above can fail)."""
    done = _run("-v", "generate", "w1 w2 w3", "--model", tiny, "--low-bit", "int8_sym", "--max-new-tokens", "2",
                cache=tmp_path / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Statistics of the bitwidth distribution" in done.stdout
    assert "TracerWarning" in done.stderr and "exporting" in done.stderr and "compressing weights" in done.stderr


def test_pull_of_a_gguf_shows_one_bar_per_phase(smollm2_path, tmp_path):
    """The conversion of the real SmolLM2 GGUF: one bar (transformers' three are hidden), then the folder."""
    from xpuspec import sources

    gguf = sources._fetch_gguf(sources.BUILTIN_MODELS["smollm2-135m-instruct"])
    done = _run("pull", gguf, cache=tmp_path / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = _lines(done.stderr)
    assert [line.split(":")[0] for line in lines] == [f"convert {gguf.name}"], lines
    assert done.stdout.strip().endswith(f"gguf-{sources.BUILTIN_MODELS['smollm2-135m-instruct'].sha256}")
