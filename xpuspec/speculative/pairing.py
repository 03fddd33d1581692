"""Pairing a draft with a target: the vocabulary check, and building the drafter for a request."""

from functools import lru_cache

from ..decode import DraftSchedule
from ..errors import DraftMismatchError
from .config import SpeculativeConfig
from .drafters import (DEFAULT_DRAFT_CONTEXT_LENGTH, DEFAULT_LOOKUP_TOKENS, HybridDrafter, ModelDrafter,
                       PromptLookupDrafter, check_count)
from .overlap import OverlappedDrafter


@lru_cache(maxsize=16)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def check_draft(target, draft) -> None:
    """Refuse a draft whose tokenizer differs from the target's.

    The tokenizers themselves are compared (every token string and id, BOS and EOS), not only
    their sizes. A padded embedding (more logit rows than tokenizer entries) is allowed.

    Raises:
        DraftMismatchError: vocabularies, special tokens or row counts do not fit.
    """
    tt, td = _tokenizer(str(target.source.path)), _tokenizer(str(draft.source.path))
    vt, vd = tt.get_vocab(), td.get_vocab()
    if vt != vd:
        differing = sorted(set(vt.items()) ^ set(vd.items()), key=lambda kv: kv[1])[:3]
        raise DraftMismatchError(
            f"Draft {draft.name_or_path!r} has another vocabulary than target {target.name_or_path!r} "
            f"({len(vd)} vs {len(vt)} tokens; e.g. {differing}). Pick a draft from the same model family."
        )
    for what in ("bos_token_id", "eos_token_id"):
        a, b = getattr(target.generation_config, what), getattr(draft.generation_config, what)
        if a != b:
            raise DraftMismatchError(
                f"Draft {draft.name_or_path!r} has {what}={b} but the target has {a}; they must match."
            )
    for model in (target, draft):
        if model.runner.vocab_size < len(tt):
            raise DraftMismatchError(
                f"{model.name_or_path!r} scores {model.runner.vocab_size} tokens but its tokenizer has {len(tt)}."
            )


def plan_speculation(target, spec, enabled: bool, assistant_model=None, prompt_lookup_num_tokens=None,
                     num_assistant_tokens=None, num_assistant_tokens_schedule=None,
                     assistant_confidence_threshold=None):
    """The drafter and draft schedule for one ``generate`` call: ``(drafter or None, DraftSchedule)``.

    ``generate``'s arguments take precedence over the model's :class:`SpeculativeConfig` ``spec``;
    ``assistant_model`` with ``prompt_lookup_num_tokens`` makes a hybrid drafter. ``enabled=False``
    (``generate(speculative=False)``) decodes plainly.

    Raises:
        DraftMismatchError: the assistant's vocabulary differs from the target's.
        SpeculativeConfigError: an invalid draft length, schedule or threshold.
    """
    if num_assistant_tokens is not None:  # each refused by its own name, before the schedule takes one of them
        num_assistant_tokens = check_count("num_assistant_tokens", num_assistant_tokens)
    if prompt_lookup_num_tokens is not None:
        prompt_lookup_num_tokens = check_count("prompt_lookup_num_tokens", prompt_lookup_num_tokens)
    base = spec or SpeculativeConfig()
    lookup_k = spec.prompt_lookup_num_tokens if spec and spec.mode == "prompt_lookup" else None
    drafter = _drafter(target, spec, base, assistant_model, prompt_lookup_num_tokens) if enabled else None
    schedule = DraftSchedule(
        num_assistant_tokens=_first(num_assistant_tokens, prompt_lookup_num_tokens, lookup_k,
                                    base.draft_length),
        schedule=_first(num_assistant_tokens_schedule, base.num_assistant_tokens_schedule,
                        "constant" if isinstance(drafter, PromptLookupDrafter) else "heuristic"),
        confidence_threshold=_first(assistant_confidence_threshold, base.assistant_confidence_threshold),
        cost_model=base.cost_model,
        lookup_tokens=_first(prompt_lookup_num_tokens, base.prompt_lookup_num_tokens, DEFAULT_LOOKUP_TOKENS),
    )
    return drafter, schedule


def _first(*values):
    return next(v for v in values if v is not None)


def _drafter(target, spec, base, assistant_model, prompt_lookup_num_tokens):
    """``base``: ``spec``, or the default :class:`SpeculativeConfig` when ``spec`` is ``None``."""

    def lookup(hybrid=False):
        return PromptLookupDrafter(base.max_matching_ngram_size, base.shortest_ngram(hybrid))

    def hybrid(model):
        return HybridDrafter(lookup(hybrid=True), model, fallback=lookup())

    if assistant_model is not None:
        check_draft(target, assistant_model)
        model = _model_drafter(target, assistant_model, spec)
        return hybrid(model) if prompt_lookup_num_tokens else model
    if prompt_lookup_num_tokens:
        return lookup()
    if spec is None:
        return None
    if spec.mode == "prompt_lookup":
        return lookup()
    model = _model_drafter(target, target.draft_model, spec)
    return hybrid(model) if spec.mode == "hybrid" else model


def _model_drafter(target, draft, spec):
    """The draft model's drafter, overlapped with verification when ``spec.overlap`` says so or,
    by default, when the draft runs on a device that none of the target's stages uses."""
    if draft.runner is not target.runner:  # a draft's 1-token passes need not compute as its wider ones
        draft.runner.single_step_width = 1
    model = ModelDrafter(draft.runner, target.runner.vocab_size,
                         DEFAULT_DRAFT_CONTEXT_LENGTH if spec is None else spec.draft_context)
    overlap = spec.overlap if spec is not None else None
    if overlap is None:
        overlap = set(draft.runner.device.split(",")).isdisjoint(target.runner.device.split(","))
    return OverlappedDrafter(model) if overlap else model
