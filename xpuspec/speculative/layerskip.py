"""Layer-skip self-draft: the target with some of its decoder layers left out drafts for the full target.

Draft & Verify (Zhang et al. 2023), LayerSkip (Elhoushi et al. 2024) and SWIFT (Xia et al. 2024)
show that a model without some of its middle layers still predicts most of its own next tokens.
No extra model and no training are needed; which layers to skip is chosen by measurement:

1. One forward pass of the full model over a fixed calibration text ranks the middle layers
   (the first and last always stay) by how little each changes its input: the block influence
   ``1 - cos(h_in, h_out)`` averaged over positions (ShortGPT, Men et al. 2024).
2. Layers are skipped cumulatively in that order (least influential first). For each cumulative
   set the *agreement* is measured: the fraction of positions whose argmax equals the full
   model's. Teacher-forced agreement estimates alpha, the per-token acceptance rate under greedy
   verification. This stops once alpha falls below ``MIN_AGREEMENT``.
3. The set with the best predicted speed-up wins, using the speed-up model of speculative decoding
   (Leviathan et al. 2023): ``tau(alpha, k) / (k * c + v_k)``, with ``tau = (1 - alpha^(k+1)) / (1 - alpha)``
   tokens per round, ``c`` the draft's cost per token relative to the target's (the ratio of weight
   bytes read per token: kept layers plus the LM head) and ``v_k = 1 + VERIFY_COST_PER_TOKEN * k``
   the cost of a k-token verify pass in target steps (``VERIFY_COST_PER_TOKEN``: a wider pass reads the same
   weights, so each extra token costs a small fraction of a step).

The plan is cached per model and calibration text; the draft is a Hugging Face folder holding the
kept layers (renumbered), cached too, and loaded like any draft model on any backend. Its weights
are a copy of the kept layers: the extra memory is logged when it is loaded.
"""

import contextlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from ..cache import cache_root, cached_folder, digest, folder_fingerprint
from ..errors import ModelSourceError, SpeculativeConfigError

log = logging.getLogger("xpuspec")

#: Extra cost of one more token in a verify pass, in plain decode steps (measured: k=4 costs 1.5-1.65 steps).
VERIFY_COST_PER_TOKEN = 0.15
#: Draft lengths the plan considers.
DRAFT_LENGTHS = range(1, 9)
#: Stop skipping more layers once the agreement falls below this: no draft length can pay.
MIN_AGREEMENT = 0.3
PLAN_FILE = "layer_skip_plan.json"
#: Calibration text: code and prose, about 450 tokens for SmolLM2's tokenizer.
CALIBRATION_TEXT = '''def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1 if it is absent."""
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word):
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n):
        return sorted(self.counts.items(), key=lambda item: item[1], reverse=True)[:n]

The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined
movable metal type, oil-based ink and a wooden screw press. Books that had taken scribes months to copy
could now be printed in days, and within fifty years presses were working in more than two hundred
European cities. Cheaper books spread literacy, helped the Reformation and the scientific revolution,
and changed how knowledge was kept and shared.

Rivers carry sediment from the mountains to the sea, shaping valleys and deltas over thousands of years.
When a river slows down, it drops the heaviest grains first, so sand settles near the channel while fine
clay travels much further before it comes to rest.
'''


