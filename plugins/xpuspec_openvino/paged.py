"""Runner over the paged-attention form of an OpenVINO LLM IR: one compiled copy, and a second for 1-token steps
where the passes alternate widths.

OpenVINO's ``paged_attention_transformation`` (the one openvino_genai applies for its default
``ATTENTION_BACKEND="PA"``) turns the stateful IR into a stateless one: the KV cache becomes inputs
``key_cache.<layer>`` / ``value_cache.<layer>`` (blocks of ``block_size`` tokens, shaped by the plugin,
``[blocks, kv_heads, block_size, head_dim]`` on CPU) that the caller allocates and owns, and the
tokens are described by ``past_lens``, ``subsequence_begins``, ``block_indices``,
``block_indices_begins`` and ``max_context_len``. Inputs ``input_ids`` and ``position_ids`` are
int64 ``[n]``; ``logits`` come out as ``[n, 1, vocab]``.

Owning the cache buys two things a stateful model cannot give a speculative loop:

* **Rollback is free and exact**: tokens past ``past_lens`` are simply overwritten by the next pass.
* **Two compiled copies can share one cache**: one runs only 1-token steps, the other every wider pass
  (prefill, padded verify). The CPU plugin re-prepares a model whenever its input length changes;
  alternating 1-token steps with 6-token verify passes on one model cost 23.1 and 38.0 ms against
  17.7 and 32.8 ms when each width has its own copy (SmolLM2-135M int8_asym, f32 KV cache, context
  300, 2-core AVX2 CPU, median of 20, session script). A 6-token verify then costs 1.9x a 1-token step.

**The second copy only where the widths alternate.** Each compiled copy holds its own repacked weights:
on a 2-core Xeon with AMX, Qwen2.5-Coder-1.5B int8_asym held 3253 MiB of anonymous memory with two copies
and 1752 with one (after loading; its 1601 MiB of mapped IR alike), while alternating 2- and 6-token passes
cost 81.1 and 100.8 ms with two copies against 92.5 and 108.5 on one. Most loops do not alternate: plain
decoding prefills once and then steps; a target verifying a draft model's rounds runs one padded width. So
a runner compiles one copy, and a second for the steps when told the passes will alternate
(:meth:`PagedRunner.expect_mixed_widths`: a draft model, a prompt-lookup target). Measured in one process,
the variants alternated per prompt, outputs identical (same Xeon, greedy, session script): one copy against
two for the target, Qwen2.5-Coder 1.5B int8 + 0.5B int4 hybrid 23.1 against 22.5 tok/s, SmolLM2 plain 102.1
against 103.2 and self-speculation 105.3 against 105.7; but SmolLM2 prompt lookup 139.4 against 145.3, and
the Qwen hybrid's draft on one copy 21.7 against 23.1. A hybrid's target keeps one copy also once its draft
model is dropped and its lookup alone alternates (SmolLM2 hybrid, which drops it: 146.9 against 153.3 tok/s
with two): the Qwen hybrid drops it in some requests, and a second copy then would hold 1.5 GB more for the
rest of the model's life (peak RSS 6054 against 4555 MiB after one such request).

Measured against the stateful SDPA runner on the same IR: prompt logits agree within 3e-5, 30
greedy steps within 5.4e-5 with no argmax flip (AVX2 CPU).

**Single-token passes that compute differently.** On CPUs with AVX512-VNNI or AMX the CPU plugin
quantizes activations of INT8/INT4 layers on the fly (``DYNAMIC_QUANTIZATION_GROUP_SIZE``, 32 by
default), and a 1-token pass then takes another kernel than a wider one: on a Xeon with AMX
(SmolLM2-135M int8_asym) 16 single steps differ from one 16-token pass by up to 1.03 in the logits,
while passes of 2, 3, 4, 5, 6 and 16 tokens agree bit for bit. Without dynamic quantization all
agree (1.2e-4), but a step costs 17-19 ms instead of 10-11 and a 6-token pass 21-22 ms instead of
13-14. So the runner checks at load whether its 1-token pass computes like a 2-token one and, where
it does not, runs every 1-token pass as a 2-token one (``single_step_width = 2``, the second token
rolled back): plain steps and verify passes then compute alike, and speculative output stays the
plain output. openvino_genai's engine steps one token at a time, so it does not decode for such a
runner.
"""

