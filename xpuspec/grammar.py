"""Structured output: a grammar (JSON schema, any JSON object, Lark, regex) masks the target's scores.

``generate(..., response_format=...)`` and the server's ``response_format`` take what OpenAI and vLLM users know:

- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON valid against the
  schema (OpenAI's structured outputs);
- ``{"type": "json_object"}``: any JSON object (OpenAI's JSON mode);
- ``{"type": "grammar", "grammar": "<Lark/EBNF>"}`` and ``{"type": "regex", "regex": "..."}``: vLLM's
  ``guided_grammar`` / ``guided_regex`` under ``response_format`` (Lark syntax, llguidance's flavour, which also reads
  most GBNF-style rules);
- ``{"type": "text"}`` or ``None``: no constraint.

The grammar engine is llguidance (Microsoft's Rust implementation of constrained decoding, a dependency without
torch; chosen by measurement against xgrammar and outlines-core: benchmarks/results/structured-output.md).

A :class:`GrammarMatcher` follows one request: :meth:`GrammarMatcher.mask_rows` masks the rows of a verify pass,
row i by the grammar's state after the context and ``drafts[:i]`` (so every verified position is constrained as
plain decoding would constrain it); :meth:`GrammarMatcher.keep` keeps the accepted drafts and the target's token and
rolls the grammar's state back past the rejected drafts (llguidance's own rollback); :meth:`GrammarMatcher.valid_prefix`
says how many of a draft the grammar allows, so drafts are cut before verification; :meth:`GrammarMatcher.forced`
gives the tokens the grammar forces next, which greedy rounds without a draft verify as free drafts (JSON's fixed
keys and punctuation cost no decode step when the target agrees). End of sequence is allowed only
where the grammar accepts (a complete document); once the grammar is complete and allows nothing more, EOS is the
only allowed token, so generation ends there.
"""

import json
import threading
import time
from collections import OrderedDict
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import ResponseFormatError

#: Formats of ``response_format["type"]`` (``"text"``: no constraint).
FORMAT_TYPES = ("json_schema", "json_object", "grammar", "regex", "text")

#: Compiled grammars kept per tokenizer (least recently used ones leave first).
CACHE_SIZE = 64

#: JSON layout of schema-constrained output: one space after ``:`` and ``,`` (as ``json.dumps`` writes), no free
#: whitespace: a small model constrained with free whitespace can fill the output with newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError as exc:  # a dependency of xpuspec: only a broken install lacks it
        raise ImportError("response_format needs the llguidance package (a dependency of xpuspec): "
                          "pip install llguidance") from exc
    return llguidance


def grammar_of(response_format) -> Optional[Tuple[str, str]]:
    """``(kind, llguidance grammar text)`` of a ``response_format`` (see the module docstring), or ``None`` for no
    constraint; the key of the compiled-grammar cache.

    Raises:
        ResponseFormatError: not a dict, an unknown ``type``, a missing or mistyped field, a schema that is not a JSON
            object or not valid JSON text.
    """
    if response_format is None:
        return None
    if hasattr(response_format, "model_dump"):  # a pydantic model (the server's protocol)
        response_format = response_format.model_dump(exclude_none=True, by_alias=True)
    if not isinstance(response_format, dict):
        raise ResponseFormatError(f"response_format must be a dict such as {{'type': 'json_object'}}, got "
                                  f"{type(response_format).__name__}.")
    kind = response_format.get("type")
    if kind not in FORMAT_TYPES:
        raise ResponseFormatError(f"response_format type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r}.")
    llg = _llguidance()
    if kind == "text":
        return None
    if kind == "json_object":
        return kind, llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ResponseFormatError("response_format json_schema must be an object "
                                      "{'name': ..., 'schema': {...}}, got "
                                      f"{type(spec).__name__ if spec is not None else 'nothing'}.")
        schema = spec.get("schema", spec.get("schema_"))
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ResponseFormatError(f"response_format json_schema.schema is not valid JSON: {exc}") from None
        if schema is None:
            schema = {"type": "object"} if "name" in spec else None
        if not isinstance(schema, (dict, bool)):
            raise ResponseFormatError("response_format json_schema.schema must be a JSON schema object, got "
                                      f"{type(schema).__name__}.")
        _check_schema(schema)
        return kind, llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    text = response_format.get(kind)
    if not isinstance(text, str) or not text.strip():
        raise ResponseFormatError(f"response_format of type {kind!r} needs a non-empty string field {kind!r}.")
    return kind, (llg.LLMatcher.grammar_from_lark(text) if kind == "grammar" else llg.LLMatcher.grammar_from_regex(text))


