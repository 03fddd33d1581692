"""Runners that compute by rule, for tests of the loop's and the drafters' mechanics."""

from typing import List, Optional, Sequence

import torch

from xpuspec.runner import Runner, RunnerTraits


class Successor(Runner):
    """The next token is the last + 1 (mod ``vocab``); counts its passes and notes torch's thread count in each."""

    device, weight_bytes, num_layers = "cpu", 0, 1

    def __init__(self, vocab: int = 8, traits: RunnerTraits = RunnerTraits(), slow_pass: Optional[int] = None):
        self.vocab_size, self.traits = vocab, traits
        self.held: List[int] = []
        self.passes, self.widths, self.threads = 0, [], set()

    @property
    def length(self) -> int:
        return len(self.held)

    def forward(self, tokens: Sequence[int], logits_to_keep=None, exact=True) -> torch.Tensor:
        self.threads.add(torch.get_num_threads())
        self.passes += 1
        self.widths.append(len(tokens))
        self.held += list(tokens)
        rows = torch.tensor(list(tokens)[-(logits_to_keep or len(tokens)):])
        return torch.nn.functional.one_hot((rows + 1) % self.vocab_size, self.vocab_size).float() * 50

    def rollback(self, n: int) -> None:
        assert 0 <= n <= len(self.held)
        del self.held[len(self.held) - n:]

    def reset(self) -> None:
        self.held = []


class Masked(Successor):
    """Every logit is -inf (a cut head whose tokens are all masked)."""

    def forward(self, tokens, logits_to_keep=None, exact=True):
        super().forward(tokens, logits_to_keep, exact)
        return torch.full((logits_to_keep or len(tokens), self.vocab_size), float("-inf"))
