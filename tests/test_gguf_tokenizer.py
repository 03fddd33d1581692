"""The GGUF path's tokenizer check (issue 41): small GGUFs written with the ``gguf`` package from tiny models of each
architecture and tokenizer kind, each with a real tokenizer of that kind, convert to the original's token ids and
logits; a tokenizer that encodes differently from the GGUF's own is rebuilt, or refused naming the first differing
token; a failed conversion is remembered per sha256 and answered at once, ``force`` converts again."""

import json
from pathlib import Path

import pytest
import torch

from xpuspec import GGUFTokenizerError, PullError, sources
from xpuspec import gguf_tokenizer as gt

from gguf_files import tiny_model, write_gguf

#: Texts the converted tokenizers must encode as the originals do (beyond the check's own CHECK_TEXTS).
TEXTS = gt.CHECK_TEXTS + (
    "Speculative decoding drafts tokens cheaply and verifies them with the target model in one pass.",
    "  leading spaces, trailing spaces  ",
    "Ünïcödé → 東京 🙂 and tabs\tand\nnewlines",
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty model cache, and no perplexity gate: the tiny models' weights are random (the gate is tested on
    SmolLM2 in test_gguf.py)."""
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "PLAUSIBLE_PERPLEXITY", float("inf"))
    return tmp_path / "cache"


# ---------------------------------------------------------------- SentencePiece ("llama" tokenizer model)

def _corpus(tmp_path) -> Path:
    """The project's own docs as training text (deterministic, offline)."""
    root = Path(__file__).resolve().parents[1]
    text = "\n".join(p.read_text() for p in sorted([root / "README.md", *sorted((root / "docs").glob("*.md"))]))
    out = tmp_path / "corpus.txt"
    out.write_text(text)
    return out


@pytest.fixture(scope="module", params=["llama", "gemma"])
def sentencepiece_kind(request, tmp_path_factory):
    """A real SentencePiece BPE model trained with byte fallback, as Llama's (dummy prefix) or Gemma's (none, BOS
    2, user-defined pieces); returns ``(kind, processor, gguf tokenizer fields)``."""
    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp(f"spm-{request.param}")
    gemma = request.param == "gemma"
    user = ["<start_of_turn>", "<end_of_turn>"] if gemma else []
    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    spm.SentencePieceTrainer.train(
        input=str(_corpus(folder)), model_prefix=str(folder / "sp"), model_type="bpe", vocab_size=1500,
        byte_fallback=True, character_coverage=0.9995, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=not gemma, split_digits=True, split_by_whitespace=False,
        user_defined_symbols=user,
        minloglevel=2, num_threads=1, **ids)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "sp.model"))
    types = []
    for i in range(sp.get_piece_size()):
        types.append(gt.CONTROL if sp.is_control(i) else gt.UNKNOWN if sp.is_unknown(i) else gt.BYTE
                     if sp.is_byte(i) else gt.USER_DEFINED if sp.id_to_piece(i) in user else gt.NORMAL)
    fields = dict(model="llama", pre="default", tokens=[sp.id_to_piece(i) for i in range(sp.get_piece_size())],
                  scores=[sp.get_score(i) for i in range(sp.get_piece_size())], types=types, bos=sp.bos_id(),
                  eos=sp.eos_id(), unk=sp.unk_id(), pad=sp.pad_id() if sp.pad_id() >= 0 else None, add_bos=True,
                  add_eos=False, add_space_prefix=not gemma)
    return request.param, sp, fields


def test_the_reference_encodes_like_sentencepiece(sentencepiece_kind):
    kind, sp, fields = sentencepiece_kind
    reference = gt.reference_tokenizer(_vocab(fields))
    for text in TEXTS:
        assert reference.encode(text).ids == [sp.bos_id()] + sp.encode(text), (kind, text)
        assert reference.decode(reference.encode(text).ids, skip_special_tokens=True) == sp.decode(sp.encode(text))


def _vocab(fields) -> gt.GGUFVocab:
    return gt.GGUFVocab(model=fields["model"], pre=fields.get("pre", "default"), tokens=fields["tokens"],
                        scores=fields.get("scores"), types=fields["types"], merges=fields.get("merges"),
                        bos_id=fields.get("bos"), eos_id=fields.get("eos"), unk_id=fields.get("unk"),
                        pad_id=fields.get("pad"), add_bos=fields.get("add_bos", False),
                        add_eos=fields.get("add_eos", False), add_space_prefix=fields.get("add_space_prefix", False),
                        chat_template=None)


