"""llama.cpp beside xpuspec in the bench: the systems find the model's GGUF file, say clearly when llama-cpp-python
is not installed, and (where it is) decode the same tokens plain and with prompt lookup."""

import importlib.util
import json
import os
import sys

import pytest

from xpuspec.bench.systems import REFERENCE, SYSTEMS, Setup, gguf_of, make, parse_systems, unavailable

from conftest import MODEL
from tiny import tiny_model

INSTALLED = importlib.util.find_spec("llama_cpp") is not None


def test_the_systems_are_registered_with_their_own_weight_family():
    assert SYSTEMS["llamacpp"].family == SYSTEMS["llamacpp-lookup"].family == "gguf"
    assert REFERENCE["gguf"] == "llamacpp" and SYSTEMS["llamacpp-lookup"].speculative


@pytest.mark.skipif(INSTALLED, reason="llama-cpp-python is installed here")
def test_without_llama_cpp_python_they_are_left_out_or_refused_by_name():
    assert "llamacpp" not in parse_systems(None, has_draft=False)
    assert unavailable("llamacpp") == ("llamacpp needs llama_cpp, which is not installed: "
                                       "pip install 'xpuspec[llamacpp]'")
    with pytest.raises(ValueError, match=r"llamacpp-lookup needs llama_cpp, which is not installed: pip install "
                                         r"'xpuspec\[llamacpp\]'. Or leave it out of --systems."):
        parse_systems("xpuspec,llamacpp-lookup", has_draft=False)
    assert unavailable("xpuspec") is None


def test_the_gguf_is_the_one_the_model_came_from(smollm2_path, tmp_path):
    from xpuspec import sources

    builtin = gguf_of(MODEL)
    assert sources.file_sha256(builtin) == sources.BUILTIN_MODELS[MODEL].sha256
    assert gguf_of(str(builtin)) == builtin
    assert gguf_of(str(sources.pull_gguf(builtin))) == builtin.resolve()  # a folder converted from a GGUF file
    with pytest.raises(ValueError, match="did not come from one"):
        gguf_of(str(tiny_model(tmp_path, seed=1)))


@pytest.mark.skipif(not INSTALLED, reason="llama-cpp-python is not installed (pip install 'xpuspec[llamacpp]')")
def test_llamacpp_plain_and_prompt_lookup_agree(smollm2_path, tokenizer):
    setup = Setup(model=MODEL, hf_path=str(smollm2_path), ir="", low_bit="int8_asym")
    ids = tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(").input_ids
    plain, lookup = make("llamacpp", setup), make("llamacpp-lookup", setup)
    plain.load(), lookup.load()
    tokens, margins = plain.reference(ids, 16)
    assert len(tokens) == len(margins) == 16
    assert plain.generate(ids, 16).tokens == tokens == lookup.generate(ids, 16).tokens


@pytest.fixture
def fake_llama(monkeypatch, tmp_path):
    """The fake llama-cpp-python in this process, and a GGUF path for it (the fake does not read it)."""
    import fake_llama_cpp

    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.delitem(sys.modules, "llama_cpp.llama_speculative", raising=False)
    fake_llama_cpp.install()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf


@pytest.mark.parametrize("name", ["llamacpp", "llamacpp-lookup"])
def test_prompts_past_llama_cpps_batch_of_512_tokens_run(fake_llama, name):
    """llamacpp-lookup crashed on prompts near 512 tokens ('could not broadcast input array from shape (540672,) into
    shape (491520,)'): with a draft model llama-cpp-python computes every row's logits, into a scores array sized
    n_batch (512) rows unless Llama is built with logits_all=True. The plain system's reference reads those rows."""
    system = make(name, Setup(model=str(fake_llama), hf_path=None, ir="", low_bit="int8_asym"))
    settings = system.load()
    ids = [i % 16 for i in range(540)]
    expected = [(ids[-1] + 1 + j) % 16 for j in range(8)]
    assert system.generate(ids, 8).tokens == expected
    tokens, margins = system.reference(ids, 8)
    assert tokens == expected and margins == [1.0] * 8  # the rows that scored them, past row 512
    assert settings["logits_all"] is True  # recorded in the report


def test_a_system_that_fails_leaves_the_others_their_results(tmp_path, monkeypatch):
    """A warm-up that fails (here llamacpp-lookup's) no longer aborts the run with no JSON: the other systems are
    measured, and the report records the failed system's error and validates against the schema."""
    import fake_llama_cpp
    from xpuspec.bench import report
    from xpuspec.bench.harness import BenchSettings, run

    fake = fake_llama_cpp.install(tmp_path / "fake")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "lookup")
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path / "cache"))
    model = tiny_model(tmp_path / "tiny", seed=1)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    (model / "xpuspec.json").write_text(json.dumps({"source": str(tmp_path / "tiny.gguf")}))  # as if converted
    settings = BenchSettings(model=str(model), systems=["hf", "llamacpp", "llamacpp-lookup"], max_new_tokens=4,
                             repeats=2, bandwidth=10e9)
    result = run(settings, progress=False, log_dir=tmp_path / "logs", prompts={"code": ["w1 w2 w3", "w4 w5"]})
    report.validate(result)
    failed = result["systems"]["llamacpp-lookup"]
    assert failed["error"] == "RuntimeError: fake llama.cpp: this warm-up fails", failed["error"]
    assert "Traceback" in failed["traceback"] and failed["family"] == "gguf"
    assert [s["system"] for s in result["samples"]] == ["hf", "llamacpp"] * 4
    assert set(result["summary"]) == {"hf", "llamacpp"}
    assert all(s["audit"]["status"] == "identical" for s in result["samples"])
    table = report.markdown(result)
    assert "**Failed:** llamacpp-lookup: RuntimeError: fake llama.cpp: this warm-up fails" in table
    assert sum(line.startswith("| llamacpp |") for line in table.splitlines()) == 1
