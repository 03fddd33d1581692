"""The Runner interface: what a backend gives for one model (or one pipeline stage).

The decode loop talks only to this interface; it knows nothing of OpenVINO or torch.
"""

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Tuple, Callable, List, Optional, Sequence

import torch


@dataclass(frozen=True)
class RunnerTraits:
    """How a backend's passes behave, for the decode loop to plan around. The backend fills them; the core reads them.

    Attributes:
        single_step_width: the width a 1-token pass runs at (padded, the padding rolled back): 2 where the backend
            computes a 1-token pass differently from wider ones, so that plain steps and verify passes compute alike
            and speculative output equals plain output (``forward(..., exact=False)`` skips the padding).
        fixed_verify_width: pad rounds with drafts to the widest width so far in a request: changing the input
            width costs this backend a re-preparation, and rolling back the padding is free.
        lockstep: one stage of a multi-process pipeline: every rank runs the same loop and must take the same
            decisions, so none may depend on timing (the cost model is off).
        uses_torch_threads: the passes compute with torch's intra-op threads (the torch backends).
        batches: the runner verifies several sequences in one pass (``open_sequence`` and ``forward_batch``, the
            batched engine's contract: :mod:`xpuspec.engine`).
        split_steps: :meth:`Runner.forward_steps` and ``forward_batch`` compute each token as a 1-token step would,
            whatever the pass's width, where a 1-token pass computes otherwise than wider ones (the OpenVINO paged
            runner feeds each token as a subsequence of its own): plain steps need no padding
            (``single_step_width`` is 1), and a free guess beside a plain step costs what one more token costs.
        split_width: with :attr:`split_steps`, the fewest tokens a split pass feeds (a shorter one is padded to it,
            so tokens up to it cost nothing more); 1 otherwise.
    """

    single_step_width: int = 1
    fixed_verify_width: bool = False
    lockstep: bool = False
    uses_torch_threads: bool = False
    batches: bool = False
    split_steps: bool = False
    split_width: int = 1

    @property
    def guess_width(self) -> int:
        """The width of a plain step that carries a guess: the padded width where 1-token passes are padded, else 2
        where :attr:`split_steps` makes the second token cost only itself; 1: no guess."""
        return 2 if self.split_steps else self.single_step_width


