"""Pairing a draft with a target: the vocabulary check, and building the drafter for a request."""

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from ..errors import DraftMismatchError
from ..runner import Runner
from .config import SpeculativeConfig
from .drafters import DEFAULT_DRAFT_CONTEXT_LENGTH, Drafter, HybridDrafter, ModelDrafter, PromptLookupDrafter
from .overlap import OverlappedDrafter
from .schedule import DEFAULT_LOOKUP_TOKENS, DraftSchedule, check_count
from .suffix_drafter import SuffixDrafter


@lru_cache(maxsize=16)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def check_vocabularies(target, draft) -> None:
    """Refuse a draft whose tokenizer's vocabulary (every token string and id) differs from the target's; ``target``
    and ``draft`` are model sources (:class:`xpuspec.sources.ModelSource`), so this runs before either loads.

    Raises:
        DraftMismatchError: the vocabularies differ.
    """
    vt, vd = _tokenizer(str(target.path)).get_vocab(), _tokenizer(str(draft.path)).get_vocab()
    if vt != vd:
        differing = sorted(set(vt.items()) ^ set(vd.items()), key=lambda kv: kv[1])[:3]
        raise DraftMismatchError(
            f"Draft {draft.name!r} has another vocabulary than target {target.name!r} "
            f"({len(vd)} vs {len(vt)} tokens; e.g. {differing}). Pick a draft from the same model family."
        )


def check_draft(target, draft) -> None:
    """Refuse a draft whose tokenizer differs from the target's.

    The tokenizers themselves are compared (every token string and id, BOS and EOS), not only
    their sizes. A padded embedding (more logit rows than tokenizer entries) is allowed.

    Raises:
        DraftMismatchError: vocabularies, special tokens or row counts do not fit.
    """
    check_vocabularies(target.source, draft.source)
    tt = _tokenizer(str(target.source.path))
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


@dataclass(frozen=True)
class Plan:
    """The drafter of one ``generate`` call and how it drafts.

    Attributes:
        drafter: the drafter.
        schedule: its draft lengths.
        kind: the drafter's kind (``"lookup"``, ``"draft"``, ``"hybrid"``), which with ``draft_runner`` names its
            policy (:class:`xpuspec.speculative.policy.PolicyBook`).
        draft_runner: the draft model's runner, or ``None``.
        name: how log lines name the draft model.
    """

    drafter: Drafter
    schedule: DraftSchedule
    kind: str
    draft_runner: Optional[Runner] = None
    name: str = "prompt lookup"

    def without_model(self) -> Optional["Plan"]:
        """This plan with the draft model left out (a hybrid keeps its prompt lookup), or ``None``."""
        free = self.drafter.without_model()
        if free is None:
            return None
        return Plan(free, self.schedule.for_lookup(), "suffix" if isinstance(free, SuffixDrafter) else "lookup")


def plan_speculation(target, spec, enabled: bool, assistant_model=None, prompt_lookup_num_tokens=None,
                     num_assistant_tokens=None, num_assistant_tokens_schedule=None,
                     assistant_confidence_threshold=None) -> Optional[Plan]:
    """The drafter and draft schedule for one ``generate`` call, or ``None`` for plain decoding.

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
    lookup_k = spec.prompt_lookup_num_tokens if spec and spec.mode in ("prompt_lookup", "suffix") else None
    made = _drafter(target, spec, base, assistant_model, prompt_lookup_num_tokens) if enabled else None
    if made is None:
        return None
    drafter, kind, draft = made
    free = kind in ("lookup", "suffix")
    trained = target.eagle3_head.spec.speculative_tokens if kind == "eagle3" else None
    schedule = DraftSchedule(  # an EAGLE-3 head drafts, unless told, the chain it was trained for (as vLLM reads it)
        num_assistant_tokens=_first(num_assistant_tokens, prompt_lookup_num_tokens, lookup_k,
                                    base.num_assistant_tokens, trained, base.draft_length),
        schedule=_first(num_assistant_tokens_schedule, base.num_assistant_tokens_schedule,
                        "constant" if free else "heuristic"),
        confidence_threshold=_first(assistant_confidence_threshold, base.assistant_confidence_threshold),
        cost_model=base.cost_model,
        lookup_tokens=_first(prompt_lookup_num_tokens, base.prompt_lookup_num_tokens, DEFAULT_LOOKUP_TOKENS),
    )
    if draft is None:
        return Plan(drafter, schedule, kind, name="EAGLE-3 head" if kind == "eagle3" else "prompt lookup")
    return Plan(drafter, schedule, kind, draft.runner, f"draft model {draft.name_or_path}")


def _first(*values):
    return next(v for v in values if v is not None)


def _drafter(target, spec, base, assistant_model, prompt_lookup_num_tokens):
    """``(drafter, kind, draft model or None)``, or ``None`` for no speculation; ``base``: ``spec``, or the default
    :class:`SpeculativeConfig` when ``spec`` is ``None``."""

    def lookup(hybrid=False):
        return PromptLookupDrafter(base.max_matching_ngram_size, base.shortest_ngram(hybrid))

    def hybrid(draft):
        first = lookup(hybrid=True)
        extension = first if first.min_ngram == first.max_ngram else PromptLookupDrafter(first.max_ngram, first.max_ngram)
        return HybridDrafter(first, _model_drafter(target, draft, spec, extension), fallback=lookup()), "hybrid", draft

    def suffix():
        return SuffixDrafter(target.suffix_cache(spec), spec.share_across_requests)

    if assistant_model is not None:
        check_draft(target, assistant_model)
        if prompt_lookup_num_tokens:
            return hybrid(assistant_model)
        return _model_drafter(target, assistant_model, spec), "draft", assistant_model
    mode = spec.mode if spec is not None else None
    if mode == "suffix":
        return suffix(), "suffix", None
    if mode == "suffix_hybrid":
        first = suffix()
        return HybridDrafter(first, _model_drafter(target, target.draft_model, spec), first), mode, target.draft_model
    if prompt_lookup_num_tokens or mode == "prompt_lookup":
        return lookup(), "lookup", None
    if spec is None:
        return None
    if mode == "hybrid":
        return hybrid(target.draft_model)
    if mode == "eagle3":
        from .eagle3_drafter import Eagle3Drafter

        head = Eagle3Drafter(target.eagle3_head, target.runner.vocab_size)
        if spec.prompt_lookup_num_tokens:  # lookup where an n-gram matches, else the head
            return HybridDrafter(lookup(hybrid=True), head, fallback=lookup()), mode, None
        return head, mode, None
    return _model_drafter(target, target.draft_model, spec), mode, target.draft_model


def _model_drafter(target, draft, spec, extension=None):
    """The draft model's drafter, overlapped with verification when ``spec.overlap`` says so or, by default,
    when the draft runs on a device that none of the target's stages uses (an overlapped draft drafts ahead,
    so its chain is not ended by a lookup)."""
    model = ModelDrafter(draft.runner, target.runner.vocab_size,
                         DEFAULT_DRAFT_CONTEXT_LENGTH if spec is None else spec.draft_context)
    overlap = spec.overlap if spec is not None else None
    if overlap is None:
        overlap = set(draft.runner.device.split(",")).isdisjoint(target.runner.device.split(","))
    if overlap:
        return OverlappedDrafter(model)
    model.extension = extension
    return model
