"""Runners that compute by rule, for tests of the loop's and the drafters' mechanics, and the distance a
sampling test measures."""

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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


def total_variation(counts: Dict[Tuple[int, ...], int], trials: int, target: Callable, prompt: Sequence[int],
                    vocab: int, length: int = 3) -> float:
    """Total-variation distance between sampled ``length``-token continuations (``counts`` of ``trials``) and the
    exact distribution of ``target`` (``target(prefix)`` gives next-token probabilities) after ``prompt``."""
    distance = 0.0
    for seq in itertools.product(range(vocab), repeat=length):
        exact, prefix = 1.0, list(prompt)
        for t in seq:
            exact *= float(target(prefix)[t])
            prefix.append(t)
        distance += 0.5 * abs(counts.get(seq, 0) / trials - exact)
    return distance
