"""Checks on what a caller passes to ``generate`` and ``__call__``: the ids, the mask, and the context.

Each failure raises :class:`InvalidInputError` (or its subclass :class:`PromptTooLongError`),
a ``ValueError``, naming what is wrong and how to fix it, before any model runs.
"""

import copy
import logging
from typing import List, NamedTuple, Optional

import torch
from transformers import GenerationConfig

from .errors import GenerationConfigError, InvalidInputError, PromptTooLongError
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


def row_config(base: GenerationConfig, prompt_len: int, context: Optional[int], max_prompt_len: Optional[int] = None,
               device: str = "") -> GenerationConfig:
    """A copy of ``base`` for one row of ``prompt_len`` tokens: checked against the prompt (:func:`check_max_length`,
    :func:`check_fits`) and its ``max_new_tokens`` clamped to the context (:func:`clamp_to_context`).

    Raises:
        GenerationConfigError, PromptTooLongError: as those checks.
    """
    config = copy.deepcopy(base)
    check_max_length(config, prompt_len)
    check_fits(prompt_len, context, max_prompt_len, device)
    clamp_to_context(config, prompt_len, context)
    return config


def check_max_length(config: GenerationConfig, prompt_len: int) -> None:
    """Refuse a ``max_length`` (without ``max_new_tokens``) that leaves no room after the prompt, as transformers does.

    Raises:
        GenerationConfigError: the prompt has at least ``max_length`` tokens.
    """
    if config.max_new_tokens is None and config.max_length is not None and prompt_len >= config.max_length:
        raise GenerationConfigError(f"Input length of input_ids is {prompt_len}, but max_length is set to "
                                    f"{config.max_length}; increase max_length or, better, set max_new_tokens.")


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


class PromptRows(NamedTuple):
    """The prompts of one ``generate`` call, checked: ``ids`` the LongTensor ``[B, T]`` as given (padded where the
    mask pads), ``prompts`` each row's unpadded token ids (``B`` lists)."""

    ids: torch.Tensor
    prompts: List[List[int]]


def prompt_rows(input_ids, attention_mask, vocab_size: int) -> PromptRows:
    """``generate``'s ``input_ids`` and ``attention_mask`` as rows: one prompt (:func:`check_input_ids`) is a batch of
    one row; a batch is checked by :func:`check_batch`.

    Raises:
        InvalidInputError: as :func:`check_input_ids` and :func:`check_batch`.
    """
    if is_batch(input_ids, attention_mask):
        return check_batch(input_ids, attention_mask, vocab_size)
    ids = check_input_ids(input_ids, attention_mask, vocab_size)
    return PromptRows(ids, [ids[0].tolist()])


def is_batch(input_ids, attention_mask) -> bool:
    """Whether ``generate`` gets a batch (more than one row, or padding in the mask) rather than one plain prompt."""
    if _rows(input_ids) and len(input_ids) > 1:
        return True
    shape = getattr(input_ids, "shape", None)
    if shape is not None and len(shape) == 2 and shape[0] > 1:
        return True
    if attention_mask is not None:
        try:
            return not bool(torch.as_tensor(attention_mask).bool().all())
        except (TypeError, ValueError, RuntimeError):
            return False
    return False


