"""The tokenizer a GGUF file describes, built from its own metadata, and the check of a converted tokenizer against it.

transformers' GGUF loader builds a tokenizer from a GGUF's ``tokenizer.ggml.*`` fields, and it can be wrong: under
transformers 5.5.4 a Gemma-3 GGUF (``tokenizer.ggml.model == "llama"``, no dummy prefix) becomes a Unigram model
over SentencePiece-BPE scores that splits whole words ("The capital of France is" into 10 pieces instead of 5) and
drops BOS although ``add_bos_token`` is set. :func:`reference_tokenizer` builds the tokenizer llama.cpp runs for the
same fields, with the ``tokenizers`` library:

- ``"llama"`` (SentencePiece, llama.cpp's SPM tokenizer): a BPE whose merges join two vocabulary pieces into a
  third, ranked by the third's score (higher first), with byte fallback to the ``<0xNN>`` pieces; spaces become
  ``▁`` and a ``▁`` is put before the text only when ``tokenizer.ggml.add_space_prefix`` is true (its default; Gemma
  sets it false).
- ``"gpt2"`` (byte-level BPE): the GGUF's vocabulary and merges behind the pre-tokenizer ``tokenizer.ggml.pre``
  names: GPT-2's split (``default``, ``gpt2``), the same after single digits (``smollm``, ``starcoder``, ...),
  Qwen2's or Llama-3's split (``qwen2``, ``llama-bpe``; Llama-3 takes a whole word found in the vocabulary before
  its merges).

Control, unknown and user-defined pieces (token types 3, 2, 4) are added tokens, matched whole in the text; BOS and
EOS are added as ``add_bos_token`` and ``add_eos_token`` say. :func:`first_mismatch` compares two tokenizers on
:data:`CHECK_TEXTS`. Sources: the GGUF specification (ggml's docs/gguf.md) and llama.cpp's ``llama-vocab.cpp``.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

log = logging.getLogger("xpuspec")

#: Texts both tokenizers must encode to the same ids: plain prose (the perplexity gate's sentence among them), digits,
#: punctuation, a contraction, newlines, a tab, runs of spaces and characters outside ASCII (byte fallback).
CHECK_TEXTS = (
    "The capital of France is",
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and children "
    "were playing on the grass while their parents watched from the benches.",
    "It's 2024: 12 apples cost $3.50 (about 0.29 each)!\n\ndef f(x):\n\treturn x  +  1  # naïve café, Zürich",
)

#: GGUF token types (``tokenizer.ggml.token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

#: Pre-tokenizer regexes of the byte-level BPE families, as their Hugging Face tokenizers and llama.cpp split text.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
#: ``tokenizer.ggml.pre`` values, by the split they stand for (llama.cpp's names).
GPT2_PRE = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"})
DIGITS_GPT2_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"})
QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen", "megrez", "hunyuan"})


class UnsupportedGGUFTokenizer(ValueError):
    """The GGUF names a tokenizer model or pre-tokenizer :func:`reference_tokenizer` does not build."""


@dataclass
class GGUFVocab:
    """A GGUF's ``tokenizer.ggml.*`` fields.

    Attributes:
        model: ``tokenizer.ggml.model`` (``"llama"``, ``"gpt2"``, ...).
        pre: ``tokenizer.ggml.pre``, or ``"default"``.
        tokens: the pieces, by id.
        scores: SentencePiece scores by id, or ``None``.
        types: token types by id (:data:`NORMAL` ...); all normal when the file has none.
        merges: byte-level BPE merges (``"left right"``), or ``None``.
        bos_id, eos_id, unk_id, pad_id: special token ids, or ``None``.
        add_bos, add_eos: whether encoding adds BOS / EOS.
        add_space_prefix: whether a SentencePiece tokenizer puts ``▁`` before the text.
        chat_template: ``tokenizer.chat_template``, or ``None``.
    """

    model: str
    pre: str
    tokens: List[str]
    scores: Optional[List[float]]
    types: List[int]
    merges: Optional[List[str]]
    bos_id: Optional[int]
    eos_id: Optional[int]
    unk_id: Optional[int]
    pad_id: Optional[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: Optional[str]


def _fields(path: Path) -> Dict[str, object]:
    """The ``tokenizer.*`` fields of a GGUF file, arrays as lists (read without gguf's slow per-item ``contents``)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    out = {}
    for key, field in GGUFReader(str(path)).fields.items():
        if not key.startswith("tokenizer."):
            continue
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                out[key] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                out[key] = np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
        else:
            out[key] = field.contents()
    return out


def read_vocab(path: Path) -> GGUFVocab:
    """The tokenizer fields of the GGUF file at ``path``.

    Raises:
        UnsupportedGGUFTokenizer: the file has no ``tokenizer.ggml.model`` or ``tokenizer.ggml.tokens``.
    """
    f = _fields(Path(path))
    if "tokenizer.ggml.model" not in f or "tokenizer.ggml.tokens" not in f:
        raise UnsupportedGGUFTokenizer("the GGUF has no tokenizer.ggml.model / tokenizer.ggml.tokens fields")
    tokens = f["tokenizer.ggml.tokens"]
    model = str(f["tokenizer.ggml.model"])

    def opt_int(key):
        value = f.get(key)
        return None if value is None else int(value)

    return GGUFVocab(
        model=model, pre=str(f.get("tokenizer.ggml.pre", "default")), tokens=tokens,
        scores=f.get("tokenizer.ggml.scores"), types=f.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens),
        merges=f.get("tokenizer.ggml.merges"), bos_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_id=opt_int("tokenizer.ggml.eos_token_id"), unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
        pad_id=opt_int("tokenizer.ggml.padding_token_id"),
        # llama.cpp's defaults: a SentencePiece vocabulary adds BOS and the space prefix unless the file says not to.
        add_bos=bool(f.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(f.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(f.get("tokenizer.ggml.add_space_prefix", model == "llama")),
        chat_template=f.get("tokenizer.chat_template"),
    )


def _spm_merges(vocab: GGUFVocab, ids: Dict[str, int]) -> List[tuple]:
    """Merges of a SentencePiece vocabulary: every split of a normal piece into two normal pieces, ranked by the
    joined piece's score (higher first), then by id; llama.cpp's SPM tokenizer joins the adjacent pair whose join
    has the highest score."""
    if vocab.scores is None:
        raise UnsupportedGGUFTokenizer("a SentencePiece ('llama') GGUF without tokenizer.ggml.scores")
    normal = {piece: i for piece, i in ids.items() if vocab.types[i] == NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-vocab.scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _bpe_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if pre in GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    if pre in DIGITS_GPT2_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)])
    for names, split in ((LLAMA3_PRE, LLAMA3_SPLIT), (QWEN2_PRE, QWEN2_SPLIT)):
        if pre in names:
            return pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False), byte_level])
    raise UnsupportedGGUFTokenizer(f"byte-level BPE pre-tokenizer {pre!r} is not one xpuspec builds (it builds: "
                                   f"{', '.join(sorted(GPT2_PRE | DIGITS_GPT2_PRE | LLAMA3_PRE | QWEN2_PRE))})")


