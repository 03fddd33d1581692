"""Checks on what a caller passes to ``generate`` and ``__call__``: the ids, the mask, and the context.

Each failure raises :class:`InvalidInputError` (or its subclass :class:`PromptTooLongError`),
a ``ValueError``, naming what is wrong and how to fix it, before any model runs.
"""

import logging
from typing import Optional

import torch
from transformers import GenerationConfig

from .errors import InvalidInputError, PromptTooLongError
from .generation import max_new_tokens

log = logging.getLogger("xpuspec")


def check_input_ids(input_ids, attention_mask, vocab_size: int) -> torch.Tensor:
    """Validate one prompt and return it as a LongTensor ``[1, seq_len]``.

    Args:
        input_ids: ``[1, seq_len]`` or ``[seq_len]`` integer token ids (tensor, array or list).
        attention_mask: ``None``, or ones of the same shape.
        vocab_size: rows of the model's logits; every id must be below it.

    Raises:
        InvalidInputError: ``input_ids`` missing, not integers, empty, or with ids outside
            ``0..vocab_size-1``; ``attention_mask`` of another shape.
        NotImplementedError: a batch of more than one prompt, or padding (zeros in the mask).
    """
    if input_ids is None:
        raise InvalidInputError(
            "input_ids is required: pass the tokenizer's output, e.g. generate(**tok(prompt, return_tensors='pt')).")
    try:
        input_ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidInputError(
            f"input_ids must be token ids, got {type(input_ids).__name__}; tokenize the text first: "
            "tok(prompt, return_tensors='pt').input_ids.") from exc
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise InvalidInputError(
            f"input_ids must be integer token ids, got dtype {input_ids.dtype}; pass the tokenizer's input_ids "
            "(a LongTensor), or convert with .long() if the values are ids.")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise InvalidInputError(f"input_ids must have shape [1, seq_len], got {tuple(input_ids.shape)}.")
    if input_ids.shape[0] != 1:
        raise NotImplementedError(
            f"xpuspec runs batch size 1; got a batch of {input_ids.shape[0]}. Call generate once per prompt.")
    if input_ids.shape[1] == 0:
        raise InvalidInputError("The prompt is empty: input_ids has no tokens. Give at least one token.")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise InvalidInputError(
            f"input_ids holds token id {low if low < 0 else high}, outside this model's vocabulary "
            f"(0..{vocab_size - 1}); encode the prompt with this model's own tokenizer.")
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask)
        mask = mask[None] if mask.dim() == 1 else mask
        if mask.shape != input_ids.shape:
            raise InvalidInputError(
                f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(input_ids.shape)}; "
                "pass the mask the tokenizer returned with these ids, or none.")
        if not bool(mask.bool().all()):
            raise NotImplementedError(
                "Padded input (zeros in attention_mask) is not supported at batch size 1; pass the prompt unpadded.")
    return input_ids.to(torch.long)


def check_fits(seq_len: int, context: Optional[int], max_prompt_len: Optional[int] = None,
               device: str = "", room_for_next: bool = True) -> None:
    """Refuse a sequence that does not fit the model.

    Args:
        seq_len: tokens in the prompt (or in a forward pass).
        context: the model's context (``max_position_embeddings``), or ``None`` if unknown.
        max_prompt_len: the device's static prompt window (NPU), or ``None``.
        device: the device's name, for the message.
        room_for_next: the sequence must leave room for at least one generated token.

    Raises:
        PromptTooLongError: the sequence is longer than the device's prompt window, or does not fit the context.
    """
    if max_prompt_len is not None and seq_len > max_prompt_len:
        raise PromptTooLongError(
            f"The prompt has {seq_len} tokens but {device} takes at most {max_prompt_len} "
            f"(its static prompt window, NPUW_LLM_MAX_PROMPT_LEN); shorten the prompt or run on cpu or gpu.")
    if context is not None and seq_len + room_for_next > context:
        raise PromptTooLongError(
            f"The prompt has {seq_len} tokens but the model's context is {context}"
            f"{' (and one token must fit after it)' if room_for_next else ''}; shorten the prompt.")


def clamp_to_context(config: GenerationConfig, prompt_len: int, context: Optional[int]) -> None:
    """Stop generation at the context: lower ``config.max_new_tokens`` in place, with one warning,
    when the prompt plus the requested new tokens would pass ``context`` (transformers only warns,
    and then generates past the context)."""
    wanted = max_new_tokens(config, prompt_len)
    if context is not None and prompt_len + wanted > context:
        log.warning("The prompt (%d tokens) plus max_new_tokens (%d) exceed the model's context (%d tokens); "
                    "generation stops at the context, after at most %d new tokens.",
                    prompt_len, wanted, context, context - prompt_len)
        config.max_new_tokens = context - prompt_len
