"""A stand-in for llama-cpp-python's ``Llama`` at the module boundary the bench uses (``llama_cpp.Llama`` and
``llama_cpp.llama_speculative.LlamaPromptLookupDecoding``), for tests on machines without it (it builds for 15 to 56
minutes).

It keeps the behaviour of llama-cpp-python 0.3 that matters to the bench: ``scores`` has ``n_ctx`` rows when built
with ``logits_all=True`` and ``n_batch`` rows otherwise, while a draft model turns the context's ``logits_all`` on
whatever was asked, so ``eval`` copies every row's logits into ``scores`` in ``n_batch`` chunks, and a prompt past
``n_batch`` tokens fails with numpy's "could not broadcast" as the real one does. Its model: the next token is
``(previous + 1) % VOCAB``. ``FAKE_LLAMA_FAIL=lookup`` makes every call with a draft model fail (a warm-up that fails).
"""

import os
import sys
import types

import numpy as np

VOCAB = 16


class Llama:
    def __init__(self, model_path, n_ctx=512, n_batch=512, logits_all=False, draft_model=None, **kwargs):
        self.n_ctx, self.n_batch, self.draft_model = n_ctx, n_batch, draft_model
        self.context_logits_all = logits_all if draft_model is None else True
        self.scores = np.zeros((n_ctx if logits_all else n_batch, VOCAB), dtype=np.single)
        self.n_tokens = 0

    def reset(self):
        self.n_tokens = 0

    def _eval(self, tokens):
        for i in range(0, len(tokens), self.n_batch):
            batch = tokens[i:i + self.n_batch]
            logits = np.zeros((len(batch), VOCAB), dtype=np.single)
            logits[np.arange(len(batch)), (np.asarray(batch) + 1) % VOCAB] = 1.0
            if self.context_logits_all:
                self.scores[self.n_tokens:self.n_tokens + len(batch), :].reshape(-1)[::] = logits.reshape(-1)
            self.last = logits[-1]
            self.n_tokens += len(batch)

    def generate(self, tokens, reset=True, **kwargs):
        if self.draft_model is not None and os.environ.get("FAKE_LLAMA_FAIL") == "lookup":
            raise RuntimeError("fake llama.cpp: this warm-up fails")
        if reset:
            self.reset()
        tokens = list(tokens)
        while True:
            self._eval(tokens)
            token = int(self.last.argmax())
            yield token
            tokens = [token]


class LlamaPromptLookupDecoding:
    def __init__(self, num_pred_tokens=10, **kwargs):
        self.num_pred_tokens = num_pred_tokens


def install(target=None):
    """Put the fake into ``sys.modules`` (or, given a folder, write it there as the ``llama_cpp`` package, for
    worker processes that have the folder on their ``PYTHONPATH``)."""
    if target is not None:
        package = target / "llama_cpp"
        package.mkdir(parents=True, exist_ok=True)
        source = open(__file__).read()
        (package / "__init__.py").write_text(source)
        (package / "llama_speculative.py").write_text("from . import LlamaPromptLookupDecoding\n")
        return target
    module = types.ModuleType("llama_cpp")
    module.__dict__.update(Llama=Llama, LlamaPromptLookupDecoding=LlamaPromptLookupDecoding)
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = LlamaPromptLookupDecoding
    module.llama_speculative = speculative
    sys.modules["llama_cpp"], sys.modules["llama_cpp.llama_speculative"] = module, speculative
    return module
