"""The EAGLE-3 drafter: a chain of tokens from a draft head fed by the target's own hidden states.

The target's passes keep the residual stream of the head's tapped layers (:meth:`xpuspec.runner.Runner.set_taps`);
each pass's taps reach the drafter through :meth:`Eagle3Drafter.observe` (the one call a drafter that declares
``needs = {"hidden_states"}`` gets), keyed by position: a later pass over a position (the accepted
token after a rejected draft) overwrites what an earlier pass left there, so the taps of every position before the
context's last token are those of the accepted tokens. No second pass of the target.

Each :meth:`Eagle3Drafter.propose` rolls the head's cache back to the entries made from accepted tokens, adds the
entries of the tokens accepted since (token ``p`` with the taps of position ``p - 1``), and drafts a chain: each
drafted token is fed back with the head's own output (:mod:`xpuspec.speculative.eagle3`; vLLM's and llama.cpp's
chain drafting). The target verifies every draft, so greedy output is the target's own.
"""

import torch

from .drafters import NO_DRAFT, Draft, Drafter, DraftRequest, choose_token
from .eagle3 import Eagle3Head
from .policy import Widths


class Eagle3Drafter(Drafter):
    """Drafts with an :class:`~xpuspec.speculative.eagle3.Eagle3Head` (see the module docstring).

    Args:
        head: the loaded head (its cache is this drafter's while a request runs).
        vocab_size: the target's logit rows, which draft distributions are laid out on.
    """

    uses_model = True
    #: The target outputs besides logits this drafter is handed after each target pass.
    needs = frozenset({"hidden_states"})

    def __init__(self, head: Eagle3Head, vocab_size: int):
        self.head, self.vocab_size = head, vocab_size
        self.cache = None
        self.taps = torch.empty(0)
        self.filled = 0  # positions 0..filled-1 have taps
        self.valid = 0  # head entries 1..valid were made from accepted tokens and the target's taps

    def begin(self, request: DraftRequest) -> None:
        super().begin(request)
        self.cache = self.head.new_draft_cache()
        self.taps, self.filled, self.valid = torch.empty(0, self.head.fc.in_features), 0, 0

    def observe(self, outputs: dict) -> None:
        self.take_hidden(*outputs["hidden_states"])

    def take_hidden(self, start: int, taps: torch.Tensor) -> None:
        """The taps of a target pass over positions ``start .. start + len(taps) - 1`` (``[n, taps * hidden]``)."""
        end = start + taps.shape[0]
        if end > self.taps.shape[0]:
            grown = torch.empty(max(end, 2 * self.taps.shape[0]), self.taps.shape[1])
            grown[:self.taps.shape[0]] = self.taps
            self.taps = grown
        self.taps[start:end] = taps
        self.filled = end  # a pass past a rollback: what lies beyond it is stale
        if self.valid > start:  # entries made from positions this pass recomputed (a new request, a restart)
            self.valid = start

    @torch.inference_mode()
    def propose(self, widths: Widths) -> Draft:
        k, request = widths.model, self.request
        context = request.context
        last = len(context) - 1  # entries 1..last can be made: token p beside the taps of p - 1
        if k <= 0 or self.filled < last or last < 1:
            return NO_DRAFT
        head, cache = self.head, self.cache
        cache.rollback(cache.length - self.valid)
        logits, out = head.draft(context[self.valid + 1:last + 1], head.project(self.taps[self.valid:last]), cache)
        self.valid = last
        prefix = list(context)
        tokens, probs = [], []
        for i in range(k):
            picked = choose_token(request, request.score(prefix, head.to_target(logits[-1:], self.vocab_size)),
                                  len(tokens))
            if picked is None:
                break
            token, p = picked
            if p is not None:
                probs.append(p)
            tokens.append(token)
            prefix.append(token)
            if i + 1 < k:
                logits, out = head.draft([token], out, cache)
        return Draft(tokens, torch.stack(probs) if request.sample and probs else None)

    def end(self) -> None:
        self.cache, self.taps = None, torch.empty(0)

