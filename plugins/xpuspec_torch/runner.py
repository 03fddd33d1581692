"""Runner over a transformers model with a ``DynamicCache`` (rollback by ``crop``).

The cache keeps every layer's keys and values whole, sliding-window layers too (Gemma-2/3, Mistral): a sliding
layer's cache cannot be cropped once it has passed its window, and speculative decoding rolls back. The model's
own masks still apply the window, so the logits are those of the model (checked against a cache-less forward
in ``tests/test_architectures.py``).
"""

from typing import Optional, Sequence

import torch
from transformers import DynamicCache

from xpuspec.runner import Runner, RunnerTraits


def parameter_bytes(module) -> int:
    """Bytes of a module's parameters (0 for ``None``)."""
    return sum(p.numel() * p.element_size() for p in module.parameters()) if module is not None else 0


class TorchRunner(Runner):
    """A transformers causal LM on ``cpu`` or ``xpu:N`` (batch size 1)."""

    traits = RunnerTraits(uses_torch_threads=True)

    def __init__(self, model, device: str):
        self.model = model
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.weight_bytes = parameter_bytes(model)
        self.num_layers = model.config.num_hidden_layers
        self.cache = DynamicCache()  # whole layers: see the module docstring
        self.tap_ids = ()

    def set_taps(self, layer_ids: Sequence[int]) -> None:
        self.tap_ids = tuple(int(i) for i in layer_ids)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], logits_to_keep: Optional[int] = None, exact: bool = True) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.model.device)
        start = self.length
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=logits_to_keep or 0,
                         output_hidden_states=bool(self.tap_ids))
        if self.tap_ids:  # hidden_states[i]: the input of layer i (transformers' layout)
            self.last_taps = (start, torch.cat([out.hidden_states[i][0] for i in self.tap_ids], dim=-1).float().cpu())
        return out.logits[0].float().cpu()

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"rollback({n}) with {self.length} tokens in the KV cache")
        if n:
            self.cache.crop(self.length - n)

    def reset(self) -> None:
        self.cache = DynamicCache()
