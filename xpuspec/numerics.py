"""Logits that fail loudly: NaN or infinite logits are an error naming the format, never a silent ``nan``.

A format whose activations overflow (fp16 on some architectures) or damaged weights give NaN or infinite logits;
greedy decoding then emits token 0 (``<pad>``) forever and perplexity is ``nan``. :func:`check_loaded` runs a
fixed sentence through a freshly loaded model; :func:`check_logits` checks any logits (``xpuspec eval``'s windows).
"""

from pathlib import Path
from typing import List, Optional

import torch

from .errors import NumericsError
from .lowbit import LowBitConfig


def nonfinite(logits: torch.Tensor, head_tokens: Optional[torch.Tensor] = None) -> Optional[str]:
    """What is not finite in ``logits`` (float ``[..., vocab]``), as a phrase, or ``None`` when all is finite.

    ``head_tokens``: the columns a cut LM head scores (every other one is ``-inf`` by design and not checked).
    """
    scored = logits if head_tokens is None else logits[..., head_tokens]
    nan, inf = int(scored.isnan().sum()), int(scored.isinf().sum())
    if not nan and not inf:
        return None
    return f"{nan} NaN and {inf} infinite values among {scored.numel()} logits"


#: Formats to try when one computes non-finite logits, each with why it may help.
_OTHER_FORMATS = (("fp32", "fp32 (load_in_low_bit='fp32')"), ("bf16", "bf16 where the device has it"),
                  ("int8_asym", "int8_asym, whose activations keep fp32's range"))


def check_logits(logits: torch.Tensor, what: str, head_tokens: Optional[torch.Tensor] = None,
                 low_bit: Optional[LowBitConfig] = None) -> None:
    """Raise :class:`NumericsError` naming ``what`` (the model and its format) if ``logits`` are not finite.

    ``low_bit``: the weight format the logits were computed in (``None``: a source loaded without one, which both
    backends compute in fp32); the message suggests the other formats, and after fp32 (the widest range) damaged
    weights.
    """
    found = nonfinite(logits, head_tokens)
    if found is None:
        return
    fmt = low_bit.format if low_bit is not None else "fp32"
    if fmt == "fp32":
        advice = ("fp32 has the widest range of every format, so where the device computes in f32 (a CPU) the "
                  "weights themselves are likely damaged: download or convert the model again, and check its sha256. "
                  "A GPU computes in f16 by default: there pass ov_config={'INFERENCE_PRECISION_HINT': 'f32'} first.")
    else:
        others = [text for name, text in _OTHER_FORMATS if name != fmt]
        advice = (f"Load it in another format: {', '.join(others[:-1])} or {others[-1]}; if every format fails, "
                  "its weights are damaged.")
    raise NumericsError(f"{what} computes {found}, so its output would be garbage (all-<pad> text, perplexity nan). "
                        + advice)


def probe_ids(folder: Path, vocab_size: int) -> List[int]:
    """The plausibility sentence (:data:`xpuspec.sources.PLAUSIBILITY_TEXT`) through ``folder``'s
    ``tokenizer.json``, else 32 ids spread over the vocabulary."""
    from .sources import PLAUSIBILITY_TEXT

    path = Path(folder) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        ids = [i for i in Tokenizer.from_file(str(path)).encode(PLAUSIBILITY_TEXT).ids if i < vocab_size]
        if ids:
            return ids
    return [(7919 * i + 13) % vocab_size for i in range(32)]


def check_loaded(runner, folder: Path, what: str, low_bit: Optional[LowBitConfig] = None) -> None:
    """Run the plausibility sentence through a freshly loaded ``runner`` (its KV cache is left empty) and raise
    :class:`NumericsError` naming ``what`` where a logit is NaN or infinite (``low_bit``: see :func:`check_logits`).

    A runner whose passes run in lockstep across processes (a torchrun pipeline) is not probed: every rank
    would have to run the probe at once.
    """
    if runner.traits.lockstep:
        return
    try:
        logits = runner.forward(probe_ids(folder, runner.vocab_size))
    finally:
        runner.reset()
    check_logits(logits, what, runner.head_tokens, low_bit)