@dataclass
class LayerSkipPlan:
    """Which decoder layers the draft skips, and what calibration measured.

    Attributes:
        skip: indices of the skipped decoder layers (ascending).
        num_layers: decoder layers of the full model.
        agreement: teacher-forced argmax agreement of the draft with the full model (0..1).
        draft_cost: the draft's cost per token relative to the target's (weight-byte ratio).
        num_assistant_tokens: the draft length k with the best predicted speed-up.
        predicted_speedup: that speed-up over plain decoding (below 1: it is not expected to pay).
        calibration_tokens: tokens of calibration text scored.
        candidates: ``{"skip": n, "agreement": a, "predicted_speedup": s}`` for each cumulative set tried.
    """

    skip: List[int]
    num_layers: int
    agreement: float
    draft_cost: float
    num_assistant_tokens: int
    predicted_speedup: float
    calibration_tokens: int
    candidates: List[dict] = field(default_factory=list)


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Mean tokens a round yields (accepted drafts plus the target's own), Leviathan et al. 2023 eq. 1."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, draft_cost: float, k: int) -> float:
    """Speed-up over plain decoding of k-token drafts at per-token acceptance ``alpha`` and relative cost ``draft_cost``."""
    return expected_tokens_per_round(alpha, k) / (k * draft_cost + 1.0 + VERIFY_COST_PER_TOKEN * k)


def _layers(model):
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ModelSourceError(
            f"Layer-skip drafting needs a decoder with model.layers; {type(model).__name__} has none. "
            "Use speculative='self' (a low-bit self-draft), 'prompt_lookup' or a draft model instead."
        )
    return layers


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _set_layers(model, layers) -> None:
    """Give ``model`` these decoder layers, and its config their number."""
    model.model.layers = torch.nn.ModuleList(layers)
    model.config.num_hidden_layers = len(layers)


class _Skipping:
    """Context manager that runs ``model`` without some decoder layers (no KV cache involved)."""

    def __init__(self, model, skip: Sequence[int]):
        self.model, self.skip = model, set(skip)

    def __enter__(self):
        self.full = _layers(self.model)
        _set_layers(self.model, [m for i, m in enumerate(self.full) if i not in self.skip])
        return self.model

    def __exit__(self, *exc):
        _set_layers(self.model, self.full)


@torch.inference_mode()
def calibrate(model, input_ids: torch.Tensor) -> LayerSkipPlan:
    """Choose the layers to skip by block influence and measured agreement on ``input_ids`` (module docstring).

    Args:
        model: a transformers causal LM (fp32, eval mode) with ``model.model.layers``.
        input_ids: LongTensor ``[1, seq_len]`` of calibration text.

    Returns:
        The :class:`LayerSkipPlan` with the best predicted speed-up.

    Raises:
        ModelSourceError: the model has no ``model.layers`` to skip, or fewer than 3 of them.
    """
    layers = _layers(model)
    n = len(layers)
    if n < 3:
        raise ModelSourceError(f"Layer-skip drafting keeps the first and last layers, so it needs at least 3; "
                               f"this model has {n}. Use speculative='self', 'prompt_lookup' or a draft model instead.")
    full = model(input_ids=input_ids, use_cache=False, output_hidden_states=True)
    reference, hidden = full.logits[0].argmax(-1), full.hidden_states

    def agreement(skip) -> float:
        with _Skipping(model, skip):
            return float((model(input_ids=input_ids, use_cache=False).logits[0].argmax(-1) == reference).float().mean())

    per_layer = _bytes(layers) / n
    head = _bytes(model.get_output_embeddings())
    influence = {i: float(1 - torch.cosine_similarity(hidden[i][0], hidden[i + 1][0], dim=-1).mean())
                 for i in range(1, n - 1)}
    order = sorted(influence, key=influence.get)
    best, candidates = None, []
    for count in range(1, n - 1):
        skip = sorted(order[:count])
        alpha = agreement(skip)
        cost = ((n - count) * per_layer + head) / (n * per_layer + head)
        k = max(DRAFT_LENGTHS, key=lambda k: predicted_speedup(alpha, cost, k))
        plan = LayerSkipPlan(skip, n, alpha, cost, k, predicted_speedup(alpha, cost, k), int(input_ids.shape[1]))
        candidates.append({"skip": count, "agreement": round(alpha, 4), "predicted_speedup": round(plan.predicted_speedup, 3)})
        if best is None or plan.predicted_speedup > best.predicted_speedup:
            best = plan
        if alpha < MIN_AGREEMENT:
            break
    best.candidates = candidates
    return best


def _plan_folder(source) -> Path:
    return cache_root() / "layerskip" / folder_fingerprint(source.path)


def layer_skip_plan(source) -> LayerSkipPlan:
    """The cached calibration plan of ``source`` (a Hugging Face folder), calibrating on first use.

    Raises:
        ModelSourceError: ``source`` is an OpenVINO IR (layer-skip needs the original weights).
    """
    if source.kind != "hf":
        raise ModelSourceError(
            f"Layer-skip drafting needs the original Hugging Face weights, but {source.name!r} is an OpenVINO IR. "
            "Load the original model (a built-in name or HF folder), or use speculative='self' or 'prompt_lookup'."
        )

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("calibrating the layer-skip draft of %s", source.name)
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(source.path)(CALIBRATION_TEXT, return_tensors="pt").input_ids
        plan = calibrate(model, ids)
        (tmp / PLAN_FILE).write_text(json.dumps(asdict(plan), indent=2))

    folder = cached_folder(_plan_folder(source) / digest(CALIBRATION_TEXT, VERIFY_COST_PER_TOKEN), build)
    return LayerSkipPlan(**json.loads((folder / PLAN_FILE).read_text()))


def layer_skip_model(source, skip: Optional[Sequence[int]] = None) -> Path:
    """A cached Hugging Face folder of ``source`` without the decoder layers ``skip``.

    Args:
        source: the target's :class:`xpuspec.sources.ModelSource` (a Hugging Face folder).
        skip: layer indices to leave out; ``None`` uses :func:`layer_skip_plan`.

    Returns:
        The folder (config, weights of the kept layers renumbered 0..m-1, tokenizer files).

    Raises:
        ModelSourceError: an IR source.
        SpeculativeConfigError: ``skip`` is empty, out of range, or every layer.
    """
    plan = layer_skip_plan(source) if skip is None else None
    skip = sorted(set(plan.skip if plan else skip))
    n = source.config.num_hidden_layers
    if not skip or any(not 0 <= i < n for i in skip) or len(skip) >= n:
        raise SpeculativeConfigError(f"skip_layers={skip} must name 1 to {n - 1} of the layers 0..{n - 1} of "
                                     f"{source.name!r}.")
    if plan:
        log.log(logging.INFO if plan.predicted_speedup >= 1 else logging.WARNING,
                "layer-skip draft of %s skips %d of %d layers %s: calibrated agreement %.0f%%, predicted %.2fx at "
                "k=%d%s", source.name, len(skip), n, skip, 100 * plan.agreement, plan.predicted_speedup,
                plan.num_assistant_tokens, "" if plan.predicted_speedup >= 1 else
                " (below 1: the cost model will likely switch speculation off; a smaller draft model may pay)")

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
        kept = [m for i, m in enumerate(_layers(model)) if i not in skip]
        for new_index, layer in enumerate(kept):
            layer.self_attn.layer_idx = new_index
        _set_layers(model, kept)
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = [t for i, t in enumerate(model.config.layer_types) if i not in skip]
        model.save_pretrained(tmp)
        for f in source.path.iterdir():  # tokenizer and generation config, unchanged
            if f.is_file() and not (tmp / f.name).exists() and not f.name.endswith((".safetensors", ".bin", ".lock")):
                shutil.copy2(f, tmp / f.name)

    return cached_folder(_plan_folder(source) / f"skip-{digest(skip)}", build)


@contextlib.contextmanager
def layer_skip_draft(source, skip: Optional[Sequence[int]] = None):
    """:func:`layer_skip_model` for the block that loads the draft from it. If the block (or the calibration)
    raises, what this call added to the cache (the plan and the folder, gigabytes for a large model) is removed
    again: a draft that cannot be used leaves nothing behind.

    Yields:
        The draft's Hugging Face folder.
    """
    root = _plan_folder(source)
    before = set(root.iterdir()) if root.is_dir() else None
    try:
        yield layer_skip_model(source, skip)
    except BaseException:
        added = [root] if before is None else sorted(set(root.iterdir()) - before) if root.is_dir() else []
        for path in added:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        raise
