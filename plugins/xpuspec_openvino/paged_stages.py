"""Pipeline stages on paged attention: a model split over several devices that computes, bit for bit, the function
the whole model computes on one (:class:`.paged.PagedRunner`).

Why not the stateful model: on CPUs with dynamic quantization of activations (``DYNAMIC_QUANTIZATION_GROUP_SIZE``,
on by default with AVX512-VNNI or AMX) the whole model's paged attention gives every position the same bits whatever
the pass width, while the stateful model's SDPA rounds differently by query width, and dynamic quantization turns
those last-bit differences into logit differences up to about 0.5. Stages on the stateful model then answered
otherwise than the whole model (issue 42); stages on paged attention, with the whole model's compile properties and
its way of stepping (split steps, else 2-wide 1-token passes: :mod:`.paged`), answer alike
(``benchmarks/results/stage-numerics.md``).

Each stage is cut from the stateful IR (:func:`.graph.split_stages`), then given OpenVINO's paged-attention
transformation, and compiled on its own device with its own KV-cache tensors (``key_cache.*``/``value_cache.*``
of its layers, blocks of ``block_size`` tokens). All stages take the same descriptors (``past_lens``, block
table...), and the residual stream passes from one stage's output ``hidden_states`` to the next stage's input.
One sequence (batch size 1): its block table is the blocks in order; rollback is free (tokens past ``past_lens``
are overwritten by the next pass).
"""

from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import openvino as ov
import torch
from openvino._offline_transformations import paged_attention_transformation

from xpuspec.errors import ModelSourceError
from xpuspec.runner import Runner, on_whole_vocabulary

from . import numerics
from .graph import HIDDEN_IN, LOGITS_TO_KEEP, constant_bytes, keep_head_rows, num_layers, split_stages
from .paged import INITIAL_CAPACITY, paged_model, plugin_threads, stepping, subsequences
from .runner import Stage, balanced_stages
from .ir import read_ir

_CACHE_KINDS = ("key_cache", "value_cache")


def _stage_model(part: ov.Model, last: bool) -> ov.Model:
    """One stage in paged form (changes ``part``): the last keeps the logits of ``logits_to_keep`` positions."""
    if last:
        return paged_model(part)
    paged_attention_transformation(part)
    if not any(i.any_name.startswith("key_cache.") for i in part.inputs):
        raise ModelSourceError("OpenVINO's paged-attention transformation found no attention to convert in a "
                               "pipeline stage of this IR. Load it with ov_config={'ATTENTION_BACKEND': 'SDPA'}.")
    return part


def _hidden_input(compiled: ov.CompiledModel) -> Optional[str]:
    """The name of a later stage's input for the residual stream (the transformation may rename its tensor)."""
    for port in compiled.inputs:
        if HIDDEN_IN in port.names:
            return port.any_name
    return None


