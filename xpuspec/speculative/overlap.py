"""Overlapped speculation: the draft model drafts the next block while the target verifies this one.

After PEARL (Liu et al., "PEARL: Parallel Speculative Decoding with Adaptive Draft Length",
ICLR 2025). A worker thread owns the draft model and keeps drafting ahead of the confirmed
context, assuming that everything it drafted so far will be accepted (post-verify). Each round
the decode loop takes the tokens drafted so far (at least one: while the target verifies that
first token the draft goes on drafting, which is PEARL's pre-verify) and the target verifies
them in one pass while the worker keeps drafting. When the target accepts the whole block and
its own next token equals the draft's next token, the draft is still on the right path and its
work continues; otherwise the drafted-ahead tokens are discarded and the draft rolls back to the
confirmed context. The draft length therefore follows the measured draft-to-target cost ratio by
itself: a block holds what the draft managed while the target verified the previous one (capped
at the round's k and at ``max_ahead``).

Overlap pays only when the draft and the target really run at the same time: on two devices, or
on one CPU with each model's OpenVINO threads limited (``INFERENCE_NUM_THREADS``) so that both fit.
Greedy output is token-identical to the target's plain greedy output: the target verifies every
token exactly as in sequential speculation, only the draft's timing changes. Sampling is exact too
(each draft token is drawn from the draft distribution given its prefix), but since two threads
draw from the global torch generator, a seed no longer fixes the output.
"""

import threading
import time
from typing import List, Optional

import torch

from .drafters import NO_DRAFT, Draft, Drafter, DraftRequest, ModelDrafter
from .policy import Widths

#: Tokens the worker drafts beyond the confirmed context before it waits for the target.
MAX_AHEAD = 8


class OverlappedDrafter(Drafter):
    """Runs a :class:`ModelDrafter` in a worker thread that drafts ahead while the target verifies.

    Args:
        model: the draft model's drafter; only the worker thread touches its runner.
        max_ahead: the most tokens drafted beyond the confirmed context.

    Raises (from :meth:`propose`):
        RuntimeError: the worker thread failed (its exception is chained).
    """

    uses_model = True

    def __init__(self, model: ModelDrafter, max_ahead: int = MAX_AHEAD):
        if max_ahead < 1:
            raise ValueError(f"max_ahead must be >= 1, got {max_ahead}.")
        self.model = model
        self.max_ahead = max_ahead
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._init_state([])

    def _init_state(self, base: List[int]) -> None:
        self._base = list(base)          # the confirmed context the worker drafts after
        self._ahead: List[int] = []      # drafted tokens after _base
        self._probs: List[torch.Tensor] = []
        self._epoch = 0                  # bumped on every restart; stale worker results are dropped
        self._stopping = False
        self._error: Optional[BaseException] = None
        self._busy_s = 0.0

    @property
    def busy_s(self) -> float:
        return self._busy_s

    def begin(self, request: DraftRequest) -> None:
        """Start drafting after the prompt at once, overlapping the target's prefill."""
        self.end()
        super().begin(request)
        self.model.begin(request)
        self._init_state(request.context)
        self._thread = threading.Thread(target=self._work, args=(request.score, request.sample), name="xpuspec-draft",
                                        daemon=True)
        self._thread.start()

    def end(self) -> None:
        """Stop the worker thread and wait for it; then the draft model's drafter ends its request."""
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        self._thread = None
        self.model.end()

    def runners(self):
        return self.model.runners()

    def on_rows(self, open_sequence) -> Drafter:
        """This drafter for one row: its worker drafts on a sequence of its own on the draft model (whose runner
        serializes the passes of several rows' workers and the engine's thread on its compiled model)."""
        return OverlappedDrafter(self.model.on_rows(open_sequence), self.max_ahead)

    def propose(self, widths: Widths) -> Draft:
        """Up to ``widths.model`` tokens the worker drafted after the context; waits for the first one."""
        if widths.model <= 0:
            return NO_DRAFT
        with self._cond:
            self._follow(self.request.context)
            self._cond.notify_all()
            while not self._ahead and self._error is None and not self._stopping:
                self._cond.wait()
            if self._error is not None:
                raise RuntimeError("The overlapped draft worker failed; see the chained exception.") from self._error
            tokens = self._ahead[:widths.model]
            probs = torch.stack(self._probs[:len(tokens)]) if self.request.sample else None
        return Draft(tokens, probs)

    def _follow(self, context: List[int]) -> None:
        """Keep the drafted-ahead tokens that ``context`` confirmed; restart after a mismatch."""
        new = context[len(self._base):]
        kept = 0
        while kept < len(new) and kept < len(self._ahead) and self._ahead[kept] == new[kept]:
            kept += 1
        if kept == len(new):
            self._ahead, self._probs = self._ahead[kept:], self._probs[kept:]
        else:
            self._ahead, self._probs = [], []
            self._epoch += 1
        self._base = list(context)

    def _work(self, score, sample) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and len(self._ahead) >= self.max_ahead:
                        self._cond.wait()
                    if self._stopping:
                        return
                    epoch, prefix = self._epoch, self._base + self._ahead
                t0 = time.perf_counter()
                scored = score(prefix, self.model.next_logits(prefix))
                p = torch.softmax(scored, dim=-1)[0] if sample else None
                token = int(torch.multinomial(p, 1)) if sample else int(scored.argmax())
                self._busy_s += time.perf_counter() - t0
                with self._cond:
                    if epoch == self._epoch:
                        self._ahead.append(token)
                        if sample:
                            self._probs.append(p)
                        self._cond.notify_all()
        except BaseException as exc:  # handed to the decode loop by propose
            with self._cond:
                self._error = exc
                self._cond.notify_all()