def reference_tokenizer(vocab: GGUFVocab, vocab_size: Optional[int] = None):
    """The ``tokenizers.Tokenizer`` llama.cpp would run for ``vocab`` (see the module docstring).

    Args:
        vocab: the GGUF's tokenizer fields (:func:`read_vocab`).
        vocab_size: the model's logit rows; added tokens at or past it are left out (a model cannot produce them).

    Raises:
        UnsupportedGGUFTokenizer: a tokenizer model other than ``llama`` / ``gpt2``, an unknown pre-tokenizer, or a
            SentencePiece vocabulary without scores.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    ids: Dict[str, int] = {}
    for i, piece in enumerate(vocab.tokens):
        ids.setdefault(piece, i)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None and vocab.unk_id < len(vocab.tokens) else None
    if vocab.model == "llama":
        byte_fallback = any(t == BYTE for t in vocab.types)
        tok = Tokenizer(models.BPE(vocab=ids, merges=_spm_merges(vocab, ids), unk_token=unk, fuse_unk=True,
                                   byte_fallback=byte_fallback))
        prefix = vocab.add_space_prefix
        # llama.cpp puts the space before each stretch of text that starts the input or follows a special token,
        # even one that starts with a space (Metaspace's prepend_scheme="first" skips those), and never splits.
        spaces = normalizers.Replace(" ", "▁")
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    elif vocab.model == "gpt2":
        if not vocab.merges:
            raise UnsupportedGGUFTokenizer("a byte-level BPE ('gpt2') GGUF without tokenizer.ggml.merges")
        merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
        tok = Tokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=vocab.pre in LLAMA3_PRE))
        tok.pre_tokenizer = _bpe_pre_tokenizer(vocab.pre)
        tok.decoder = decoders.ByteLevel()
    else:
        raise UnsupportedGGUFTokenizer(f"tokenizer model {vocab.model!r} (xpuspec builds 'llama' and 'gpt2')")
    limit = len(vocab.tokens) if vocab_size is None else min(vocab_size, len(vocab.tokens))
    tok.add_tokens([AddedToken(vocab.tokens[i], special=vocab.types[i] != USER_DEFINED, normalized=False)
                    for i in range(limit) if vocab.types[i] in (UNKNOWN, CONTROL, USER_DEFINED)])
    single, special = "$A", []
    for flag, token_id, where in ((vocab.add_bos, vocab.bos_id, "before"), (vocab.add_eos, vocab.eos_id, "after")):
        if flag and token_id is not None:
            piece = vocab.tokens[token_id]
            single = f"{piece} {single}" if where == "before" else f"{single} {piece}"
            special.append((piece, token_id))
    tok.post_processor = processors.TemplateProcessing(single=single, pair=f"{single} {single.replace('$A', '$B')}",
                                                       special_tokens=special)
    return tok


def as_transformers(backend, vocab: GGUFVocab, eos_token: Optional[str] = None, chat_template: Optional[str] = None):
    """``backend`` (:func:`reference_tokenizer`) as a transformers fast tokenizer with the GGUF's special tokens.

    Args:
        eos_token: overrides the GGUF's EOS piece (the converted model config's EOS, when it names one).
        chat_template: overrides the GGUF's ``tokenizer.chat_template``.
    """
    from transformers import PreTrainedTokenizerFast

    def piece(token_id):
        return vocab.tokens[token_id] if token_id is not None and token_id < len(vocab.tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=piece(vocab.bos_id), eos_token=eos_token or piece(vocab.eos_id),
        unk_token=piece(vocab.unk_id), pad_token=piece(vocab.pad_id),
        chat_template=chat_template or vocab.chat_template,
    )


@dataclass(frozen=True)
class Mismatch:
    """Where two tokenizers first encode a text differently.

    Attributes:
        text: the text.
        position: index of the first differing token.
        got, want: that token's ``(piece, id)`` from the checked and the reference tokenizer; ``None`` past the end.
    """

    text: str
    position: int
    got: Optional[tuple]
    want: Optional[tuple]

    def describe(self) -> str:
        def one(pair):
            return "nothing (the encoding ends there)" if pair is None else f"{pair[0]!r} (id {pair[1]})"

        return (f"in {self.text[:60]!r}{'...' if len(self.text) > 60 else ''}, token {self.position} is "
                f"{one(self.got)} but the GGUF's own tokenizer gives {one(self.want)}")


def first_mismatch(tokenizer, reference, texts=CHECK_TEXTS) -> Optional[Mismatch]:
    """The first place where transformers tokenizer ``tokenizer`` and ``tokenizers.Tokenizer`` ``reference`` encode
    one of ``texts`` (special tokens included) to different ids, or ``None`` when they agree on all."""
    for text in texts:
        got = list(tokenizer(text).input_ids)
        want = reference.encode(text).ids
        if got == want:
            continue
        position = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))

        def at(ids, convert):
            return (convert(ids[position]), ids[position]) if position < len(ids) else None

        return Mismatch(text, position, at(got, tokenizer.convert_ids_to_tokens), at(want, reference.id_to_token))
    return None


#: Tokenizer files a converted folder may hold; removed before a rebuilt tokenizer is saved in their place.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")


def rebuild_tokenizer(folder: Path, reference, vocab: GGUFVocab, eos_token: Optional[str], chat_template):
    """Replace the tokenizer saved in ``folder`` by ``reference`` (:func:`as_transformers`)."""
    for stale in TOKENIZER_FILES:
        (Path(folder) / stale).unlink(missing_ok=True)
    as_transformers(reference, vocab, eos_token=eos_token, chat_template=chat_template).save_pretrained(folder)


def check_converted_tokenizer(gguf: Path, folder: Path, config, name: str):
    """Check the tokenizer saved in ``folder`` (converted from ``gguf``) against the GGUF's own; rebuild it from the
    GGUF's metadata where they differ.

    Args:
        gguf: the GGUF file.
        folder: the converted folder, holding the model config and the converted tokenizer.
        config: the converted model's config (its ``vocab_size`` and ``eos_token_id``).
        name: the file as the user named it, for messages.

    Returns:
        ``(tokenizer, verdict)``: the tokenizer now saved in ``folder`` (reloaded with ``AutoTokenizer``), and
        ``"converted"`` (it matched), ``"rebuilt from the GGUF's metadata"``, or ``"unchecked: <why>"`` (a tokenizer
        kind :func:`reference_tokenizer` does not build; logged as a warning, the perplexity gate still runs).

    Raises:
        GGUFTokenizerError: the rebuilt tokenizer, reloaded from ``folder``, still encodes differently.
    """
    from transformers import AutoTokenizer

    from .errors import GGUFTokenizerError

    converted = AutoTokenizer.from_pretrained(folder)
    try:
        vocab = read_vocab(gguf)
        reference = reference_tokenizer(vocab, getattr(config, "vocab_size", None))
    except UnsupportedGGUFTokenizer as exc:
        log.warning("%s: the converted tokenizer is not checked against the GGUF's own: %s", name, exc)
        return converted, f"unchecked: {exc}"
    mismatch = first_mismatch(converted, reference)
    if mismatch is None:
        return converted, "converted"
    log.info("%s: the tokenizer transformers converted from this GGUF does not encode like the GGUF's own (%s); "
             "rebuilding it from the GGUF's vocabulary (%s, pre-tokenizer %r)", name, mismatch.describe(),
             vocab.model, vocab.pre)
    eos = getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    eos_token = vocab.tokens[eos] if isinstance(eos, int) and 0 <= eos < len(vocab.tokens) else None
    rebuild_tokenizer(folder, reference, vocab, eos_token, converted.chat_template)
    rebuilt = AutoTokenizer.from_pretrained(folder)
    mismatch = first_mismatch(rebuilt, reference)
    if mismatch is not None:
        raise GGUFTokenizerError(
            f"{name}: the tokenizer converted from this GGUF ({vocab.model} vocabulary, pre-tokenizer {vocab.pre!r}) "
            f"does not encode like the GGUF's own, even rebuilt from the GGUF's metadata: {mismatch.describe()}. "
            "Nothing was cached. Use the model's Hugging Face folder (config.json, weights and tokenizer.json) "
            "instead of the GGUF.")
    return rebuilt, "rebuilt from the GGUF's metadata"
