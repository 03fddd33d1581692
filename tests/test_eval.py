"""xpuspec eval: the perplexity harness against transformers' own loss, the report, the CLI."""

import json
import math

import pytest
import torch

from xpuspec import LowBitConfig, LowBitConfigError, evaluate
from xpuspec.cli import main
from xpuspec.evaluation import label, parse_format
from xpuspec.perplexity import eval_texts, perplexity, sliding_windows

from conftest import MODEL


@pytest.mark.parametrize("n,context,stride", [(10, 4, 2), (10, 4, 4), (7, 10, 5), (513, 512, 256), (1024, 512, 256)])
def test_sliding_windows_score_every_token_once(n, context, stride):
    windows = sliding_windows(n, context, stride)
    scored = [pos for begin, end, first in windows for pos in range(begin + first, end)]
    unscored = [begin for begin, _, _ in windows] if stride == context else [0]  # no context before them
    assert scored == [pos for pos in range(n) if pos not in unscored]
    assert all(end - begin <= context and first >= 1 for begin, end, first in windows)
    assert [begin for begin, _, _ in windows] == list(range(0, stride * len(windows), stride))


def test_bad_window_parameters():
    with pytest.raises(ValueError, match="1 <= stride <= context"):
        sliding_windows(100, 32, 64)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        sliding_windows(1, 32, 16)
    with pytest.raises(ValueError, match="over the model's context of 8192"):
        evaluate(MODEL, ["int8_asym"], context=10_000, stride=16)


def test_parse_format():
    assert parse_format("int4_sym:g64:awq:se") == LowBitConfig("int4_sym", 64, awq=True, scale_estimation=True)
    assert parse_format("INT8_ASYM") == LowBitConfig("int8_asym")
    assert parse_format("int4_asym:g-1").group_size == -1
    assert label(parse_format("int4_sym:g64:awq:se")) == "int4_sym g64 awq+se"
    with pytest.raises(LowBitConfigError, match=r"FORMAT\[:gN\]\[:awq\]\[:se\]"):
        parse_format("int4_sym:fast")
    with pytest.raises(LowBitConfigError, match="applies to INT4 only"):
        parse_format("int8_sym:g64")


def _transformers_perplexity(model, ids, context, stride):
    """The recipe of transformers' "Perplexity of fixed-length models" guide, on the model's own loss."""
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        input_ids = ids[None, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-(end - prev_end)] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        scored = (target_ids[:, 1:] != -100).sum().item()  # the model shifts the labels by one
        nll_sum += loss.item() * scored
        n_tokens += scored
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / n_tokens)


def test_perplexity_matches_transformers(ov_fp32, hf_model, tokenizer):
    texts = eval_texts(tokenizer, None, 512)
    assert {k: len(v) for k, v in texts.items()} == {"code": 256, "prose": 256}
    for name, ids in texts.items():
        ours = perplexity(ov_fp32, ids, context=128, stride=64)
        theirs = _transformers_perplexity(hf_model, ids, context=128, stride=64)
        assert abs(ours / theirs - 1) < 0.005, (name, ours, theirs)
        assert 2 < ours < 100, (name, ours)


def test_evaluate_report(tmp_path):
    report = evaluate(MODEL, ["int8_asym", "fp32"], tokens=128, context=64, stride=32, prompts=2, new_tokens=8,
                      progress=False)
    fp32, int8 = report.results
    assert [r.label for r in report.results] == ["fp32", "int8_asym"]
    assert (fp32.top1_agreement, fp32.kl_mean, fp32.greedy_identical) == (1.0, 0.0, 1.0)
    assert 0.9 <= int8.top1_agreement <= 1.0 and 0.0 < int8.kl_mean < 0.05
    assert abs(int8.perplexity["all"] / fp32.perplexity["all"] - 1) < 0.05
    assert int8.weight_mib < fp32.weight_mib / 3
    assert len(int8.greedy_match) == 2 and all(0 <= m <= 8 for m in int8.greedy_match)
    assert report.settings["text_tokens"] == {"code": 64, "prose": 64}

    data = json.loads(report.write_json(tmp_path / "eval.json").read_text())
    assert set(data) == {"model", "settings", "corpus", "machine", "results"}
    row = data["results"][1]
    assert row["low_bit"]["format"] == "int8_asym" and set(row["perplexity"]) == {"code", "prose", "all"}
    assert row["greedy_match_mean"] == sum(row["greedy_match"]) / 2
    table = report.to_markdown().splitlines()
    assert table[0].startswith("| format | group | weights MiB | ppl code | ppl prose | ppl Δ |") and len(table) == 4
    assert table[2].startswith("| fp32 | - |") and "| +0.00% | 100.00% | 0.0000 |" in table[2]


def test_cli_smoke(tmp_path, capsys):
    text = tmp_path / "story.txt"
    text.write_text("The river ran past the old mill, and the miller's children watched the boats go by. " * 8)
    out_json, out_png = tmp_path / "eval.json", tmp_path / "eval.png"
    rc = main(["eval", MODEL, "--low-bit", "int4_asym", "--text", str(text), "--tokens", "48", "--context", "32",
               "--stride", "16", "--prompts", "2", "--new-tokens", "4", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| format | group | weights MiB | ppl story | ppl Δ |")
    assert table[3].startswith("| int4_asym | 64 (asked 128) |")  # SmolLM2's 576 channels: 128 is fitted to 64
    data = json.loads(out_json.read_text())
    assert data["settings"]["text_tokens"] == {"story": 48} and data["results"][1]["low_bit"]["group_size"] == 64
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_format(capsys):
    assert main(["eval", MODEL, "--low-bit", "int4_sym:fast"]) == 2
    assert "Unknown option 'fast'" in capsys.readouterr().err