def check_batch(input_ids, attention_mask, vocab_size: int) -> PromptRows:
    """Validate a batch of prompts as transformers takes it (``tok(prompts, padding=True, return_tensors="pt")``)
    and return its :class:`PromptRows`: the LongTensor ``[B, T]`` and each row's unpadded token ids.

    Args:
        input_ids: ``[B, T]`` integer ids (tensor, array, or a list of equal-length lists).
        attention_mask: ``[B, T]`` of 0 and 1, each row's ones contiguous at one side (left or right padding,
            the same side for every row); ``None`` when no row is padded.
        vocab_size: every unmasked id must be below it.

    Raises:
        InvalidInputError: ragged lists, another shape, a mask that is not 0/1, of another shape, with a hole (a 0
            between ones), with a row of zeros, or padding both sides; ids outside the vocabulary.
    """
    if _rows(input_ids):
        lengths = sorted({len(r) for r in input_ids})
        if len(lengths) > 1:
            raise InvalidInputError(
                f"input_ids is a ragged list (rows of {lengths} tokens); pad the prompts to one length with a mask, "
                "as the tokenizer does: tok(prompts, padding=True, return_tensors='pt'), then generate(**batch).")
    ids = _integer_ids(input_ids)
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise InvalidInputError(f"input_ids must have shape [batch, seq_len] with seq_len >= 1, got {tuple(ids.shape)}.")
    if attention_mask is None:
        mask = torch.ones_like(ids)
    else:
        try:
            mask = torch.as_tensor(attention_mask)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidInputError("attention_mask must be a [batch, seq_len] tensor of 0 and 1 (ragged lists are "
                                    "not one); pass the mask the tokenizer returned.") from exc
        mask = mask[None] if mask.dim() == 1 else mask
        if mask.shape != ids.shape:
            raise InvalidInputError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has "
                                    f"{tuple(ids.shape)}; pass the mask the tokenizer returned with these ids.")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise InvalidInputError("attention_mask must hold only 0 (padding) and 1 (tokens).")
    mask = mask.to(torch.long)
    prompts, sides = [], set()
    for i, row in enumerate(mask.tolist()):
        ones = [j for j, v in enumerate(row) if v]
        if not ones:
            raise InvalidInputError(f"attention_mask row {i} is all zeros: that prompt has no tokens. Drop the row "
                                    "or give it at least one token.")
        first, last = ones[0], ones[-1]
        if last - first + 1 != len(ones):
            raise InvalidInputError(
                f"attention_mask row {i} has a hole (a 0 between its 1s at positions {first}..{last}): padding must "
                "sit at one end of a row (left or right padding); pass the mask the tokenizer returned.")
        if first > 0:
            sides.add("left")
        if last < len(row) - 1:
            sides.add("right")
        prompts.append(ids[i, first:last + 1].tolist())
    if len(sides) > 1:
        raise InvalidInputError("attention_mask pads some rows on the left and others on the right (or rows on both "
                                "ends); pad every row on one side: tok.padding_side = 'left' (what decoder-only "
                                "generation expects) or 'right'.")
    flat = [t for p in prompts for t in p]
    low, high = min(flat), max(flat)
    if low < 0 or high >= vocab_size:
        raise InvalidInputError(
            f"input_ids holds token id {low if low < 0 else high}, outside this model's vocabulary "
            f"(0..{vocab_size - 1}); encode the prompts with this model's own tokenizer.")
    return PromptRows(ids, prompts)


def _rows(input_ids) -> bool:
    """Whether ``input_ids`` is a non-empty list of rows: lists of ids, or 1-D tensors."""
    return isinstance(input_ids, (list, tuple)) and len(input_ids) > 0 and all(
        isinstance(r, (list, tuple)) or (isinstance(r, torch.Tensor) and r.dim() == 1) for r in input_ids)


def _integer_ids(input_ids) -> torch.Tensor:
    if _rows(input_ids) and all(isinstance(r, torch.Tensor) for r in input_ids):
        input_ids = torch.stack(input_ids)  # rows of one length (check_batch refused ragged ones)
    if input_ids is None:
        raise InvalidInputError(
            "input_ids is required: pass the tokenizer's output, e.g. generate(**tok(prompts, padding=True, "
            "return_tensors='pt')).")
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidInputError(f"input_ids must be token ids, got {type(input_ids).__name__}; tokenize the text "
                                "first: tok(prompts, padding=True, return_tensors='pt').input_ids.") from exc
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InvalidInputError(f"input_ids must be integer token ids, got dtype {ids.dtype}.")
    return ids.to(torch.long)
