"""Perplexity of a model on real text: Hugging Face's sliding-window method for fixed-length models, over the
evaluation corpus (:mod:`xpuspec.corpus`: HumanEval code and Python documentation prose) or a file of your own.

Used by ``xpuspec eval`` (:mod:`xpuspec.evaluation`) and by the ``auto`` format's choice (:mod:`xpuspec.formats`).
"""

import math
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch


def sliding_windows(n: int, context: int, stride: int) -> List[Tuple[int, int, int]]:
    """The windows of HF's sliding-window perplexity over ``n`` tokens.

    Returns:
        ``(begin, end, first)`` per window: the model sees tokens ``[begin, end)`` and scores the
        tokens at positions ``[begin + first, end)``. With ``stride < context`` every position
        1..n-1 is scored exactly once; with ``stride == context`` the windows do not overlap and
        the first token of each window, having no context, is not scored (as in HF's recipe).

    Raises:
        ValueError: ``n < 2``, ``context < 2`` or ``stride`` outside ``[1, context]``.
    """
    if n < 2:
        raise ValueError(f"Need at least 2 tokens of text to score, got {n}.")
    if context < 2 or not 1 <= stride <= context:
        raise ValueError(f"Need context >= 2 and 1 <= stride <= context; got context={context}, stride={stride}.")
    windows, scored_to = [], 1
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        windows.append((begin, end, max(scored_to - begin, 1)))
        scored_to = end
        if end == n:
            break
    return windows


def window_logprobs(model, ids: torch.Tensor, context: int, stride: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probabilities of the scored positions, window by window.

    Args:
        model: anything with ``model(input_ids).logits`` float ``[1, seq, vocab]``.
        ids: LongTensor ``[n]``, the tokenised text.

    Yields:
        ``(logp, targets)``: float32 ``[m, vocab]`` log-softmax predicting the scored tokens, and
        LongTensor ``[m]`` those tokens (:func:`sliding_windows` says which).
    """
    for begin, end, first in sliding_windows(len(ids), context, stride):
        with torch.no_grad():
            logits = model(ids[begin:end][None]).logits[0]
        yield torch.log_softmax(logits[first - 1:-1].float(), dim=-1), ids[begin + first:end]


def perplexity(model, ids: torch.Tensor, context: int = 512, stride: int = 256) -> float:
    """Sliding-window perplexity of ``model`` on ``ids`` (LongTensor ``[n]``): exp of the mean
    next-token negative log-likelihood in nats over tokens 1..n-1."""
    nll, count = 0.0, 0
    for logp, targets in window_logprobs(model, ids, context, stride):
        nll -= logp.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count)


def eval_texts(tokenizer, text: Optional[Union[str, Path]], tokens: int) -> Dict[str, torch.Tensor]:
    """Tokenised evaluation texts, within a budget of ``tokens`` in all.

    Without ``text``: ``"code"`` (the HumanEval programs, half the budget) and ``"prose"`` (the
    Python documentation, the other half). With ``text`` (a file path): that file's text, named
    by its stem.

    Returns:
        name -> LongTensor ``[n]`` (n at most the budget; less if the text is shorter).

    Raises:
        ValueError: ``tokens < 4``, or the text is shorter than 2 tokens.
        FileNotFoundError: ``text`` does not exist.
        CorpusError: the HumanEval download failed.
    """
    from . import corpus

    if tokens < 4:
        raise ValueError(f"--tokens must be at least 4, got {tokens}.")
    if text is not None:
        path = Path(text)
        sources = {path.stem or "text": (path.read_text(encoding="utf-8"), tokens)}
    else:
        sources = {"code": ("\n\n".join(corpus.code_texts()), tokens // 2),
                   "prose": ("\n\n".join(corpus.prose_texts()), tokens - tokens // 2)}
    out = {}
    for name, (body, budget) in sources.items():
        ids = tokenizer(body, return_tensors="pt").input_ids[0][:budget]
        if len(ids) < 2:
            raise ValueError(f"The text {name!r} has {len(ids)} token(s); perplexity needs at least 2.")
        out[name] = ids
    return out