class Runner(ABC):
    """One loaded causal LM with its own KV cache, for batch size 1.

    Attributes:
        device: the device the model runs on, in xpuspec's spelling (``"cpu"``, ``"gpu.1"``, ``"xpu:0"``).
        vocab_size: rows of the logits (may exceed the tokenizer's vocabulary when padded).
        weight_bytes: bytes of weights held by this runner (all its stages together).
        num_layers: decoder layers of the model.
        length: tokens currently in the KV cache.
        max_length: tokens the KV cache can hold, when the backend fixes it (NPU); else ``None``.
        max_prompt_len: longest prompt one prefill takes, when the backend fixes it (NPU); else ``None``.
        traits: :class:`RunnerTraits`.
        head_tokens: the token ids a draft's cut LM head scores (int64 ``[n]``; every other logit is ``-inf``,
            :mod:`xpuspec.speculative.vocab`), or ``None`` where the head scores the whole vocabulary.
    """

    device: str
    vocab_size: int
    weight_bytes: int
    num_layers: int
    max_length: Optional[int] = None
    max_prompt_len: Optional[int] = None
    traits: RunnerTraits = RunnerTraits()
    head_tokens: Optional[torch.Tensor] = None

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens currently held in the KV cache."""

    @property
    def device_map(self) -> List[dict]:
        """Where the model's parts live, one dict per pipeline stage: ``stage`` (index), ``device``,
        ``layers`` (``[first, end)``) and ``weight_bytes`` (int). A runner on one device has one stage."""
        return [{"stage": 0, "device": self.device, "layers": [0, self.num_layers], "weight_bytes": self.weight_bytes}]

    @abstractmethod
    def forward(self, tokens: Sequence[int], logits_to_keep: Optional[int] = None, exact: bool = True) -> torch.Tensor:
        """Append ``tokens`` to the KV cache and return their logits.

        Args:
            tokens: k >= 1 token ids (ints), positions ``length .. length+k-1``.
            logits_to_keep: return the logits of this many last positions only (transformers'
                name; a prefill needs one row); ``None`` returns all k.
            exact: compute a 1-token pass as wider passes compute (:attr:`RunnerTraits.single_step_width`); a draft
                model, whose numerics need not match anything, passes ``False``.

        Returns:
            float32 tensor ``[k, vocab_size]`` (``[logits_to_keep, vocab_size]``) on the CPU: row i
            scores the token after ``tokens[i]``.
        """

    def forward_steps(self, tokens: Sequence[int]) -> torch.Tensor:
        """:meth:`forward` for a plain step or a verify pass (all logits kept): where the runner's
        :attr:`RunnerTraits.split_steps`, each token computes as a 1-token step would. Default: :meth:`forward`."""
        return self.forward(tokens)

    def native_greedy(self, prompt: List[int], max_new_tokens: int, min_new_tokens: int, eos: Sequence[int],
                      on_token: Callable[[int], None]) -> Optional[List[int]]:
        """Plain greedy decoding in the backend's own engine, where it has one that gives the same
        tokens faster than xpuspec's loop; ``None`` means it has none (xpuspec's loop decodes).

        Args:
            prompt: prompt token ids.
            max_new_tokens, min_new_tokens: length limits (EOS is ignored before ``min_new_tokens``).
            eos: token ids that end generation.
            on_token: called with each new token id as it is generated.

        Returns:
            the new token ids, or ``None``. The runner's own KV cache is left as it was.
        """
        return None

    def expect_mixed_widths(self) -> float:
        """A hint that this runner's passes will alternate between 1-token steps and wider passes (a draft
        model drafting and catching up, a target whose prompt lookup finds no match in some rounds). A backend
        for which each change of input width costs a re-preparation may prepare for both here, once (OpenVINO
        paged runner: a second compiled copy for the steps, which holds a second copy of the weights). It does
        not change any output. Returns the seconds it spent (0 when prepared already). Default: nothing."""
        return 0.0

    #: After each :meth:`forward` once :meth:`set_taps` named layers: ``(start, taps)``, the position of the pass's
    #: first token and float32 ``[k, len(layers) * hidden]``, the residual stream entering each named layer (id ``L``:
    #: the last layer's output before the final norm) at each of its ``k`` tokens, concatenated in the order named.
    last_taps: Optional[Tuple[int, torch.Tensor]] = None

    def set_taps(self, layer_ids: Sequence[int]) -> None:
        """Make every later :meth:`forward` also keep the hidden states of ``layer_ids`` in :attr:`last_taps`, for
        a draft head fed by the target's verify pass (EAGLE-3).

        Raises:
            SpeculativeConfigError: a backend that cannot return hidden states.
        """
        from .errors import SpeculativeConfigError

        raise SpeculativeConfigError(f"{type(self).__name__} cannot return the hidden states an EAGLE-3 head drafts "
                                     "from: load the target with backend='torch' or 'openvino'.")

    def reuse_prefix(self, prompt: Sequence[int]) -> int:
        """Start this empty sequence on the KV blocks its runner's prefix cache holds for the start of ``prompt``
        (:mod:`xpuspec.kv_blocks`); returns the tokens it now holds (less than ``len(prompt)``), which the next
        pass must not feed again. Default: 0, a runner without a prefix cache."""
        return 0

    def share(self, accepted: Sequence[int]) -> None:
        """Offer the full KV blocks of this sequence whose tokens begin ``accepted`` (a request's prompt and
        accepted output) to later sequences' :meth:`reuse_prefix`. Default: nothing."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Drop the last ``n`` tokens from the KV cache (0 <= n <= length)."""

    @abstractmethod
    def reset(self) -> None:
        """Empty the KV cache."""


def on_whole_vocabulary(rows: torch.Tensor, token_ids: Optional[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """Logits of an LM head cut to ``token_ids`` (``[k, len(token_ids)]`` float32), laid out on the whole
    vocabulary: ``[k, vocab_size]``, ``-inf`` for every token the head does not score (so their softmax
    probability is 0). ``token_ids=None``: ``rows`` already cover the vocabulary and come back as they are."""
    if token_ids is None:
        return rows
    full = torch.full((rows.shape[0], vocab_size), float("-inf"), dtype=rows.dtype)
    full[:, token_ids] = rows
    return full


@contextmanager
def torch_on_one_thread(runners: Sequence[Runner]):
    """Run torch on one intra-op thread inside the block, unless one of ``runners`` computes with torch's threads
    (:attr:`xpuspec.runner.RunnerTraits.uses_torch_threads`); the setting before is restored afterwards.

    The loop's own tensor work is small (a few rows of logits), and torch's OpenMP threads would otherwise compete
    with the backend's for the cores. Not thread-safe against other threads changing torch's thread count."""
    before = torch.get_num_threads()
    if before == 1 or any(r.traits.uses_torch_threads for r in runners):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