import logging
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import openvino as ov
import torch

from xpuspec.errors import ModelSourceError
from xpuspec.runner import Runner, on_whole_vocabulary

from .genai_engine import GenAIGreedy
from .graph import LOGITS_TO_KEEP, keep_head_rows, keep_last_logits, num_layers
from .ir import MODEL_BIN, read_ir

log = logging.getLogger("xpuspec")

#: Tokens the KV cache holds at first; it doubles (one copy) when a request needs more.
INITIAL_CAPACITY = 1024
#: Passes a second compiled copy runs when it is made, before any timed use. Its first inference does
#: work the compile left (Qwen2.5-Coder-0.5B int4 draft, 2-core AMD EPYC: 1436 ms, then 40, 40, 36 and
#: from the fifth 23 ms a step); inside a request the decode loop's cost model took that for the draft
#: step, found that speculation could not pay and dropped the draft model, and two such requests made
#: the next 16 skip it (:mod:`xpuspec.speculative.memory`).
WARM_UP_PASSES = 4
_DESCRIPTORS = ("input_ids", "position_ids", "past_lens", "subsequence_begins", "block_indices",
                "block_indices_begins", "max_context_len", LOGITS_TO_KEEP)


def paged_model(model: ov.Model) -> ov.Model:
    """Apply OpenVINO's paged-attention transformation and make the LM head run on the last
    ``logits_to_keep`` positions only (changes ``model`` in place).

    Raises:
        ModelSourceError: the IR has no SDPA that the transformation can turn into paged attention.
    """
    from openvino._offline_transformations import paged_attention_transformation

    paged_attention_transformation(model)
    if not any(i.any_name.startswith("key_cache.") for i in model.inputs):
        raise ModelSourceError("OpenVINO's paged-attention transformation found no attention to convert in this "
                               "IR. Load it with ov_config={'ATTENTION_BACKEND': 'SDPA'}.")
    return keep_last_logits(model, axis=0)


#: KV-cache precisions that the CPU plugin's paged attention takes only under the same inference
#: precision (openvino 2026.4.1 on a Xeon with AMX: an f32 cache under bf16 inference and a bf16 cache
#: under f32 inference fail to compile; f16 and u8 caches compile under either).
_CACHE_NEEDS_SAME_PRECISION = ("f32", "bf16")
_TYPE_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint8": "u8"}


def _type_name(value) -> str:
    name = value.get_type_name() if isinstance(value, ov.Type) else str(value).lower()
    return _TYPE_NAMES.get(name, name)


def check_cpu_cache_precision(core: ov.Core, device: str, config: dict) -> None:
    """Refuse, before compiling, a KV-cache precision that paged attention on CPU ``device`` (an
    OpenVINO CPU device name) rejects under the inference precision in force: ``config``'s
    ``INFERENCE_PRECISION_HINT``, else the plugin's default (bf16 on CPUs with AVX512-BF16 or AMX,
    f32 elsewhere).

    Raises:
        ValueError: an f32 or bf16 ``KV_CACHE_PRECISION`` under another inference precision.
    """
    cache = config.get("KV_CACHE_PRECISION")
    if cache is None or _type_name(cache) not in _CACHE_NEEDS_SAME_PRECISION:
        return
    hint = config.get("INFERENCE_PRECISION_HINT")
    precision = _type_name(hint if hint is not None else core.get_property(device.upper(), "INFERENCE_PRECISION_HINT"))
    if precision != _type_name(cache):
        raise ValueError(
            f"ov_config KV_CACHE_PRECISION={cache!r} needs INFERENCE_PRECISION_HINT={_type_name(cache)!r} on this CPU "
            f"(in force: {precision!r}; an f32 KV cache is xpuspec's default where ov_config sets none): OpenVINO's CPU paged attention keeps an f32 or bf16 KV cache only in its own "
            "compute precision. Set both alike (xpuspec's default is f32 for both, which keeps speculative decoding "
            "exact), use KV_CACHE_PRECISION 'u8' or 'f16', or ATTENTION_BACKEND='SDPA'.")


