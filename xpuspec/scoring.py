"""Processed scores: the logits a request decides by, after transformers' logits processors.

A :class:`Scorer` turns raw logits into processed scores at a prefix, for a draft token (``scorer(prefix, logits)``)
and for the rows of a verify pass (:meth:`Scorer.rows`), so that draft and target distributions are built alike.
"""

from typing import List, Sequence

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList

from .generation import eos_ids, logits_processor, min_new_tokens

#: Dtypes whose rows numpy can view without a copy (numpy's argmax is many times cheaper than torch's on one thread).
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def argmax_rows(scores: torch.Tensor) -> List[int]:
    """The index of each row's largest value, the first of equal ones (``torch.argmax`` over the last dim, NaN
    counting as the largest, as there), for ``scores`` ``[..., vocab]``; a flat list of one int per row."""
    if scores.device.type == "cpu" and scores.dtype in _NUMPY_DTYPES:
        return np.asarray(scores.detach().numpy()).reshape(-1, scores.shape[-1]).argmax(axis=-1).tolist()
    return scores.argmax(dim=-1).reshape(-1).tolist()


#: Logits processors whose only effect a greedy request can apply without their tensor work (the length rules).
LENGTH_RULES = ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor")


class Scorer:
    """transformers' ``processors`` (a ``LogitsProcessorList``, as :func:`xpuspec.generation.logits_processor` builds
    for a request) applied to raw logits."""

    def __init__(self, processors: LogitsProcessorList):
        self.processors = processors

    @property
    def only_length_rules(self) -> bool:
        return all(type(p).__name__ in LENGTH_RULES for p in self.processors)

    def __call__(self, prefix: List[int], logits: torch.Tensor) -> torch.Tensor:
        """Scores ``[1, vocab]`` of the token after ``prefix`` (ids), from raw ``logits`` ``[1, vocab]``."""
        return self.processors(torch.tensor([prefix]), logits)

    def rows(self, context: List[int], drafts: Sequence[int], rows: torch.Tensor) -> torch.Tensor:
        """Scores ``[len(drafts) + 1, vocab]`` of a verify pass: row i scores the token after
        ``context + drafts[:i]``."""
        ids = torch.tensor([list(context) + list(drafts)])
        end = len(context)
        return torch.cat([self.processors(ids[:, :end + i], rows[i:i + 1]) for i in range(len(drafts) + 1)])

    def best(self, context: List[int], drafts: Sequence[int], rows: torch.Tensor) -> List[int]:
        """The greedy token of each row of a verify pass (``len(drafts) + 1`` ints): the argmax of
        :meth:`rows`."""
        return argmax_rows(self.rows(context, drafts, rows))


class LengthRuleScorer(Scorer):
    """Greedy scores whose only processors are the length rules: EOS at -inf below the minimum length, as
    transformers' ``MinLengthLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor`` do, without their
    per-step tensor work."""

    def __init__(self, processors: LogitsProcessorList, minimum: int, eos: Sequence[int]):
        """``minimum``: the sequence length (prompt included) below which EOS is forbidden; ``eos``: the EOS ids."""
        super().__init__(processors)
        self.minimum = minimum
        self.eos = list(eos)
        self._eos_set = frozenset(self.eos)

    def _masked(self, length: int, logits: torch.Tensor) -> torch.Tensor:
        if length >= self.minimum:
            return logits
        eos = [e for e in self.eos if 0 <= e < logits.shape[-1]]  # as isin: ids off the vocabulary mask nothing
        if not eos:
            return logits
        masked = logits.clone()
        masked[:, eos] = float("-inf")
        return masked

    def __call__(self, prefix, logits):
        return self._masked(len(prefix), logits)

    def rows(self, context, drafts, rows):
        if len(context) >= self.minimum:
            return rows
        return torch.cat([self._masked(len(context) + i, rows[i:i + 1]) for i in range(len(drafts) + 1)])

    def best(self, context, drafts, rows):
        """The argmax of the raw rows, masked only where it is an EOS the minimum length forbids: masking sets
        EOS to -inf and leaves every other value, so it can change a row's argmax only where that is an EOS id
        (a non-EOS first maximum stays the first maximum)."""
        best = argmax_rows(rows)
        start = len(context)
        for i, token in enumerate(best):
            if start + i < self.minimum and token in self._eos_set:
                best[i] = argmax_rows(self._masked(start + i, rows[i:i + 1]))[0]
        return best


def scorer_for(config: GenerationConfig, prompt_len: int) -> Scorer:
    """The cheapest :class:`Scorer` that computes what transformers' processors would for ``config``."""
    minimum = prompt_len + min_new_tokens(config, prompt_len)
    scorer = Scorer(logits_processor(config, prompt_len))
    if not config.do_sample and scorer.only_length_rules:
        return LengthRuleScorer(scorer.processors, minimum, eos_ids(config))
    return scorer