class PagedStagesRunner(Runner):
    """A model split into pipeline stages, each on paged attention on its own device (batch size 1).

    Args:
        core: the ``openvino.Core`` to compile with.
        folder: IR folder holding ``openvino_model.xml/.bin`` (stateful, as optimum-intel exports it).
        devices: one xpuspec device name per stage (``["cpu", "cpux"]``, ``["gpu.0", "gpu.1"]``), at least 2.
        configs: OpenVINO compile properties, one dict per stage.
        split: layers per stage; default balanced by weight bytes (:func:`.runner.balanced_stages`).
        head_tokens: score only these token ids (:func:`.graph.keep_head_rows`); ``None``: all.
        is_cpu: per stage, whether its device is a CPU (its instruction-set flags then identify the kernels in the
            cached verdict of :mod:`.numerics`).
        capacity: tokens the KV cache holds before it first grows (doubling, one copy).

    Raises:
        ModelSourceError: the IR is damaged, cannot be split, or cannot take paged attention.
        ValueError: ``split`` does not match the stages and the model's layers.
    """

    attention_backend = "PA"

    def __init__(self, core: ov.Core, folder: Path, devices: Sequence[str], configs: Sequence[dict],
                 split: Optional[Sequence[int]] = None, head_tokens: Optional[Sequence[int]] = None,
                 is_cpu: Optional[Sequence[bool]] = None, capacity: int = INITIAL_CAPACITY):
        self.folder = Path(folder)
        self.device = ",".join(devices)
        self.configs = [dict(c) for c in configs]
        model = read_ir(core, self.folder)
        self.num_layers = num_layers(model)
        self.vocab_size = int(model.output("logits").partial_shape[-1].get_length())
        self.head_tokens = (None if head_tokens is None
                            else torch.as_tensor(keep_head_rows(model, head_tokens), dtype=torch.long))
        counts = list(split) if split is not None else balanced_stages(model, len(devices))
        if len(counts) != len(devices) or len(counts) < 2:
            raise ValueError(f"split={list(counts)} gives {len(counts)} stages for {len(devices)} devices "
                             f"({self.device}); give one layer count per device, at least 2.")
        self.split = [int(c) for c in counts]
        parts = split_stages(model, counts)
        bounds = np.cumsum([0] + counts)
        self.stages: List[Stage] = []
        self._hidden_inputs: List[Optional[str]] = []
        self._cache_inputs: List[list] = []
        for i, (part, device, config) in enumerate(zip(parts, devices, self.configs)):
            held = constant_bytes(part)
            compiled = core.compile_model(_stage_model(part, i == len(parts) - 1), device.upper(), config)
            caches = [p for p in compiled.inputs if p.any_name.split(".")[0] in _CACHE_KINDS]
            hidden = _hidden_input(compiled) if i > 0 else None
            if i > 0 and hidden is None:
                raise ModelSourceError(f"Stage {i} of the paged model lost its {HIDDEN_IN} input. Load it with "
                                       "ov_config={'ATTENTION_BACKEND': 'SDPA'}.")
            names = {p.any_name for p in compiled.inputs}
            self.stages.append(Stage(device, (int(bounds[i]), int(bounds[i + 1])), held,
                                     compiled.create_infer_request(), names,
                                     [str(d) for d in compiled.get_property("EXECUTION_DEVICES")]))
            self._hidden_inputs.append(hidden)
            self._cache_inputs.append(caches)
        value_shape = next(p for p in self._cache_inputs[0] if p.any_name.startswith("value_cache")).partial_shape
        self.block_size = int(value_shape[2].get_length())
        self.weight_bytes = sum(s.weight_bytes for s in self.stages)
        self._blocks = 0
        self._length = 0
        self._grow(-(-capacity // self.block_size))
        #: the fewest subsequences of a split pass: the most threads of a stage (:mod:`.paged`)
        self.split_width = max(plugin_threads(s.request.get_compiled_model()) for s in self.stages)
        found = self._probe_numerics(core, devices, is_cpu or [False] * len(devices))
        #: the width of a 1-token prompt pass (2 where a 1-token pass computes otherwise than wider ones)
        self.prompt_width = found.single_step_width
        self.traits = stepping(found, self.split_width)

    def _probe_numerics(self, core: ov.Core, devices: Sequence[str], is_cpu: Sequence[bool]):
        """How 1-token passes compute against wider ones, and whether split steps match (:mod:`.numerics`),
        measured through every stage and cached per IR, devices, compile properties and split."""
        def measure():
            return numerics.probe(lambda tokens: self.forward(tokens, exact=False), self.rollback, self.reset,
                                  numerics.probe_tokens(self.folder, self.vocab_size),
                                  lambda tokens: self._pass(tokens, len(tokens), split=True))

        identity = {"stages": [numerics.device_identity(core, d.upper(), c) for d, c in zip(devices, is_cpu)]}
        key = {"attention": "PA", "configs": self.configs, "split": self.split,
               "head_tokens": None if self.head_tokens is None else len(self.head_tokens)}
        return numerics.cached_probe(self.folder, identity, key, measure)

    @property
    def length(self) -> int:
        return self._length

    @property
    def device_map(self) -> List[dict]:
        return [{"stage": i, "device": s.device, "layers": list(s.layers), "weight_bytes": s.weight_bytes,
                 "execution_devices": s.execution_devices} for i, s in enumerate(self.stages)]

    def _grow(self, blocks: int) -> None:
        """Reallocate every stage's cache for at least ``blocks`` blocks (doubling), keeping what it holds."""
        blocks = max(blocks, 2 * self._blocks)
        for stage, ports in zip(self.stages, self._cache_inputs):
            for port in ports:
                shape = [blocks] + [d.get_length() for d in list(port.partial_shape)[1:]]
                tensor = ov.Tensor(port.element_type, shape)
                tensor.data[:] = 0
                if self._blocks:
                    tensor.data[: self._blocks] = stage.request.get_tensor(port.any_name).data
                stage.request.set_tensor(port.any_name, tensor)
        self._blocks = blocks

    def forward(self, tokens: Sequence[int], logits_to_keep: Optional[int] = None, exact: bool = True) -> torch.Tensor:
        keep = min(logits_to_keep or len(tokens), len(tokens))
        padding = max(0, self.prompt_width - len(tokens)) if exact else 0
        if padding:  # a 1-token pass that would compute differently from wider ones (module docstring)
            rows = self._pass(list(tokens) + [tokens[-1]] * padding, keep + padding)
            self._length -= padding
            return rows[:keep]
        return self._pass(tokens, keep)

    def forward_steps(self, tokens: Sequence[int]) -> torch.Tensor:
        if not self.traits.split_steps:
            return self.forward(tokens)
        return self._pass(tokens, len(tokens), split=True)

    def _pass(self, tokens: Sequence[int], keep: int, split: bool = False) -> torch.Tensor:
        """One inference over ``tokens`` through every stage, appended to the cache; the last ``keep`` rows.
        ``split``: each token a 1-token subsequence, the pass padded to :attr:`split_width` (:mod:`.paged`)."""
        pad = max(0, self.split_width - len(tokens)) if split else 0
        fed = list(tokens) + [tokens[-1]] * pad
        past, end = self._length, self._length + len(fed)
        if -(-end // self.block_size) > self._blocks:
            self._grow(-(-end // self.block_size))
        parts = subsequences(past, end, split)
        feed = {
            "input_ids": np.asarray(fed, dtype=np.int64),
            "position_ids": np.arange(past, end, dtype=np.int64),
            "past_lens": np.asarray([first for first, _ in parts], dtype=np.int32),
            "subsequence_begins": np.asarray([0] + [last - past for _, last in parts], dtype=np.int32),
            "block_indices": np.concatenate([np.arange(-(-last // self.block_size), dtype=np.int32)
                                             for _, last in parts]),
            "block_indices_begins": np.cumsum([0] + [-(-last // self.block_size) for _, last in parts],
                                              dtype=np.int32),
            "max_context_len": np.array(end, dtype=np.int32),
            LOGITS_TO_KEEP: np.array([keep + pad], dtype=np.int64),
        }
        hidden = None
        for stage, hidden_name in zip(self.stages, self._hidden_inputs):
            inputs = {name: value for name, value in feed.items() if name in stage.inputs}
            if hidden_name is not None:
                inputs[hidden_name] = hidden
            stage.request.infer(inputs, share_inputs=True)
            hidden = stage.request.get_output_tensor(0)
        self._length = end - pad
        rows = torch.from_numpy(np.array(hidden.data, dtype=np.float32).reshape(keep + pad, -1))[:keep]
        return on_whole_vocabulary(rows, self.head_tokens, self.vocab_size)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"rollback({n}) with {self._length} tokens in the KV cache")
        self._length -= n

    def reset(self) -> None:
        self._length = 0