class PagedRunner(Runner):
    """A whole model on one device, with a paged KV cache (batch size 1); see the module docstring.

    Args:
        core: the ``openvino.Core`` to compile with.
        folder: IR folder holding ``openvino_model.xml/.bin`` (stateful, as optimum-intel exports it).
        device: xpuspec device name (``"cpu"``, ``"gpu.1"``).
        config: OpenVINO compile properties (``KV_CACHE_PRECISION`` sets the cache's element type).
        capacity: tokens the KV cache holds before it first grows.
        head_tokens: score only these token ids (a draft's LM head cut to frequent tokens,
            :func:`.graph.keep_head_rows`); the logits of every other token are ``-inf``. ``None``: all.

    Raises:
        ModelSourceError: the IR is damaged or cannot take paged attention.
    """

    fixed_verify_width = True  # rollback of the padding is free, and the wide copy keeps one width
    attention_backend = "PA"

    def __init__(self, core: ov.Core, folder: Path, device: str, config: dict, capacity: int = INITIAL_CAPACITY,
                 head_tokens: Optional[Sequence[int]] = None):
        self.folder, self.device, self.configs = Path(folder), device, [dict(config)]
        model = read_ir(core, self.folder)
        self.num_layers = num_layers(model)
        self.vocab_size = int(model.output("logits").partial_shape[-1].get_length())
        self.head_tokens = (None if head_tokens is None
                            else torch.as_tensor(keep_head_rows(model, head_tokens), dtype=torch.long))
        paged_model(model)
        self._core, self._model = core, model  # for a step copy (the compiled model keeps the constants anyway)
        compiled = core.compile_model(model, device.upper(), self.configs[0])
        self._wide = compiled.create_infer_request()
        self._step = self._wide  # until expect_mixed_widths() compiles a copy of its own
        self._cache_inputs = [i for i in compiled.inputs if i.any_name.split(".")[0] in ("key_cache", "value_cache")]
        unknown = {i.any_name for i in compiled.inputs} - set(_DESCRIPTORS) - {i.any_name for i in self._cache_inputs}
        if unknown:
            raise ModelSourceError(f"The paged-attention model has inputs xpuspec does not feed: {sorted(unknown)}. "
                                   "Load it with ov_config={'ATTENTION_BACKEND': 'SDPA'}.")
        value_shape = next(i for i in self._cache_inputs if i.any_name.startswith("value_cache")).partial_shape
        self.block_size = int(value_shape[2].get_length())
        self.weight_bytes = (self.folder / MODEL_BIN).stat().st_size
        self.execution_devices = [str(d) for d in compiled.get_property("EXECUTION_DEVICES")]
        self._blocks = 0
        self._length = 0
        self._grow(capacity)
        self._genai = GenAIGreedy(self.folder, device.upper(), config, attention_backend="PA")
        self.single_step_width = 2 if self._single_step_differs() else 1

    def _single_step_differs(self, tolerance: float = 1e-2) -> bool:
        """Whether two 1-token passes give other logits than one 2-token pass over the same tokens (by
        more than ``tolerance``; differences in accumulation order stay near 1e-4). Leaves the cache empty."""
        tokens = [i % self.vocab_size for i in range(1, 7)]
        self.forward(tokens[:4])
        wide = self.forward(tokens[4:])
        self.rollback(2)
        steps = torch.cat([self.forward(tokens[4:5]), self.forward(tokens[5:])])
        self.reset()
        return float((wide - steps).nan_to_num(0.0).abs().max()) > tolerance  # -inf - -inf: a token not scored

    @property
    def length(self) -> int:
        return self._length

    @property
    def compiled_copies(self) -> int:
        """Compiled copies of the model this runner holds: 1, or 2 after :meth:`expect_mixed_widths`."""
        return 1 if self._step is self._wide else 2

    def expect_mixed_widths(self) -> None:
        """Compile a second copy for the 1-token steps (once; see the module docstring) and run it
        :data:`WARM_UP_PASSES` times. It shares the KV cache and holds a second copy of the weights (the RSS
        grows by about the size of the IR's weights)."""
        if self._step is not self._wide:
            return
        log.info("%s: a second compiled copy for 1-token steps (about %.0f MiB more)", self.folder.name,
                 self.weight_bytes / 2**20)
        self._step = self._core.compile_model(self._model, self.device.upper(), self.configs[0]).create_infer_request()
        for port in self._cache_inputs:
            self._step.set_tensor(port.any_name, self._wide.get_tensor(port.any_name))
        for _ in range(WARM_UP_PASSES):  # past the cache's contents, which stay as they are
            self._pass([0] * self.single_step_width, 1)
            self._length -= self.single_step_width

    @property
    def device_map(self) -> List[dict]:
        return [{"stage": 0, "device": self.device, "layers": [0, self.num_layers], "weight_bytes": self.weight_bytes,
                 "execution_devices": self.execution_devices}]

    @property
    def capacity(self) -> int:
        """Tokens the KV cache holds now."""
        return self._blocks * self.block_size

    def _grow(self, tokens: int) -> None:
        """Reallocate the cache for at least ``tokens`` tokens (doubling), keeping what it holds."""
        blocks = max(-(-tokens // self.block_size), 2 * self._blocks)
        for port in self._cache_inputs:
            shape = [blocks] + [d.get_length() for d in list(port.partial_shape)[1:]]
            tensor = ov.Tensor(port.element_type, shape)
            if self._blocks:
                tensor.data[: self._blocks] = self._wide.get_tensor(port.any_name).data
            else:
                tensor.data[:] = 0
            self._step.set_tensor(port.any_name, tensor)
            self._wide.set_tensor(port.any_name, tensor)
        self._blocks = blocks

    def forward(self, tokens: Sequence[int], logits_to_keep: Optional[int] = None) -> torch.Tensor:
        keep = min(logits_to_keep or len(tokens), len(tokens))
        padding = max(0, self.single_step_width - len(tokens))
        if padding:  # a 1-token pass that would compute differently from wider ones (module docstring)
            rows = self._pass(list(tokens) + [tokens[-1]] * padding, keep + padding)[:keep]
            self._length -= padding
            return rows
        return self._pass(tokens, keep)

    def _pass(self, tokens: Sequence[int], keep: int) -> torch.Tensor:
        """One inference over ``tokens``, appended to the cache; the logits of the last ``keep``."""
        n, past = len(tokens), self._length
        end = past + n
        if end > self.capacity:
            self._grow(end)
        blocks = -(-end // self.block_size)
        feed: Dict[str, np.ndarray] = {
            "input_ids": np.asarray(tokens, dtype=np.int64),
            "position_ids": np.arange(past, end, dtype=np.int64),
            "past_lens": np.array([past], dtype=np.int32),
            "subsequence_begins": np.array([0, n], dtype=np.int32),
            "block_indices": np.arange(blocks, dtype=np.int32),
            "block_indices_begins": np.array([0, blocks], dtype=np.int32),
            "max_context_len": np.array(end, dtype=np.int32),
            LOGITS_TO_KEEP: np.array([keep], dtype=np.int64),
        }
        request = self._step if n == self.single_step_width else self._wide
        request.infer(feed, share_inputs=True)
        self._length = end
        rows = torch.from_numpy(np.array(request.get_output_tensor(0).data, dtype=np.float32).reshape(keep, -1))
        return on_whole_vocabulary(rows, self.head_tokens, self.vocab_size)

    def native_greedy(self, prompt, max_new_tokens, min_new_tokens, eos, on_token):
        """openvino_genai's C++ loop with its paged-attention backend on the same IR and device; ``None``
        where this runner pads its 1-token passes (the engine's would compute otherwise) or scores only some
        tokens (the engine scores all)."""
        if self.single_step_width > 1 or self.head_tokens is not None:
            return None
        return self._genai.generate(prompt, max_new_tokens, min_new_tokens, eos, on_token)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"rollback({n}) with {self._length} tokens in the KV cache")
        self._length -= n

    def reset(self) -> None:
        self._length = 0
