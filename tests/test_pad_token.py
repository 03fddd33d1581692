"""The built-in models' tokenizers pad a batch as their upstream Hugging Face tokenizers do (SmolLM2: ``<|im_end|>``,
id 2, the id of its config's ``pad_token_id``): set at conversion, and added at load to a conversion cached before."""

import json
import re
from pathlib import Path

import pytest
import torch

from xpuspec import AutoTokenizer, pull, sources

from conftest import MODEL

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "The capital of France is a city that"]


def test_the_builtin_tokenizer_pads_with_its_upstream_pad_token(smollm2_path):
    tok = AutoTokenizer.from_pretrained(MODEL)
    assert tok.pad_token == "<|im_end|>" and tok.pad_token_id == 2
    assert json.loads((smollm2_path / "config.json").read_text())["pad_token_id"] == tok.pad_token_id
    batch = tok(PROMPTS, padding=True, return_tensors="pt")
    lengths = [len(tok(p).input_ids) for p in PROMPTS]
    assert batch.input_ids.shape == (2, max(lengths)) and batch.attention_mask.sum(1).tolist() == lengths


def test_the_readme_batch_line_runs_as_written(smollm2_path, ov_int8):
    """The README's batch call, taken from the README itself, on the README's tokenizer: each row continues its
    prompt as the prompt alone does."""
    line = re.search(r"`(generate\(\*\*tok\(prompts, padding=True, return_tensors=\"pt\"\)\))`",
                     (ROOT / "README.md").read_text()).group(1)
    tok = AutoTokenizer.from_pretrained(MODEL)
    out = eval(f"model.{line}", {"model": ov_int8, "tok": tok, "prompts": PROMPTS})
    width = tok(PROMPTS, padding=True, return_tensors="pt").input_ids.shape[1]
    for i, prompt in enumerate(PROMPTS):
        ids = tok(prompt, return_tensors="pt").input_ids
        alone = ov_int8.generate(ids, max_new_tokens=out.shape[1] - width, do_sample=False)[0, ids.shape[1]:]
        assert out[i, width:].tolist() == alone.tolist(), prompt


@pytest.fixture
def old_conversion(smollm2_path, tmp_path, monkeypatch):
    """A cache holding SmolLM2 as converted before the fix: tokenizer_config.json without a pad token (the big
    files are links to the real ones)."""
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path))
    folder = tmp_path / "models" / MODEL
    folder.mkdir(parents=True)
    for f in smollm2_path.iterdir():
        if f.name == "tokenizer_config.json":
            config = {k: v for k, v in json.loads(f.read_text()).items() if k != "pad_token"}
            (folder / f.name).write_text(json.dumps(config, indent=2))
        else:
            (folder / f.name).symlink_to(f)
    return folder


def test_a_conversion_cached_before_gets_its_pad_token_at_load(old_conversion):
    before = {p.name: p.resolve() for p in old_conversion.iterdir() if p.is_symlink()}
    assert AutoTokenizer.from_pretrained(str(old_conversion)).pad_token is None  # what the old folder had
    assert pull(MODEL) == old_conversion
    assert json.loads((old_conversion / "tokenizer_config.json").read_text())["pad_token"] == "<|im_end|>"
    assert {p.name: p.resolve() for p in old_conversion.iterdir() if p.is_symlink()} == before  # nothing else
    assert AutoTokenizer.from_pretrained(MODEL).pad_token_id == 2
    assert not list(old_conversion.parent.glob(".*tmp*"))


def test_a_new_conversion_writes_the_pad_token(smollm2_path, tmp_path, monkeypatch):
    """The conversion step on SmolLM2's own weights and a tokenizer without a pad token, as transformers' GGUF
    loader gives it."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    upstream = AutoTokenizer.from_pretrained(str(smollm2_path))
    bare = PreTrainedTokenizerFast(tokenizer_object=upstream.backend_tokenizer, bos_token=upstream.bos_token,
                                   eos_token=upstream.eos_token, unk_token=upstream.unk_token)
    monkeypatch.setattr(sources, "_convert_gguf", lambda gguf: (model, bare))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / f"{MODEL}.gguf").symlink_to(smollm2_path.parents[1] / "gguf" / f"{MODEL}.gguf")
    final = pull(MODEL)
    assert json.loads((final / "tokenizer_config.json").read_text())["pad_token"] == "<|im_end|>"
