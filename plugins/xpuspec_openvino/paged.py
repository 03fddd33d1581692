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
* **Two compiled copies can share one cache**: one runs only 1-token steps, the other every wider pass (prefill,
  padded verify). The CPU plugin re-prepares a model whenever its input length changes, so a loop alternating
  1-token steps with verify passes runs faster with a copy per width. Each compiled copy holds its own repacked
  weights, so the second copy is made only where the widths will alternate (:meth:`PagedRunner.expect_mixed_widths`:
  a draft model, a prompt-lookup target); plain decoding and a target verifying a draft model's rounds at one
  padded width keep one copy.

**1-token passes that compute differently.** Where the plugin's 1-token pass computes otherwise than its wider
passes (:mod:`.numerics` measures it, at tolerance 0), the runner runs every 1-token pass as a 2-token one
(``traits.single_step_width == 2``, the second token rolled back), so that plain steps and verify passes compute
alike and speculative output is the plain output. openvino_genai's engine steps one token at a time, so it does
not decode for such a runner.
"""

import logging
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import openvino as ov
import torch

from xpuspec.errors import ModelSourceError
from xpuspec.runner import Runner, RunnerTraits, on_whole_vocabulary

from . import numerics
from .genai_engine import GenAIGreedy
from .graph import LOGITS_TO_KEEP, keep_head_rows, keep_last_logits, num_layers
from .ir import MODEL_BIN, read_ir

log = logging.getLogger("xpuspec")

#: Tokens the KV cache holds at first; it doubles (one copy) when a request needs more.
INITIAL_CAPACITY = 1024
#: Passes a second compiled copy runs when it is made: its first inferences finish work the compile left, and
#: should not be timed as steps.
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
#: precision: an f32 cache under bf16 inference and a bf16 cache under f32 inference fail to compile; f16 and u8
#: caches compile under either.
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

    attention_backend = "PA"

    def __init__(self, core: ov.Core, folder: Path, device: str, config: dict, capacity: int = INITIAL_CAPACITY,
                 head_tokens: Optional[Sequence[int]] = None, is_cpu: bool = False):
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
        # rollback of the padding is free, and the wide copy keeps one width
        self.traits = RunnerTraits(single_step_width=self._probe_single_step(is_cpu), fixed_verify_width=True)

    def _probe_single_step(self, is_cpu: bool) -> int:
        """The width a 1-token pass runs at: 2 where it computes otherwise than wider passes (:mod:`.numerics`)."""
        def measure():
            return numerics.probe(lambda tokens: self._pass(tokens, len(tokens)), self.rollback, self.reset,
                                  numerics.probe_tokens(self.folder, self.vocab_size))

        identity = numerics.device_identity(self._core, self.device.upper(), is_cpu)
        return numerics.cached_probe(self.folder, identity, self.configs[0], measure).single_step_width

    @property
    def length(self) -> int:
        return self._length

    @property
    def compiled_copies(self) -> int:
        """Compiled copies of the model this runner holds: 1, or 2 after :meth:`expect_mixed_widths`."""
        return 1 if self._step is self._wide else 2

    def expect_mixed_widths(self) -> float:
        """Compile a second copy for the 1-token steps (once; see the module docstring) and run it
        :data:`WARM_UP_PASSES` times; returns the seconds it took (0 when made already). It shares the KV cache
        and holds a second copy of the weights (the RSS grows by about the size of the IR's weights)."""
        if self._step is not self._wide:
            return 0.0
        start = time.perf_counter()
        log.info("%s: a second compiled copy for 1-token steps (about %.0f MiB more)", self.folder.name,
                 self.weight_bytes / 2**20)
        self._step = self._core.compile_model(self._model, self.device.upper(), self.configs[0]).create_infer_request()
        for port in self._cache_inputs:
            self._step.set_tensor(port.any_name, self._wide.get_tensor(port.any_name))
        width = self.traits.single_step_width
        for _ in range(WARM_UP_PASSES):  # past the cache's contents, which stay as they are
            self._pass([0] * width, 1, step=True)
            self._length -= width
        return time.perf_counter() - start

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

    def forward(self, tokens: Sequence[int], logits_to_keep: Optional[int] = None, exact: bool = True) -> torch.Tensor:
        keep = min(logits_to_keep or len(tokens), len(tokens))
        step = self.traits.single_step_width if exact else 1  # the width of this runner's 1-token steps
        padding = max(0, step - len(tokens))
        if padding:  # a 1-token pass that would compute differently from wider ones (module docstring)
            rows = self._pass(list(tokens) + [tokens[-1]] * padding, keep + padding, step=True)[:keep]
            self._length -= padding
            return rows
        return self._pass(tokens, keep, step=len(tokens) == step)

    def _pass(self, tokens: Sequence[int], keep: int, step: bool = False) -> torch.Tensor:
        """One inference over ``tokens``, appended to the cache; the logits of the last ``keep``. ``step``: a pass
        of the steps' width, run on the steps' copy."""
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
        request = self._step if step else self._wide
        request.infer(feed, share_inputs=True)
        self._length = end
        rows = torch.from_numpy(np.array(request.get_output_tensor(0).data, dtype=np.float32).reshape(keep, -1))
        return on_whole_vocabulary(rows, self.head_tokens, self.vocab_size)

    def native_greedy(self, prompt, max_new_tokens, min_new_tokens, eos, on_token):
        """openvino_genai's C++ loop with its paged-attention backend on the same IR and device; ``None``
        where this runner pads its 1-token passes (the engine's would compute otherwise) or scores only some
        tokens (the engine scores all)."""
        if self.traits.single_step_width > 1 or self.head_tokens is not None:
            return None
        return self._genai.generate(prompt, max_new_tokens, min_new_tokens, eos, on_token)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"rollback({n}) with {self._length} tokens in the KV cache")
        self._length -= n

    def reset(self) -> None:
        self._length = 0
