"""Runner over a stateful OpenVINO IR (as exported by optimum-intel), whole or split into pipeline stages.

The IR keeps its KV cache in variable states shaped ``[batch, kv_heads, seq, head_dim]``
(sequence on axis 2). Inputs: ``input_ids [1,n] i64``, ``attention_mask [1,past+n] i64``,
``position_ids [1,n] i64``, ``beam_idx [1] i32``; output ``logits [1,n,vocab]``. At load the
LM head is made to run on the last ``logits_to_keep`` positions only (:func:`graph.keep_last_logits`),
so a prefill computes one row of logits, not one per prompt token.

Pipeline stages (:func:`graph.split_stages`) run one after another, each compiled on its own
device and holding the KV cache of its own layers; the hidden states of the last position block
pass from one stage's output to the next stage's input. All stages see the same
``attention_mask`` and ``position_ids``, so rollback and compaction apply to each alike.

Rollback masks rather than copies: rejected tokens stay in the state tensors as *slots* whose
``attention_mask`` entry is 0, while ``position_ids`` count only live tokens, so the next
tokens see exactly the accepted prefix at the right positions. A copy of the states without
the dead slots (compaction) happens only once more than ``max_dead_slots`` pile up: a copy-trim
costs a large part of a decode step, masking nothing (``benchmarks/results/HISTORY.md``, "Rollback
and verify width"). This needs an exact KV cache: never combine it with a u8 KV cache that changes
with the sequence (see ``compile_config``).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Set, Tuple

import numpy as np
import openvino as ov
import torch

from xpuspec.runner import Runner, RunnerTraits, on_whole_vocabulary
from xpuspec.stages import balanced_split

from .genai_engine import GenAIGreedy
from .graph import (HIDDEN_IN, LOGITS_TO_KEEP, constant_bytes, keep_head_rows, keep_last_logits, layer_bytes, num_layers,
                    split_stages)
from .ir import MODEL_BIN, read_ir

SEQ_AXIS = 2
#: Dead (masked-out) slots allowed in the KV cache before it is compacted.
MAX_DEAD_SLOTS = 64


def balanced_stages(model: ov.Model, stages: int) -> List[int]:
    """Layers per stage, balanced by weight bytes; the embedding counts for the first stage, the
    final norm and LM head for the last (half the shared bytes each: one matrix when tied)."""
    if stages == 1:
        return [num_layers(model)]
    sizes = layer_bytes(model)
    shared = constant_bytes(model) - sum(sizes)
    return balanced_split(sizes, shared // 2, shared - shared // 2, stages)


@dataclass
class Stage:
    """One compiled part of the model: layers ``[first, end)`` on ``device``; ``weight_bytes``: the bytes
    of the constants it holds (the IR's ``.bin`` size when the model is not split)."""

    device: str
    layers: Tuple[int, int]
    weight_bytes: int
    request: ov.InferRequest
    inputs: Set[str]
    execution_devices: List[str]


class OpenVINORunner(Runner):
    """A stateful IR compiled on one device, or split into stages over several (batch size 1).

    Verify passes are padded to one width (``fixed_verify_width``): a new input length costs the CPU
    plugin a re-preparation, while the padding is masked out for free.

    Args:
        core: the ``openvino.Core`` to compile with.
        folder: IR folder holding ``openvino_model.xml/.bin``.
        devices: one xpuspec device name per stage (``["cpu"]``, ``["gpu.0", "gpu.1"]``).
        configs: OpenVINO compile properties, one dict per stage.
        split: layers per stage; default balanced by weight bytes (:func:`balanced_stages`).
        max_dead_slots: masked-out slots tolerated before compaction (0: copy-trim on every rollback).
            IRs without an ``attention_mask`` input always copy-trim.
        head_tokens: score only these token ids (:func:`.graph.keep_head_rows`; the others' logits are
            ``-inf``); ``None``: all. Not on the NPU, whose NPUW pipeline builds its own LM head.

    Raises:
        ModelSourceError: the IR is damaged, or cannot be split (names without layer numbers).
        ValueError: ``split`` does not match the stages and the model's layers.
    """

    def __init__(self, core: ov.Core, folder: Path, devices: Sequence[str], configs: Sequence[dict],
                 split: Optional[Sequence[int]] = None, max_dead_slots: int = MAX_DEAD_SLOTS,
                 head_tokens: Optional[Sequence[int]] = None):
        self.folder = Path(folder)
        self.device = ",".join(devices)
        self.configs = [dict(c) for c in configs]
        self.attention_backend = "SDPA"
        model = read_ir(core, self.folder)
        self.num_layers = num_layers(model)
        self.vocab_size = int(model.output("logits").partial_shape[-1].get_length())
        self.head_tokens = (None if head_tokens is None
                            else torch.as_tensor(keep_head_rows(model, head_tokens), dtype=torch.long))
        if devices[0].startswith("npu"):  # NPUW_LLM compiles static prompt and response windows
            self.max_prompt_len = int(self.configs[0]["NPUW_LLM_MAX_PROMPT_LEN"])
            self.max_length = self.max_prompt_len + int(self.configs[0]["NPUW_LLM_MIN_RESPONSE_LEN"])
        else:  # NPUW_LLM expects the exported inputs as they are
            keep_last_logits(model)
        counts = list(split) if split is not None else balanced_stages(model, len(devices))
        if len(counts) != len(devices):
            raise ValueError(f"split={list(counts)} gives {len(counts)} stages for {len(devices)} devices "
                             f"({self.device}); give one layer count per device.")
        parts = split_stages(model, counts) if len(counts) > 1 else [model]
        bounds = np.cumsum([0] + counts)
        self.stages = []
        for part, device, config, first, end in zip(parts, devices, self.configs, bounds[:-1], bounds[1:]):
            compiled = core.compile_model(part, device.upper(), config)
            held = constant_bytes(part) if len(parts) > 1 else (self.folder / MODEL_BIN).stat().st_size
            self.stages.append(Stage(device, (int(first), int(end)), held,
                                     compiled.create_infer_request(), {i.any_name for i in part.inputs},
                                     [str(d) for d in compiled.get_property("EXECUTION_DEVICES")]))
        self.weight_bytes = sum(s.weight_bytes for s in self.stages)
        self.max_dead_slots = max_dead_slots if "attention_mask" in self.stages[0].inputs else 0
        self._live = np.zeros(0, dtype=np.int64)  # one entry per slot of the state tensors: 1 live, 0 dead
        self._length = 0
        # the engine runs a whole model (NPUW has its own LLM pipeline) with every token scored
        whole = len(self.stages) == 1 and not devices[0].startswith("npu") and head_tokens is None
        self._genai = GenAIGreedy(self.folder, devices[0].upper(), self.configs[0]) if whole else None

    def native_greedy(self, prompt, max_new_tokens, min_new_tokens, eos, on_token):
        """openvino_genai's C++ loop on the same IR and device (see :mod:`.genai_engine`); ``None`` for
        a model split into stages, on the NPU, or with a cut head."""
        if self._genai is None:
            return None
        return self._genai.generate(prompt, max_new_tokens, min_new_tokens, eos, on_token)

    @property
    def length(self) -> int:
        return self._length

    @property
    def traits(self) -> RunnerTraits:
        """Pad verify passes only while padding is masked out for free (not when every rollback copies)."""
        return RunnerTraits(fixed_verify_width=self.max_dead_slots > 0)

    @property
    def dead_slots(self) -> int:
        """Masked-out slots now held in the KV cache."""
        return len(self._live) - self._length

    @property
    def device_map(self) -> List[dict]:
        return [{"stage": i, "device": s.device, "layers": list(s.layers), "weight_bytes": s.weight_bytes,
                 "execution_devices": s.execution_devices} for i, s in enumerate(self.stages)]

    def forward(self, tokens: Sequence[int], logits_to_keep: Optional[int] = None, exact: bool = True) -> torch.Tensor:
        n = len(tokens)
        self._live = np.concatenate([self._live, np.ones(n, dtype=np.int64)])
        feed = {"input_ids": np.asarray(tokens, dtype=np.int64).reshape(1, n),
                "attention_mask": self._live.reshape(1, -1),
                "position_ids": np.arange(self._length, self._length + n, dtype=np.int64).reshape(1, n),
                "beam_idx": np.zeros(1, dtype=np.int32),
                LOGITS_TO_KEEP: np.array([min(logits_to_keep or n, n)], dtype=np.int64)}
        hidden = None
        for stage in self.stages:
            inputs = {name: value for name, value in feed.items() if name in stage.inputs}
            if hidden is not None:
                inputs[HIDDEN_IN] = hidden
            stage.request.infer(inputs, share_inputs=True)
            hidden = stage.request.get_output_tensor(0)
        self._length += n
        return on_whole_vocabulary(torch.from_numpy(np.array(hidden.data[0], dtype=np.float32)), self.head_tokens,
                                   self.vocab_size)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"rollback({n}) with {self._length} tokens in the KV cache")
        if n == 0:
            return
        live_slots = np.flatnonzero(self._live)
        self._live[live_slots[self._length - n:]] = 0
        self._length -= n
        if self.dead_slots > self.max_dead_slots:
            self._compact()

    def _compact(self) -> None:
        """Copy the states of every stage without their dead slots."""
        keep = np.flatnonzero(self._live)
        contiguous = len(keep) == 0 or keep[-1] == len(keep) - 1
        for stage in self.stages:
            for state in stage.request.query_state():
                data = state.state.data
                kept = data[:, :, : len(keep), :] if contiguous else np.take(data, keep, axis=SEQ_AXIS)
                state.state = ov.Tensor(np.ascontiguousarray(kept))
        self._live = np.ones(len(keep), dtype=np.int64)

    def reset(self) -> None:
        for stage in self.stages:
            stage.request.reset_state()
        self._live = np.zeros(0, dtype=np.int64)
        self._length = 0
