"""load_in_low_bit="auto" (xpuspec/formats.py) and speculative=True (DEFAULT_MODE), on the real SmolLM2."""

import json
import logging
import math

import pytest
import torch

from conftest import MODEL, PROMPTS
from xpuspec import AutoModelForCausalLM, AutoTokenizer, formats
from xpuspec.devices import resolve_device
from xpuspec.errors import LowBitConfigError
from xpuspec.perplexity import eval_texts, perplexity
from xpuspec.sources import resolve_source
from xpuspec.speculative.config import DEFAULT_MODE, resolve_speculative


def _measures_path(smollm2_path):
    backend, device = resolve_device("cpu", "openvino")
    return formats.measures_path(resolve_source(MODEL).path, backend.identity(device))


def _text_perplexity(model, texts) -> float:
    nll = count = 0.0
    for ids in texts.values():
        nll += (len(ids) - 1) * math.log(perplexity(model, ids, formats.PPL_CONTEXT, formats.PPL_STRIDE))
        count += len(ids) - 1
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def auto_model(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", backend="openvino", load_in_low_bit="auto")


def test_auto_picks_the_fastest_format_within_the_bound(auto_model, smollm2_path, tokenizer):
    """The choice, worked out here from the table written to disk (read as plain JSON, not by xpuspec): rank the rows
    by speed and take the first within +5% of the fp32 row's perplexity. The chosen format's perplexity change,
    recomputed against a fresh fp32 load, is the one recorded; SmolLM2's INT4 formats are outside (+25-31%)."""
    choice = auto_model.format_choice
    assert auto_model.low_bit.format == choice.format
    rows = json.loads(_measures_path(smollm2_path).read_text())["measures"]
    assert sorted(r["format"] for r in rows) == sorted(formats.CANDIDATES)
    fp32 = next(r["perplexity"] for r in rows if r["format"] == "fp32")
    for r in rows:  # the recorded change is each row's perplexity against the fp32 row's
        assert r["ppl_delta"] == pytest.approx(r["perplexity"] / fp32 - 1, rel=1e-9, abs=1e-12), r
    by_speed = sorted(rows, key=lambda r: -r["tokens_per_s"])
    expected = next(r["format"] for r in by_speed if r["perplexity"] <= 1.05 * fp32 or r["format"] == "fp32")
    assert choice.format == expected, by_speed
    assert all(r["perplexity"] > 1.05 * fp32 for r in rows if r["format"].startswith("int4"))
    texts = eval_texts(tokenizer, None, formats.PPL_TOKENS)
    reference = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", backend="openvino", load_in_low_bit="fp32")
    delta = _text_perplexity(auto_model, texts) / _text_perplexity(reference, texts) - 1
    assert delta == pytest.approx(choice.chosen.ppl_delta, abs=1e-6)
    assert delta <= formats.DEFAULT_PPL_BOUND


def test_auto_reuses_the_cache(auto_model, monkeypatch, caplog):
    def never(*args, **kwargs):
        raise AssertionError("measured again although the measurements are cached")

    monkeypatch.setattr(formats, "measure_formats", never)
    with caplog.at_level(logging.INFO, logger="xpuspec"):
        again = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", backend="openvino", load_in_low_bit="auto")
    assert again.low_bit == auto_model.low_bit
    lines = [r.getMessage() for r in caplog.records if "load_in_low_bit='auto' chose" in r.getMessage()]
    assert len(lines) == 1 and f"chose {again.low_bit.format}: perplexity" in lines[0]


def test_a_corrupt_cache_entry_is_measured_again(auto_model, smollm2_path, monkeypatch, caplog):
    """Mechanics: the measuring itself is stood in for by the measures just read (the first test measured for real)."""
    path = _measures_path(smollm2_path)
    kept = formats.cached_measures(path)
    calls = []
    monkeypatch.setattr(formats, "measure_formats", lambda load, tokenizer: calls.append(1) or kept)
    for damage in ("{not json", json.dumps({"measures": [{"format": "int8_sym"}]})):
        path.write_text(damage)
        with caplog.at_level(logging.WARNING, logger="xpuspec"):
            again = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", backend="openvino", load_in_low_bit="auto")
        assert again.low_bit == auto_model.low_bit
        assert any("cannot be read" in r.getMessage() for r in caplog.records)
        caplog.clear()
    assert len(calls) == 2
    assert formats.cached_measures(path) == kept


def test_a_format_past_the_threshold_is_noted_at_load(auto_model, caplog):
    with caplog.at_level(logging.INFO, logger="xpuspec"):
        AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", backend="openvino", load_in_low_bit="int4_asym")
    delta = next(m.ppl_delta for m in auto_model.format_choice.measures if m.format == "int4_asym")
    assert [r.getMessage() for r in caplog.records if "vs fp32 (measured" in r.getMessage()] == [
        f"int4_asym on this model and device: perplexity {100 * delta:+.1f}% vs fp32 (measured; "
        "load_in_low_bit='auto' keeps within +5%)"]


def test_choose_and_its_errors():
    rows = [formats.FormatMeasure("fp32", 10.0, 0.0, 5.0, 500), formats.FormatMeasure("int8_sym", 10.1, 0.01, 9.0, 130),
            formats.FormatMeasure("int4_sym", 12.0, 0.2, 11.0, 80)]
    assert formats.choose(rows).format == "int8_sym"
    assert formats.choose(rows, bound=0.25).format == "int4_sym"
    assert formats.choose(rows, bound=0).format == "fp32"
    with pytest.raises(ValueError, match="bound must be a number >= 0"):
        formats.choose(rows, bound=-1)
    with pytest.raises(LowBitConfigError, match="default settings"):
        AutoModelForCausalLM.from_pretrained(MODEL, load_in_low_bit="auto", group_size=32)


def test_speculative_true_is_prompt_lookup_and_lossless(tokenizer):
    assert DEFAULT_MODE == "prompt_lookup" and resolve_speculative(True).mode == "prompt_lookup"
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym", speculative=True)
    assert model.speculative_config.mode == "prompt_lookup" and model.draft_model is None
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        fast = model.generate(ids, max_new_tokens=32, do_sample=False)
        assert model.last_generate_stats.acceptance_counts is not None  # it ran the speculative loop
        assert torch.equal(fast, model.generate(ids, max_new_tokens=32, do_sample=False, speculative=False))


def test_the_cli_and_the_server_default_to_auto():
    from xpuspec.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).low_bit == "auto"
    assert parser.parse_args(["serve", MODEL]).low_bit == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--draft-low-bit", "auto"])  # a draft's format is named


def test_the_cache_is_keyed_by_the_cpu_flags(smollm2_path):
    from xpuspec.devices import cpu_flags

    backend, device = resolve_device("cpu", "openvino")
    identity = backend.identity(device)
    assert identity["cpu_flags"] == cpu_flags() and "avx2" in identity["cpu_flags"].split()
    assert identity["openvino"] and identity["backend"] == "openvino"
    folder = resolve_source(MODEL).path
    assert formats.measures_path(folder, identity) != formats.measures_path(folder, {**identity, "cpu_flags": "avx2"})


def test_a_4_bit_format_never_measured_says_so_at_load(tmp_path, caplog):
    from tiny import tiny_model

    folder = tiny_model(tmp_path / "t", seed=2)
    with caplog.at_level(logging.INFO, logger="xpuspec"):
        AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="openvino", load_in_low_bit="int4_asym")
        AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="openvino", load_in_low_bit="int8_asym")
    lines = [r.getMessage() for r in caplog.records if "not measured yet" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("int4_asym on this model and device"), lines
