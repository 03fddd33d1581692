"""xpuspec export: the IR loads in openvino_genai and in xpuspec with the same greedy text;
bad input is refused before any work and leaves no files (round trips: test_roundtrip.py)."""

import subprocess
import sys

import pytest

from xpuspec import AutoModelForCausalLM, ModelSourceError, export

from conftest import MODEL, PROMPTS


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "xpuspec", *map(str, args)], capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def exported(smollm2_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "smollm2-int8"
    done = _cli("export", MODEL, out, "--weight-format", "int8_asym")
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_export_folder_contents(exported):
    names = {p.name for p in exported.iterdir()}
    assert {"openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "openvino_tokenizer.bin",
            "openvino_detokenizer.xml", "openvino_detokenizer.bin", "config.json", "generation_config.json",
            "tokenizer.json", "xpuspec.json"} <= names
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_genai_and_xpuspec_give_the_same_greedy_text(exported):
    """openvino_genai on the exported folder gives xpuspec's greedy tokens, or parts from them only at a tie:
    xpuspec may run its steps 2 tokens wide where a 1-token pass computes otherwise (float rounding,
    plugins/xpuspec_openvino/numerics.py), openvino_genai steps one token at a time."""
    import openvino as ov
    import openvino_genai

    from xpuspec import AutoTokenizer
    from xpuspec.speculative.audit import TIE, VIOLATION, classify, top2_margins

    model = AutoModelForCausalLM.from_pretrained(exported, device="cpu",
                                                 ov_config={"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    assert model.low_bit.format == "int8_asym"
    pipe = openvino_genai.LLMPipeline(str(exported), "CPU", **model.runner.configs[0])
    tokenizer = AutoTokenizer.from_pretrained(exported)
    statuses = []
    for prompt in PROMPTS:
        theirs = pipe.generate(prompt, max_new_tokens=32, do_sample=False, apply_chat_template=False)
        ids = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=32, do_sample=False, return_dict_in_generate=True,
                             output_scores=True)
        ours = out.sequences[0, ids.input_ids.shape[1]:].tolist()
        if tokenizer.decode(ours, skip_special_tokens=True) != theirs:  # genai's own tokenizer, then its tokens
            encoded = pipe.generate(ov.Tensor(ids.input_ids.numpy()), max_new_tokens=32, do_sample=False)
            statuses.append(classify(ours, top2_margins(out.scores), list(encoded.tokens[0]))[0])
    assert VIOLATION not in statuses and statuses.count(TIE) <= 1, statuses


def test_non_empty_target_is_refused_and_untouched(exported):
    before = {p.name: p.stat().st_mtime_ns for p in exported.iterdir()}
    done = _cli("export", MODEL, exported, "--weight-format", "int8_asym")
    assert done.returncode == 2 and "not empty; pass --force" in done.stderr
    assert {p.name: p.stat().st_mtime_ns for p in exported.iterdir()} == before


def test_force_replaces(exported, tmp_path):
    out = tmp_path / "target"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    export(MODEL, out, weight_format="int8_asym", force=True)
    assert not (out / "stale.txt").exists() and (out / "openvino_model.xml").is_file()


@pytest.mark.parametrize("args, phrase", [
    (["--weight-format", "int3"], "invalid choice: 'int3'"),
    (["--weight-format", "int4_asym", "--device", "npu"], "NPU runs INT4 weights only as symmetric"),
    (["--device", "tpu"], "Export targets OpenVINO devices"),
])
def test_bad_export_options_leave_no_files(tmp_path, args, phrase):
    out = tmp_path / "out"
    done = _cli("export", MODEL, out, *args)
    assert done.returncode == 2 and phrase in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_missing_path_and_non_model_folder(tmp_path):
    with pytest.raises(ModelSourceError, match="No such model folder"):
        export(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    with pytest.raises(ModelSourceError, match="is not a model"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "notes")
    assert not (tmp_path / "out").exists()


def test_an_export_over_its_own_source_or_the_cache_is_refused_even_with_force(smollm2_path, tmp_path, monkeypatch):
    """--force replaces the output folder: where that folder is, or holds, the model's source folder or the current
    folder, or is, holds or lies inside xpuspec's cache, the export and save_low_bit are refused before any work
    (before the "pass --force" advice, too), and nothing changes."""
    import shutil

    from xpuspec import OutputExistsError
    from xpuspec.cache import cache_root

    source = tmp_path / "src"
    shutil.copytree(smollm2_path, source)
    (tmp_path / "work").mkdir()
    before = {p.name: p.stat().st_mtime_ns for p in source.iterdir()}
    for model, out, kept in ((source, source, "the model's own folder"), (source, tmp_path, "the model's own folder"),
                             (MODEL, smollm2_path, "xpuspec's cache"), (MODEL, cache_root() / "ov", "xpuspec's cache"),
                             (source, cache_root(), "xpuspec's cache"), (source, tmp_path / "work", "the current folder")):
        monkeypatch.chdir(tmp_path / "work")
        with pytest.raises(OutputExistsError, match=f"{kept}.*force or not"):
            export(model, out, weight_format="int8_asym", force=True)
    monkeypatch.chdir(source)
    done = _cli("export", ".", ".", "--weight-format", "int8_asym")  # refused as the source, not "pass --force"
    assert done.returncode == 2 and "is or holds the model's own folder" in done.stderr, done.stderr[-2000:]
    monkeypatch.chdir(tmp_path / "work")
    saved = AutoModelForCausalLM.from_pretrained("../src", device="cpu")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputExistsError, match="the model's own folder"):
        saved.save_low_bit(source, force=True)  # loaded through a relative path from another folder
    assert {p.name: p.stat().st_mtime_ns for p in source.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".src.tmp")]
    with pytest.raises(ValueError, match="The output folder is an empty string"):
        export(smollm2_path, "", weight_format="int8_asym")
