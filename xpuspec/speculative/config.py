"""SpeculativeConfig: which drafter, and how long its drafts are.

``from_pretrained(..., speculative=X)`` accepts ``True`` (:data:`DEFAULT_MODE`), ``"self"``,
``"layer_skip"``, ``"prompt_lookup"``, ``"hybrid"``, ``"suffix"``, ``"suffix_hybrid"``, a draft model path or
name, or a :class:`SpeculativeConfig`.
"""

import numbers
import os
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from ..errors import SpeculativeConfigError
from .drafters import DEFAULT_DRAFT_CONTEXT_LENGTH, PromptLookupDrafter
from .schedule import DEFAULT_LOOKUP_TOKENS, DraftSchedule, check_count

MODES = ("self", "layer_skip", "prompt_lookup", "hybrid", "suffix", "suffix_hybrid", "draft", "eagle3")
#: Modes that draft without a model.
FREE_MODES = ("prompt_lookup", "suffix")
#: The mode of ``speculative=True``: the one measured fastest end to end against plain decoding on the CPUs
#: measured (benchmarks/results/speculative-default.md); it never lost to plain under load, and it holds no
#: second copy of the weights.
DEFAULT_MODE = "prompt_lookup"
#: Draft format of self-speculation: a low-bit copy of the target.
DEFAULT_SELF_DRAFT_LOW_BIT = "int4_sym"
DRAFT_DEVICE_ENV = "XPUSPEC_DRAFT_DEVICE"
#: Default draft length k with a draft model (transformers' ``num_assistant_tokens``).
DEFAULT_ASSISTANT_TOKENS = 4
#: A draft model left out of this many requests in a row gives its memory back until a request drafts with it.
DEFAULT_RELEASE_DRAFT_AFTER = 4
#: Default shortest n-gram of prompt lookup alone (a hybrid's is its longest).
DEFAULT_MIN_NGRAM = 2


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative-decoding settings (transformers' names where they exist).

    Attributes:
        mode: ``"self"`` (low-bit copy of the target drafts), ``"layer_skip"`` (the target
            without some of its layers drafts; see :mod:`xpuspec.speculative.layerskip`), ``"prompt_lookup"`` (n-gram
            lookup, no model), ``"hybrid"`` (lookup when an n-gram matches, else the draft
            model), ``"suffix"`` (SuffixDecoding: drafts from this request's text and earlier requests' outputs,
            no model; :mod:`xpuspec.speculative.suffix_drafter`), ``"suffix_hybrid"`` (suffix drafts first, else the
            draft model), ``"draft"`` (a separate draft model) or ``"eagle3"`` (an EAGLE-3 head in the Speculators
            format, ``draft=`` its folder, fed by the target's hidden states; :mod:`xpuspec.speculative.eagle3`).
        draft: draft model path or name for ``"draft"`` (and optionally ``"hybrid"`` and ``"suffix_hybrid"``).
        draft_low_bit: weight format of the draft (default ``int4_sym`` for self-speculation, the
            target's format for layer-skip; for an EAGLE-3 head ``"int8_sym"`` or ``"fp32"``:
            :data:`~xpuspec.speculative.eagle3.HEAD_FORMATS`).
        skip_layers: decoder layers the layer-skip draft leaves out (default: chosen by calibration).
        draft_device: device of the draft (default ``$XPUSPEC_DRAFT_DEVICE``, else the target's).
        num_assistant_tokens: initial draft length k per round; default 4 (transformers') with a draft
            model, :data:`~xpuspec.speculative.drafters.DEFAULT_LOOKUP_TOKENS` (10) for prompt lookup alone (a
            lookup draft costs nothing to make; each round is cut to the length the verify costs favour).
        num_assistant_tokens_schedule: ``"heuristic"`` or ``"constant"``; default ``"constant"`` for
            prompt lookup alone (as transformers' ``prompt_lookup_num_tokens``), else ``"heuristic"``.
        assistant_confidence_threshold: stop drafting below this draft top probability (0: off).
        prompt_lookup_num_tokens: the longest draft of prompt lookup: with ``"prompt_lookup"`` its draft length
            (default: num_assistant_tokens), with ``"hybrid"`` the most a lookup round drafts, there and once the
            draft model is dropped (default :data:`~xpuspec.speculative.drafters.DEFAULT_LOOKUP_TOKENS`; each round
            is cut to the length the verify costs favour); with ``"eagle3"`` the same, the head drafting where no
            n-gram matches (the head keeps the target's hidden states of every pass, lookup rounds' included).
            Other modes do not look up.
        max_matching_ngram_size: longest n-gram prompt lookup matches (default 3, openvino_genai's).
        min_matching_ngram_size: shortest n-gram prompt lookup matches: default 2 (vLLM's ``prompt_lookup_min``; 1
            proposes after any repeated token, which rarely pays; at most ``max_matching_ngram_size``), and
            ``max_matching_ngram_size`` for a hybrid's lookup while its draft model is on: there a lookup displaces
            the draft model's tokens, and a 2-gram match is weaker evidence than the model.
        cost_model: choose each round's draft length from the target's measured verify costs and the measured
            acceptance, and stop a draft model that cannot pay (:mod:`xpuspec.speculative.policy`); ``False``
            drafts ``num_assistant_tokens`` every round.
        overlap: draft the next block while the target verifies this one (PEARL; see
            :mod:`xpuspec.speculative.overlap`). ``None``: on when the draft model runs on a device
            none of the target's stages uses.
        draft_vocab_size: the draft model's LM head scores only this many most frequent tokens
            (FR-Spec; :mod:`xpuspec.speculative.vocab`): a cheaper draft step, output unchanged. ``None``:
            :data:`~xpuspec.speculative.vocab.DEFAULT_DRAFT_VOCAB_SIZE` where the draft's backend can cut
            its head (OpenVINO on CPU and GPU) and its vocabulary is at least twice as large; ``0``: the
            whole vocabulary. It applies to the draft ``from_pretrained`` loads; an ``assistant_model``
            given to ``generate`` keeps the head it was loaded with.
        draft_context_length: the draft model prefills only this many last tokens of the context it starts
            from (:class:`~xpuspec.speculative.drafters.ModelDrafter`); it sees every token after them. A
            cheaper draft prefill; the target verifies every draft, so greedy output is unchanged and sampled
            output follows the target's distribution (a seeded run may draw other tokens). ``None``:
            :data:`~xpuspec.speculative.drafters.DEFAULT_DRAFT_CONTEXT_LENGTH`; ``0``: the whole context. An
            ``assistant_model`` given to ``generate`` takes this model's value (the default without one).
        share_across_requests: suffix modes draft from the outputs of this model's earlier requests too (its
            :class:`~xpuspec.speculative.suffix_cache.SuffixCache`); ``False`` drafts from each request's own text.
            A shared cache cannot change an output (an accepted draft is the target's own token), but its timing
            can tell one request that another's output resembled it (see ``docs/speculative.md``).
        suffix_cache_dir: a folder where the suffix cache is saved and restored across processes (``None``: kept
            in memory only).
        release_draft_after: a draft model that the policy left out of this many requests in a row is released
            (its compiled models and KV cache dropped) and loaded again when a request drafts with it
            (:mod:`xpuspec.speculative.resident`); 0 keeps it loaded.
    """

    mode: str = "self"
    draft: Optional[str] = None
    draft_low_bit: Optional[str] = None
    draft_device: Optional[str] = None
    skip_layers: Optional[Tuple[int, ...]] = None
    num_assistant_tokens: Optional[int] = None
    num_assistant_tokens_schedule: Optional[str] = None
    assistant_confidence_threshold: float = 0.0
    prompt_lookup_num_tokens: Optional[int] = None
    max_matching_ngram_size: int = 3
    min_matching_ngram_size: Optional[int] = None
    cost_model: bool = True
    overlap: Optional[bool] = None
    draft_vocab_size: Optional[int] = None
    draft_context_length: Optional[int] = None
    share_across_requests: bool = True
    suffix_cache_dir: Optional[str] = None
    release_draft_after: int = DEFAULT_RELEASE_DRAFT_AFTER

    def __post_init__(self):
        if self.mode not in MODES:
            raise SpeculativeConfigError(f"Unknown speculative mode {self.mode!r}; choose one of {', '.join(MODES)}.")
        if self.mode == "draft" and not self.draft:
            raise SpeculativeConfigError("mode='draft' needs draft= (a draft model path or name).")
        if self.mode == "eagle3":
            if not self.draft:
                raise SpeculativeConfigError("mode='eagle3' needs draft= (the folder of an EAGLE-3 head in the "
                                             "Speculators format).")
            given = [n for n in ("draft_device", "draft_vocab_size", "draft_context_length") if getattr(self, n)]
            if given or self.overlap:
                raise SpeculativeConfigError(f"mode='eagle3' drafts with a head on the CPU in torch, with its own draft "
                                             f"vocabulary: drop {'=, '.join(given or ['overlap'])}=.")
            from .eagle3 import HEAD_FORMATS

            if self.draft_low_bit is not None and self.draft_low_bit not in HEAD_FORMATS:
                raise SpeculativeConfigError(f"mode='eagle3': draft_low_bit={self.draft_low_bit!r} is not a format of "
                                             f"the head; use one of {', '.join(map(repr, HEAD_FORMATS))}, or drop it "
                                             f"(default {HEAD_FORMATS[0]!r}).")
        for name in ("num_assistant_tokens", "prompt_lookup_num_tokens", "min_matching_ngram_size"):
            if getattr(self, name) is not None:  # ints, NumPy's too, kept as Python ints
                object.__setattr__(self, name, check_count(name, getattr(self, name)))
        object.__setattr__(self, "max_matching_ngram_size",  # before shortest_ngram uses it
                           check_count("max_matching_ngram_size", self.max_matching_ngram_size))
        checked = DraftSchedule(self.draft_length, "heuristic" if self.num_assistant_tokens_schedule is None
                                else self.num_assistant_tokens_schedule, self.assistant_confidence_threshold,
                                self.cost_model)  # raises on a bad schedule, threshold or cost_model
        object.__setattr__(self, "assistant_confidence_threshold", checked.confidence_threshold)  # a float
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise SpeculativeConfigError(f"overlap must be True, False or None (the default), got {self.overlap!r}.")
        for hybrid in (False, True):  # bad sizes raise; generate(prompt_lookup_num_tokens=) may ask for either
            PromptLookupDrafter(self.max_matching_ngram_size, self.shortest_ngram(hybrid))
        if self.prompt_lookup_num_tokens is not None and self.mode not in ("prompt_lookup", "hybrid", "suffix",
                                                                          "suffix_hybrid", "eagle3"):
            raise SpeculativeConfigError(f"prompt_lookup_num_tokens applies to modes 'prompt_lookup', 'hybrid', 'suffix', "
                                         f"'suffix_hybrid' and 'eagle3', not {self.mode!r}: drop it, or pick one of "
                                         "those modes.")
        if not isinstance(self.share_across_requests, bool):
            raise SpeculativeConfigError(f"share_across_requests must be True or False, got {self.share_across_requests!r}.")
        if (self.suffix_cache_dir is not None or not self.share_across_requests) and not self.mode.startswith("suffix"):
            raise SpeculativeConfigError(f"share_across_requests and suffix_cache_dir apply to modes 'suffix' and "
                                         f"'suffix_hybrid', not {self.mode!r}.")
        if self.skip_layers is not None:
            if self.mode != "layer_skip":
                raise SpeculativeConfigError(f"skip_layers applies to mode='layer_skip', not {self.mode!r}.")
            layers = self.skip_layers
            if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__") or not list(layers) or any(
                    isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in layers):
                raise SpeculativeConfigError(f"skip_layers must be a non-empty sequence of layer indices (ints >= 0), "
                                             f"e.g. (3, 4), got {layers!r}.")
            object.__setattr__(self, "skip_layers", tuple(sorted({int(i) for i in layers})))
        given = [name for name in ("draft", "draft_low_bit", "draft_device") if getattr(self, name)]
        if self.mode in FREE_MODES and given:
            raise SpeculativeConfigError(f"{self.mode} uses no draft model: drop {'=, '.join(given)}=.")
        after = self.release_draft_after
        if isinstance(after, bool) or not isinstance(after, numbers.Integral) or after < 0:
            raise SpeculativeConfigError(f"release_draft_after must be an int >= 0 (0: keep the draft loaded), got {after!r}.")
        object.__setattr__(self, "release_draft_after", int(after))
        self._check_draft_count("draft_vocab_size", "vocabulary")
        self._check_draft_count("draft_context_length", "context")
        if self.mode in FREE_MODES and self.overlap:
            raise SpeculativeConfigError(
                f"overlap=True needs a draft model; {self.mode} drafts in microseconds and has nothing to "
                "overlap. Drop overlap= or pick mode 'self', 'layer_skip', 'hybrid' or 'draft'.")

    def _check_draft_count(self, name: str, whole: str) -> None:
        """A draft model's count option ``name``: None (the default), 0 (the ``whole`` ...) or an int >= 1,
        and none with prompt lookup, which has no draft model."""
        value = getattr(self, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
            raise SpeculativeConfigError(f"{name} must be an int >= 1, 0 (the whole {whole}) or None "
                                         f"(the default), got {value!r}.")
        if value is not None:
            object.__setattr__(self, name, int(value))
        if self.mode in FREE_MODES and value:
            raise SpeculativeConfigError(f"{self.mode} uses no draft model: drop {name}=.")

    @property
    def draft_length(self) -> int:
        """``num_assistant_tokens``, or its default for the mode."""
        if self.num_assistant_tokens is not None:
            return self.num_assistant_tokens
        return DEFAULT_LOOKUP_TOKENS if self.mode in FREE_MODES else DEFAULT_ASSISTANT_TOKENS

    @property
    def draft_context(self) -> int:
        """``draft_context_length``, or its default (0: the whole context)."""
        return DEFAULT_DRAFT_CONTEXT_LENGTH if self.draft_context_length is None else self.draft_context_length

    def shortest_ngram(self, hybrid: bool) -> int:
        """``min_matching_ngram_size``, or its default for prompt lookup alone (``hybrid=False``; also a hybrid's
        once it dropped its draft model) or a hybrid's lookup beside its draft model (also the ``assistant_model``
        with ``prompt_lookup_num_tokens`` of ``generate``)."""
        if self.min_matching_ngram_size is not None:
            return self.min_matching_ngram_size
        return self.max_matching_ngram_size if hybrid else min(DEFAULT_MIN_NGRAM, self.max_matching_ngram_size)

    @property
    def uses_model(self) -> bool:
        return self.mode not in FREE_MODES

    @property
    def resolved_draft_device(self) -> Optional[str]:
        return self.draft_device or os.environ.get(DRAFT_DEVICE_ENV) or None


def resolve_speculative(speculative, **overrides) -> Optional[SpeculativeConfig]:
    """Turn ``from_pretrained``'s ``speculative=`` (and ``draft_low_bit=``, ``draft_device=``) into a config.

    Raises:
        SpeculativeConfigError: an unknown mode, or draft settings without speculation.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if speculative is None or speculative is False:
        if overrides:
            raise SpeculativeConfigError(
                f"{', '.join(sorted(overrides))} given without speculative=; add speculative='self' (or another mode with a draft model).")
        return None
    if isinstance(speculative, SpeculativeConfig):
        return replace(speculative, **overrides)
    if speculative is True:
        return SpeculativeConfig(mode=DEFAULT_MODE, **overrides)
    if isinstance(speculative, str) and speculative in MODES and speculative not in ("draft", "eagle3"):
        return SpeculativeConfig(mode=speculative, **overrides)
    if isinstance(speculative, (str, os.PathLike)):
        _refuse_mode_typo(str(speculative))
        from .eagle3 import is_eagle3_head

        mode = "eagle3" if is_eagle3_head(os.path.expanduser(str(speculative))) else "draft"
        return SpeculativeConfig(mode=mode, draft=str(speculative), **overrides)
    raise SpeculativeConfigError(f"speculative= takes True ({DEFAULT_MODE!r}), 'self', 'layer_skip', 'prompt_lookup', 'hybrid', a draft "
                                 f"path or a SpeculativeConfig, not {speculative!r}.")


def _refuse_mode_typo(name: str) -> None:
    """A draft name that is no folder but spells a mode another way (``"layer-skip"``, ``"Prompt_Lookup"``)."""
    spelled = name.lower().replace("-", "_").replace(" ", "_")
    if spelled not in MODES or os.path.isdir(os.path.expanduser(name)):
        return
    if spelled == "eagle3":
        raise SpeculativeConfigError(f"speculative={name!r}: an EAGLE-3 head drafts when speculative= names its folder "
                                     "(speculative='path/to/head'), or with SpeculativeConfig(mode='eagle3', draft=...).")
    if spelled == "draft":
        raise SpeculativeConfigError(f"speculative={name!r}: a draft model drafts when speculative= names it (its path "
                                     "or built-in name), or with SpeculativeConfig(mode='draft', draft=...).")
    raise SpeculativeConfigError(f"speculative={name!r} is neither a mode nor a draft model folder; did you mean "
                                 f"{spelled!r}? Modes: {', '.join(m for m in MODES if m != 'draft')}.")