def _check_schema(schema) -> None:
    """Refuse a schema that breaks the JSON Schema meta-schema (where ``jsonschema`` is installed), naming the
    problem; llguidance then refuses what it does not support."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(top level)"
        raise ResponseFormatError(f"response_format json_schema.schema is not a valid JSON schema at {where}: "
                                  f"{exc.message}") from None


class GrammarCompiler:
    """Compiles response formats for one tokenizer; compiled grammars are cached (``CACHE_SIZE``, LRU).

    Args:
        tokenizer: a fast Hugging Face tokenizer of the model.
        vocab_size: the width of the model's logits (the mask's width; ids past the tokenizer are forbidden).
        eos: the model's end-of-sequence ids.

    Thread-safe. Building the tokenizer's token trie costs about a second (once per model); a grammar compiles in
    milliseconds; a request's matcher is a copy of the compiled one.
    """

    def __init__(self, tokenizer, vocab_size: int, eos: Iterable[int]):
        llg = _llguidance()
        import llguidance.hf

        eos = sorted(set(int(e) for e in eos))
        self.eos = eos
        self.vocab_size = int(vocab_size)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos or None)
        self._llg = llg
        self._cache: "OrderedDict[Tuple[str, str], object]" = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, response_format):
        """The compiled grammar of ``response_format`` (a template matcher), or ``None`` for no constraint.

        Raises:
            ResponseFormatError: as :func:`grammar_of`, or a grammar llguidance refuses (its message says where).
        """
        key = grammar_of(response_format)
        if key is None:
            return None
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        template = self._llg.LLMatcher(self.tokenizer, key[1], log_level=0)
        if template.is_error():
            raise ResponseFormatError(f"response_format {key[0]} cannot be compiled: {template.get_error()}")
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def matcher(self, response_format, eos: Iterable[int]) -> Optional["GrammarMatcher"]:
        """A fresh :class:`GrammarMatcher` for one request (``None`` for no constraint); ``eos``: the request's
        end-of-sequence ids."""
        template = self.compile(response_format)
        return None if template is None else GrammarMatcher(template.deep_copy(), self.vocab_size, eos, self.eos)


class GrammarMatcher:
    """The grammar's state along one request's tokens (see the module docstring).

    Args:
        matcher: a llguidance ``LLMatcher`` of its own (a copy of the compiled grammar).
        vocab_size: the width of the model's logits.
        eos: the request's end-of-sequence ids (allowed exactly where the grammar accepts).
        grammar_eos: the tokenizer's EOS ids the grammar knows; those not in ``eos`` are never allowed.

    Contract: the matcher's state is the request's output so far, except between :meth:`mask_rows` (which advances
    it through the drafts it masks) and :meth:`keep` (which rolls back what was not kept). Token ids are ints in
    ``[0, vocab_size)``; rows are float tensors ``[n, vocab_size]``.

    Attributes:
        busy_s: seconds spent in the grammar (masks, advances, rollbacks) for this request.
    """

    def __init__(self, matcher, vocab_size: int, eos: Iterable[int], grammar_eos: Iterable[int] = ()):
        self._m = matcher
        self.vocab_size = vocab_size
        self.eos = sorted(set(int(e) for e in eos if 0 <= int(e) < vocab_size))
        # the tokenizer's EOS ids that this request does not end at (its own eos_token_id): never allowed
        self._grammar_eos = [e for e in grammar_eos if e not in self.eos and 0 <= e < vocab_size]
        self._bitmask = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)
        self._pending = 0  # drafts the state has advanced through since the last keep
        self.busy_s = 0.0

    # -- the mask ---------------------------------------------------------------------------------------------
    def allowed(self) -> torch.Tensor:
        """The tokens allowed next, a bool tensor ``[vocab_size]``: the grammar's mask, the request's EOS ids only
        where the grammar accepts (the output so far is complete)."""
        self._m.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        accepting = self._m.is_accepting()
        allowed[self.eos] = accepting
        if self._grammar_eos:
            allowed[self._grammar_eos] = False
        if self._m.is_error():
            raise RuntimeError(f"grammar matcher error: {self._m.get_error()}")
        return torch.from_numpy(allowed)

    def mask_rows(self, drafts: Sequence[int], rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (``[len(drafts) + 1, vocab]``, a verify pass) with row i's forbidden tokens at -inf, row i
        masked by the state after ``drafts[:i]``; a new tensor (``rows`` is left as it is). Leaves the state
        advanced through ``drafts`` until :meth:`keep`. ``drafts`` must be allowed (cut by :meth:`valid_prefix`)."""
        t0 = time.perf_counter()
        masked = rows.clone()
        width = min(masked.shape[-1], self.vocab_size)
        for i in range(len(drafts) + 1):
            allowed = self.allowed()
            masked[i, :width].masked_fill_(~allowed[:width], float("-inf"))
            if masked.shape[-1] > width:
                masked[i, width:] = float("-inf")
            if i < len(drafts):
                if not self._m.consume_token(int(drafts[i])):
                    raise RuntimeError(f"draft token {drafts[i]} is not allowed by the grammar: cut drafts with "
                                       f"valid_prefix first ({self._m.get_error()})")
                self._pending += 1
        self.busy_s += time.perf_counter() - t0
        return masked

    # -- moving along -----------------------------------------------------------------------------------------
    def keep(self, kept_drafts: int, token: Optional[int]) -> None:
        """After verification: keep the first ``kept_drafts`` of the drafts :meth:`mask_rows` advanced through
        (rolling back the rest), then advance by the target's ``token`` (``None``: not emitted; an EOS id: the
        request ends, the state stays)."""
        t0 = time.perf_counter()
        back = self._pending - kept_drafts
        if back < 0:
            raise ValueError(f"kept {kept_drafts} drafts of {self._pending} masked")
        if back and not self._m.rollback(back):
            raise RuntimeError(f"grammar rollback of {back} tokens failed: {self._m.get_error()}")
        self._pending = 0
        if token is not None and token not in self.eos:
            if not self._m.consume_token(int(token)):  # every token was masked: another rule forbade the rest
                raise RuntimeError(
                    f"token {token} is not allowed by the grammar ({self._m.get_error()}): no token the grammar "
                    "allows here was left by the other generation settings (min_new_tokens forbids EOS where the "
                    "document is complete?)")
        self.busy_s += time.perf_counter() - t0

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a draft after the output so far) the grammar allows in a row, EOS ids excluded
        (a draft is cut before an EOS: the target's own token ends the request); the state is not changed."""
        if not tokens:
            return 0
        t0 = time.perf_counter()
        tokens = list(tokens)
        cut = next((i for i, t in enumerate(tokens) if t in self.eos or not 0 <= t < self.vocab_size), len(tokens))
        n = self._m.validate_tokens(tokens[:cut]) if cut else 0
        self.busy_s += time.perf_counter() - t0
        return n

    def forced(self, k: int) -> list:
        """Up to ``k`` tokens the grammar forces next (llguidance's fast-forward tokens: the canonical tokenization of
        the only bytes it allows, such as ``, "key": "`` between an object's fixed fields), EOS ids excluded; the
        state is not changed. They make free drafts: verification still decides (the target may spell the same
        bytes with other tokens)."""
        if k < 1:
            return []
        t0 = time.perf_counter()
        tokens = [t for t in self._m.compute_ff_tokens()[:k]]
        n = self.valid_prefix(tokens)
        self.busy_s += time.perf_counter() - t0
        return tokens[:n]

    @property
    def accepting(self) -> bool:
        """The output so far is a complete document of the grammar (EOS may end it)."""
        return self._m.is_accepting()

