"""Runner over a stateful OpenVINO IR (as exported by optimum-intel).

The IR keeps its KV cache in variable states shaped ``[batch, kv_heads, seq, head_dim]``
(sequence on axis 2). Inputs: ``input_ids [1,n] i64``, ``attention_mask [1,past+n] i64``,
``position_ids [1,n] i64``, ``beam_idx [1] i32``; output ``logits [1,n,vocab]``.
"""

from pathlib import Path
from typing import Sequence

import numpy as np
import openvino as ov
import torch

from xpuspec.runner import Runner

from .ir import MODEL_BIN, read_ir

SEQ_AXIS = 2


class OpenVINORunner(Runner):
    """One compiled stateful IR and its infer request (batch size 1).

    Args:
        core: the ``openvino.Core`` to compile with.
        folder: IR folder holding ``openvino_model.xml/.bin``.
        device: xpuspec spelling (``"cpu"``, ``"gpu.1"``, ``"npu"``).
        config: OpenVINO compile properties.
    """

    def __init__(self, core: ov.Core, folder: Path, device: str, config: dict):
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
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        n = len(tokens)
        inputs = {"input_ids": np.asarray(tokens, dtype=np.int64).reshape(1, n)}
        if "attention_mask" in self._inputs:
            inputs["attention_mask"] = np.ones((1, self._length + n), dtype=np.int64)
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
        keep = self._length - n
        for state in self.request.query_state():
            data = state.state.data
            state.state = ov.Tensor(np.ascontiguousarray(data[:, :, :keep, :]))
        self._length = keep

    def reset(self) -> None:
        self.request.reset_state()
        self._length = 0