def _round_trip(tmp_path, model, fields, want_ids):
    """Write ``model`` with ``fields`` as a GGUF, convert it, and compare ids (``want_ids(text)``) and logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_gguf(tmp_path / "tiny.gguf", model, fields)
    folder = sources.pull_gguf(path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert ids == want_ids(text), text
        assert tokenizer.decode(ids, skip_special_tokens=True).strip() == text.strip()
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits
            got = converted(torch.tensor([ids])).logits
        assert (got - want).abs().max().item() < 1e-4, text  # fp32 weights, stored and read exactly
    return folder


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_sentencepiece_gguf_round_trips(sentencepiece_kind, model_type, tmp_path, cache):
    kind, sp, fields = sentencepiece_kind
    model = tiny_model(model_type, sp.get_piece_size(), bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id(),
                       pad_token_id=max(sp.pad_id(), 0))
    folder = _round_trip(tmp_path, model, fields, lambda text: [sp.bos_id()] + sp.encode(text))
    meta = json.loads((folder / "xpuspec.json").read_text())
    assert meta["tokenizer"] in ("converted", "rebuilt from the GGUF's metadata")


# ---------------------------------------------------------------- byte-level BPE ("gpt2" tokenizer model)

#: Pre-tokenizers of the byte-level BPE families, as their published tokenizer.json files write them.
PUBLISHED_PRE = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
    "qwen2": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": gt.QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
    "llama-bpe": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": gt.LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
}


@pytest.fixture(scope="module")
def smollm2_bpe(smollm2_path):
    """SmolLM2's byte-level BPE (vocabulary, merges, added tokens) without a BOS: the published tokenizer adds none
    (its GGUF says add_bos_token false); a folder converted before the tokenizer check added ``<|im_start|>``."""
    spec = json.loads((smollm2_path / "tokenizer.json").read_text())
    spec["post_processor"] = None
    return spec


@pytest.mark.parametrize("pre,model_type", [("smollm", "llama"), ("qwen2", "qwen2"), ("llama-bpe", "llama")])
def test_a_byte_level_bpe_gguf_round_trips(smollm2_bpe, pre, model_type, tmp_path, cache):
    from tokenizers import Tokenizer

    spec = dict(smollm2_bpe, pre_tokenizer=PUBLISHED_PRE[pre])
    if pre == "llama-bpe":
        spec["model"] = dict(spec["model"], ignore_merges=True)
    original = Tokenizer.from_str(json.dumps(spec))
    vocab = original.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    added = {t["content"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    fields = dict(model="gpt2", pre=pre, tokens=tokens, merges=merges, bos=1, eos=2, unk=0, add_bos=False,
                  types=[gt.CONTROL if t in added else gt.NORMAL for t in tokens])
    model = tiny_model(model_type, len(tokens), bos_token_id=1, eos_token_id=2, pad_token_id=2)
    _round_trip(tmp_path, model, fields, lambda text: original.encode(text).ids)


# ---------------------------------------------------------------- the check itself, and the failure memory

@pytest.fixture(scope="module")
def tiny_spm_gguf(sentencepiece_kind, tmp_path_factory):
    kind, sp, fields = sentencepiece_kind
    model = tiny_model("llama", sp.get_piece_size(), bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id())
    return write_gguf(tmp_path_factory.mktemp("gguf") / f"{kind}.gguf", model, fields), sp


def _broken(reference):
    """``reference`` with its BOS dropped and whole words split into characters: the issue's Gemma-3 defects."""
    from tokenizers import models, processors

    spec = json.loads(reference.to_str())
    broken = type(reference).from_str(json.dumps(spec))
    broken.model = models.BPE(vocab=reference.get_vocab(), merges=[], unk_token=spec["model"]["unk_token"],
                              byte_fallback=True)
    broken.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])
    return broken


def test_the_check_names_the_first_differing_token(tiny_spm_gguf):
    path, sp = tiny_spm_gguf
    vocab = gt.read_vocab(path)
    reference = gt.reference_tokenizer(vocab)
    good = gt.as_transformers(reference, vocab)
    assert gt.first_mismatch(good, reference) is None
    mismatch = gt.first_mismatch(gt.as_transformers(_broken(reference), vocab), reference)
    assert mismatch is not None and mismatch.position == 0 and mismatch.text == gt.CHECK_TEXTS[0]
    first = reference.encode(gt.CHECK_TEXTS[0]).ids[0]
    assert mismatch.want == (sp.id_to_piece(first), first) == (sp.id_to_piece(sp.bos_id()), sp.bos_id())
    assert f"but the GGUF's own tokenizer gives {sp.id_to_piece(first)!r} (id {first})" in mismatch.describe()


