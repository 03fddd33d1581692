"""Which grammar library: xgrammar, llguidance or outlines-core, measured on SmolLM2's 49k vocabulary.

For each library that imports, this compiles one JSON schema (nested objects, enums, arrays, numbers) for the
SmolLM2 tokenizer, then walks the tokens of a valid document (the tokenizer's own tokenization of it) as a decoder
would: at every token the mask of allowed tokens is computed and applied to a ``[1, vocab]`` float32 row (the cost a
decode step pays), the token is checked against the mask and the matcher advanced by it. It prints the compile time
and the mean cost per token (mask + apply + advance), best of ``--repeats`` walks.

Run it with the libraries on ``PYTHONPATH`` (the ones not chosen were installed with ``pip install --no-deps
--target``, so they touch nothing in the environment)::

    PYTHONPATH=.:plugins:/tmp/glib/llg:/tmp/glib/xgr:/tmp/glib/oc python benchmarks/grammar_libraries.py
"""

import argparse
import json
import time

import numpy as np

MODEL = "smollm2-135m-instruct"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "scores": {"type": "array", "items": {"type": "number"}},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "scores", "address", "tags", "active"],
    "additionalProperties": False,
}

DOCUMENT = {"name": "Ada Lovelace", "age": 36, "role": "editor", "scores": [91.5, 78.25, 88.0],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
            "tags": ["mathematics", "analytical engine", "poetry"], "active": True}


def apply_bitmask(row: np.ndarray, bitmask: np.ndarray) -> None:
    """-inf on the tokens a packed little-endian int32 bitmask forbids."""
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:row.shape[-1]].astype(bool)
    row[0, ~allowed] = -np.inf


def walk(step, tokens, vocab):
    """Per-token seconds of ``step`` over ``tokens`` (a fresh zero row each token, not timed)."""
    row = np.zeros((1, vocab), dtype=np.float32)
    times = []
    for token in tokens:
        row[:] = 0.0
        t0 = time.perf_counter()
        ok = step(token, row)
        times.append(time.perf_counter() - t0)
        if not ok:
            raise AssertionError(f"token {token} was masked")
    return np.array(times)


def bench_llguidance(tok, text, tokens, repeats):
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, slices=llguidance.LLTokenizer.json_slices())
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False,
                                                                              "item_separator": ", ",
                                                                              "key_separator": ": "})
    matcher = llguidance.LLMatcher(lltok, grammar)
    t_compile = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)
    vocab = len(tok)

    def step(token, row):
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        apply_bitmask(row, bitmask[0])
        allowed = row[0, token] == 0.0
        matcher.consume_token(token)
        return allowed

    best = None
    for _ in range(repeats):
        matcher.reset()
        times = walk(step, tokens, vocab)
        best = times if best is None or times.mean() < best.mean() else best
    assert matcher.is_accepting(), "document not accepted"
    return {"version": llguidance.__version__ if hasattr(llguidance, "__version__") else "?", "tokenizer_s": t_tok,
            "compile_s": t_compile, "per_token_s": best.mean(), "median_s": float(np.median(best))}


def bench_xgrammar(tok, text, tokens, repeats):
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t_compile = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    vocab = len(tok)

    def step(token, row):
        matcher.fill_next_token_bitmask(bitmask)
        apply_bitmask(row, bitmask[0].numpy())
        allowed = row[0, token] == 0.0
        matcher.accept_token(token)
        return allowed

    best = None
    for _ in range(repeats):
        matcher.reset()
        times = walk(step, tokens, vocab)
        best = times if best is None or times.mean() < best.mean() else best
    return {"version": getattr(xgr, "__version__", "0.2.9"), "tokenizer_s": t_tok, "compile_s": t_compile, "per_token_s": best.mean(), "median_s": float(np.median(best))}


def byte_vocabulary(tok):
    """Token id -> its bytes, undoing the byte-level BPE's printable-character mapping."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    decoder = {chr(c): b for b, c in zip(printable, chars)}
    out = {}
    for piece, i in tok.get_vocab().items():
        if piece in tok.all_special_tokens:
            continue
        out[i] = bytes(decoder[ch] for ch in piece)
    return out


def bench_outlines_core(tok, text, tokens, repeats):
    import outlines_core
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    mapping = {}
    for i, b in byte_vocabulary(tok).items():
        mapping.setdefault(b, []).append(i)
    vocabulary = Vocabulary(tok.eos_token_id, mapping)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")
    index = Index(regex, vocabulary)
    t_compile = time.perf_counter() - t0
    guide = Guide(index)
    vocab = len(tok)
    bitmask = np.zeros(((vocab + 31) // 32,), dtype=np.int32)

    def step(token, row):
        guide.write_mask_into(bitmask.ctypes.data, bitmask.size, bitmask.itemsize)
        apply_bitmask(row, bitmask)
        allowed = row[0, token] == 0.0
        guide.advance(token)
        return allowed

    best = None
    for _ in range(repeats):
        guide.reset()
        times = walk(step, tokens, vocab)
        best = times if best is None or times.mean() < best.mean() else best
    return {"version": getattr(outlines_core, "__version__", "0.2.x"), "tokenizer_s": t_tok, "compile_s": t_compile,
            "per_token_s": best.mean(), "median_s": float(np.median(best))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--libraries", default="llguidance,xgrammar,outlines_core")
    args = parser.parse_args()
    import transformers

    from xpuspec import pull

    tok = transformers.AutoTokenizer.from_pretrained(pull(MODEL))
    text = json.dumps(DOCUMENT)
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    print(f"vocabulary {len(tok)}; document {len(text)} chars, {len(tokens)} tokens; load {open('/proc/loadavg').read().strip()}")
    for name in args.libraries.split(","):
        try:
            figures = globals()[f"bench_{name}"](tok, text, tokens, args.repeats)
        except Exception as exc:  # a library that does not import or run here is a finding, not a crash
            print(f"{name}: FAILED {type(exc).__name__}: {exc}")
            continue
        print(f"{name} {figures['version']}: tokenizer setup {figures['tokenizer_s'] * 1e3:.0f} ms, compile "
              f"{figures['compile_s'] * 1e3:.1f} ms, per token (mask + apply + advance) "
              f"mean {figures['per_token_s'] * 1e6:.0f} us, median {figures['median_s'] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
