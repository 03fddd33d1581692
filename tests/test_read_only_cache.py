"""A read-only cache (a read-only mount, a cache shared from another machine or mounted at another path) serves
the models it holds without writing, as transformers' cache does with HF_HUB_OFFLINE; where something must be
written, one clear error names the folder and XPUSPEC_CACHE. On a tiny model kept inside the cache, as a pulled
model is."""

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
#: Loads argv[1] in the format argv[2] on the CPU and prints its greedy output.
LOADER = """
import sys, torch
from xpuspec import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device="cpu", load_in_low_bit=sys.argv[2])
print(model.generate(torch.tensor([[1, 5, 6, 7]]), max_new_tokens=6, do_sample=False)[0].tolist())
"""


def _run(cache: Path, *args, code=LOADER):
    env = {**os.environ, "XPUSPEC_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` read-only for this test: a read-only bind mount as root (root ignores permission bits), else
    every file and folder without write permission."""
    if os.geteuid() == 0:
        if subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode:
            pytest.skip("running as root without the right to mount: cannot make a folder read-only")
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True, capture_output=True)
            yield
        finally:
            subprocess.run(["umount", str(folder)], check=True)
    else:
        paths = [folder, *folder.rglob("*")]
        modes = {p: p.stat().st_mode for p in paths if not p.is_symlink()}
        for p, mode in modes.items():
            p.chmod(mode & ~0o222)
        try:
            yield
        finally:
            for p, mode in reversed(list(modes.items())):
                p.chmod(mode)


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def moved_cache(tmp_path_factory):
    """A cache that holds a tiny model in models/ and its int8_asym IR, built at one path and then copied (times
    kept) to another: a cache mounted or shared elsewhere. Returns (cache, model folder inside it, greedy output)."""
    first = tmp_path_factory.mktemp("first") / "cache"
    model = tiny_model(first / "models" / "tiny", seed=3)
    built = _run(first, model, "int8_asym")
    assert built.returncode == 0, built.stderr[-3000:]
    moved = tmp_path_factory.mktemp("elsewhere") / "cache"
    shutil.copytree(first, moved, symlinks=True)  # copy2: modification times kept, as cp -a and a bind mount do
    return moved, moved / "models" / "tiny", built.stdout


def test_a_cache_at_another_path_read_only_serves_what_it_holds(moved_cache):
    cache, model, output = moved_cache
    before = _snapshot(cache)
    with read_only(cache):
        done = _run(cache, model, "int8_asym")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == output.splitlines()[-1]  # the same output, from the cache built elsewhere
    assert _snapshot(cache) == before  # nothing was written, nothing rebuilt


def test_a_read_only_cache_that_must_write_says_which_folder_and_XPUSPEC_CACHE(moved_cache):
    cache, model, _ = moved_cache
    with read_only(cache):
        done = _run(cache, model, "int4_asym")  # not in the cache: it must be compressed and written
        cli = subprocess.run([sys.executable, "-m", "xpuspec", "generate", "--model", str(model), "--low-bit",
                              "int4_asym", "--max-new-tokens", "2", "w1 w2"], capture_output=True, text=True,
                             env={**os.environ, "XPUSPEC_CACHE": str(cache)}, timeout=600, cwd=ROOT)
    assert done.returncode != 0 and "CacheNotWritableError" in done.stderr, done.stderr[-3000:]
    assert cli.returncode == 2, cli.stderr[-3000:]
    error = [line for line in cli.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in cli.stderr, cli.stderr[-3000:]
    assert str(cache) in error[0] and "XPUSPEC_CACHE" in error[0] and "Errno" not in error[0], error[0]