def _break_conversion(monkeypatch):
    """Make transformers' conversion give :func:`_broken` tokenizers."""
    convert = sources._convert_gguf

    def broken_conversion(gguf):
        from transformers import PreTrainedTokenizerFast

        model, tokenizer = convert(gguf)
        return model, PreTrainedTokenizerFast(tokenizer_object=_broken(tokenizer.backend_tokenizer),
                                              bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)

    monkeypatch.setattr(sources, "_convert_gguf", broken_conversion)


def test_a_broken_converted_tokenizer_is_rebuilt(tiny_spm_gguf, cache, monkeypatch):
    path, sp = tiny_spm_gguf
    _break_conversion(monkeypatch)
    folder = sources.pull_gguf(path)  # the repair is an INFO line, which the convert phase shows only with -v
    assert json.loads((folder / "xpuspec.json").read_text())["tokenizer"] == "rebuilt from the GGUF's metadata"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert tokenizer(text).input_ids == [sp.bos_id()] + sp.encode(text)


def test_an_unrepairable_tokenizer_is_refused_remembered_and_forced(tiny_spm_gguf, cache, monkeypatch):
    path, sp = tiny_spm_gguf
    _break_conversion(monkeypatch)
    rebuild = gt.rebuild_tokenizer
    monkeypatch.setattr(gt, "rebuild_tokenizer", lambda folder, reference, *a: rebuild(folder, _broken(reference), *a))
    with pytest.raises(GGUFTokenizerError, match=r"does not encode like the GGUF's own, even rebuilt from the GGUF's "
                                                  r"metadata: in 'The capital of France is', token 0 is") as first:
        sources.pull_gguf(path)
    assert "another transformers version" not in str(first.value)
    models = cache / "models"
    assert not [p for p in models.iterdir() if p.is_dir()]
    assert not list(models.glob("*.lock"))  # the lock file goes with the failure
    sha = sources.file_sha256(path)
    assert sources.failure_record(sha).is_file()

    calls = []
    monkeypatch.setattr(sources, "_convert_into", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(sources, "file_sha256", lambda p: pytest.fail("the unchanged file was hashed again"))
    with pytest.raises(PullError, match=r"Remembered: converting this file .* failed") as again:
        sources.pull_gguf(path)
    assert str(first.value) in str(again.value) and f"xpuspec pull {path.name} --force" in str(again.value)
    assert calls == []  # answered from the record, not converted again
    assert not list(models.glob("*.lock"))

    monkeypatch.setattr(sources, "_convert_into", lambda gguf, final, *a: (calls.append(gguf), final.mkdir()))
    monkeypatch.setattr(sources, "file_sha256", lambda p: sha)
    assert sources.pull_gguf(path, force=True) == models / f"gguf-{sha}"
    assert calls == [path] and not sources.failure_record(sha).exists()  # a success forgets the failure


def test_another_transformers_version_converts_again(tiny_spm_gguf, cache, monkeypatch):
    path, _ = tiny_spm_gguf
    sha = sources.file_sha256(path)
    record = sources.failure_record(sha)
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"message": "old failure", "when": "then", "transformers": "0.0.1",
                                  "xpuspec": "0.0.1"}))
    calls = []
    monkeypatch.setattr(sources, "_convert_into", lambda gguf, final, *a: (calls.append(gguf), final.mkdir()))
    sources.pull_gguf(path)
    assert calls == [path]


def test_the_cli_force_flag_converts_again(tiny_spm_gguf, cache, monkeypatch, capsys):
    from xpuspec.cli import main

    path, _ = tiny_spm_gguf
    sha = sources.file_sha256(path)
    record = sources.failure_record(sha)
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"message": "tiny.gguf: it failed before", "when": "then", **sources._versions()}))
    assert main(["pull", str(path)]) == 2
    assert "it failed before" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(sources, "_convert_into", lambda gguf, final, *a: (calls.append(gguf), final.mkdir()))
    assert main(["pull", str(path), "--force"]) == 0
    assert calls == [path]


def test_an_unknown_pre_tokenizer_is_named():
    fields = dict(model="gpt2", pre="mystery", tokens=["a", "b", "ab"], merges=["a b"], types=[1, 1, 1])
    with pytest.raises(gt.UnsupportedGGUFTokenizer, match="pre-tokenizer 'mystery' is not one xpuspec builds"):
        gt.reference_tokenizer(_vocab(fields))
