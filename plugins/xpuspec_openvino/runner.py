"""Runner over a stateful OpenVINO IR (as exported by optimum-intel).

The IR keeps its KV cache in variable states shaped ``[batch, kv_heads, seq, head_dim]``
(sequence on axis 2). Inputs: ``input_ids [1,n] i64``, ``attention_mask [1,past+n] i64``,
``position_ids [1,n] i64``, ``beam_idx [1] i32``; output ``logits [1,n,vocab]``.

Rollback masks rather than copies: rejected tokens stay in the state tensors as *slots* whose
``attention_mask`` entry is 0, while ``position_ids`` count only live tokens, so the next
tokens see exactly the accepted prefix at the right positions. A copy of the states without
the dead slots (compaction) happens only once more than ``max_dead_slots`` pile up. A copy-trim
costs 8-40 ms against a ~20 ms decode step on a 2-core CPU (../shared/OPENVINO-NOTES.md);
masking costs nothing per step. This needs an exact KV cache: never combine it with a u8 KV
cache that changes with the sequence (see ``compile_config``).
"""

from pathlib import Path
from typing import Sequence

import numpy as np
import openvino as ov
import torch

from xpuspec.runner import Runner

from .ir import MODEL_BIN, read_ir

SEQ_AXIS = 2
#: Dead (masked-out) slots allowed in the KV cache before it is compacted.
MAX_DEAD_SLOTS = 64


class OpenVINORunner(Runner):
    """One compiled stateful IR and its infer request (batch size 1).

    Padded verify passes (``fixed_verify_width``) pay off here because a new input length costs
    the CPU plugin a re-preparation (measured 8-14 ms, ../shared/OPENVINO-NOTES.md) while the
    padding is masked out for free.

    Args:
        core: the ``openvino.Core`` to compile with.
        folder: IR folder holding ``openvino_model.xml/.bin``.
        device: xpuspec spelling (``"cpu"``, ``"gpu.1"``, ``"npu"``).
        config: OpenVINO compile properties.
        max_dead_slots: masked-out slots tolerated before compaction (0: copy-trim on every rollback).
            IRs without an ``attention_mask`` input always copy-trim.
    """

    def __init__(self, core: ov.Core, folder: Path, device: str, config: dict, max_dead_slots: int = MAX_DEAD_SLOTS):
        self.folder = Path(folder)
        self.device = device
        self.config = dict(config)
        model = read_ir(core, self.folder)
        self._inputs = {i.any_name for i in model.inputs}
        self.vocab_size = int(model.output("logits").partial_shape[-1].get_length())
        self.weight_bytes = (self.folder / MODEL_BIN).stat().st_size
        if device.startswith("npu"):  # NPUW_LLM compiles static prompt and response windows
            self.max_prompt_len = int(self.config["NPUW_LLM_MAX_PROMPT_LEN"])
            self.max_length = self.max_prompt_len + int(self.config["NPUW_LLM_MIN_RESPONSE_LEN"])
        self.compiled = core.compile_model(model, device.upper(), self.config)
        self.request = self.compiled.create_infer_request()
        self.max_dead_slots = max_dead_slots if "attention_mask" in self._inputs else 0
        self._live = np.zeros(0, dtype=np.int64)  # one entry per slot of the state tensors: 1 live, 0 dead
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def fixed_verify_width(self) -> bool:
        """Pad verify passes only while padding is masked out for free (not when every rollback copies)."""
        return self.max_dead_slots > 0

    @property
    def dead_slots(self) -> int:
        """Masked-out slots now held in the KV cache."""
        return len(self._live) - self._length

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        n = len(tokens)
        self._live = np.concatenate([self._live, np.ones(n, dtype=np.int64)])
        inputs = {"input_ids": np.asarray(tokens, dtype=np.int64).reshape(1, n)}
        if "attention_mask" in self._inputs:
            inputs["attention_mask"] = self._live.reshape(1, -1)
        if "position_ids" in self._inputs:
            inputs["position_ids"] = np.arange(self._length, self._length + n, dtype=np.int64).reshape(1, n)
        if "beam_idx" in self._inputs:
            inputs["beam_idx"] = np.zeros(1, dtype=np.int32)
        self.request.infer(inputs, share_inputs=True)
        self._length += n
        logits = self.request.get_tensor("logits").data
        return torch.from_numpy(np.array(logits[0], dtype=np.float32))

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
        """Copy the states without their dead slots."""
        keep = np.flatnonzero(self._live)
        contiguous = len(keep) == 0 or keep[-1] == len(keep) - 1
        for state in self.request.query_state():
            data = state.state.data
            kept = data[:, :, : len(keep), :] if contiguous else np.take(data, keep, axis=SEQ_AXIS)
            state.state = ov.Tensor(np.ascontiguousarray(kept))
        self._live = np.ones(len(keep), dtype=np.int64)

    def reset(self) -> None:
        self.request.reset_state()
        self._live = np.zeros(0, dtype=np.int64)
        self._length = 0
