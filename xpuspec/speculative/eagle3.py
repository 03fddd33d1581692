"""EAGLE-3 draft heads in the Speculators format: reading, checking against a target, and the head's forward.

An EAGLE-3 head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") drafts from the target's own hidden states. It reads the residual stream of three target
layers (the *taps*, ``eagle_aux_hidden_state_layer_ids``, default ``[2, L // 2, L - 3]`` of an ``L``-layer target),
projects their concatenation ``[3H]`` to ``H`` with ``fc``, and runs one decoder layer (more are allowed) whose first
layer takes ``[embed(token) ; hidden]`` (``2H``: q/k/v project from ``2H``; the token embedding goes through the
layer's ``input_layernorm``, the hidden part through ``hidden_norm`` and is the residual), then ``norm`` and an
``lm_head`` over a reduced *draft vocabulary*; ``d2t`` maps a draft id ``i`` to the target id ``i + d2t[i]``
(``t2d`` is the boolean mask of the kept target ids). The token embeddings are the target's.

**Positions.** Entry ``p`` of the head's KV cache is made from the token at position ``p`` and the target's taps at
position ``p - 1``, at rotary position ``p``; its logits predict the token at ``p + 1``. Past the context, entry
``p`` is made from the drafted token at ``p`` and the head's own output at ``p - 1`` (its decoder output, or its
normed output with ``norm_output``). This is the alignment the ``speculators`` package trains with
(``speculators.models.eagle3.data.shift_batch``: token ``x[t+1]`` beside hidden state ``g[t]``, positions from 1).

**Layer ids.** Tap ``i`` is the residual stream entering decoder layer ``i`` (transformers'
``output_hidden_states[i]``; vLLM's ``aux_hidden_state_layers``): ``0`` is the embeddings, ``L`` the last layer's
output before the final norm.

**Format.** ``config.json`` (``speculators_model_type: "eagle3"``, ``transformer_layer_config``,
``draft_vocab_size``, the norm flags ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``,
``speculators_config.proposal_methods[].speculative_tokens`` and ``.verifier.name_or_path``) and safetensors with
``fc.weight``, ``layers.N.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` / ``t2d`` (with a reduced vocabulary)
and optionally ``embed_tokens.weight`` (speculators 0.9.0 saves it; else the target's is used). Read from the
``speculators`` 0.9.0 package: ``models/eagle3/config.py``, ``core.py``, ``model_definitions.py``,
``train/vocab_mapping.py``.
"""

import copy
import importlib
import json
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import DraftMismatchError, ModelSourceError, OutputExistsError

MODEL_TYPE = "eagle3"
#: The transformers architectures a head's decoder layer may be built from (``transformer_layer_config.model_type``).
LAYER_TYPES = ("llama", "qwen3", "qwen2", "mistral")
#: Weight names the loader reads besides ``layers.*``.
_OPTIONAL = ("embed_tokens.weight", "d2t", "t2d", "input_norm.weight")
#: Weights of a speculators checkpoint that only training uses.
_TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")
#: Weight formats of a head while it drafts (``SpeculativeConfig.draft_low_bit``), the default first.
#: ``"int8_sym"``: every Linear (``fc``, the layer's projections, ``lm_head``) holds int8 weights, one scale per output
#: channel, and quantizes its input on each call (torch's dynamic quantization, x86/fbgemm kernels): a 4-token round
#: of a SmolLM2 head took 0.57-0.62x float32's, with the same acceptance (``benchmarks/eagle3_acceptance.py``,
#: ``benchmarks/eagle3_cost.py``). ``"fp32"``: the trained weights as they are. Training is always float32.
HEAD_FORMATS = ("int8_sym", "fp32")


def default_layer_ids(num_layers: int) -> Tuple[int, int, int]:
    """The taps of an ``num_layers``-layer target when the head names none: ``(2, L // 2, L - 3)`` (speculators'
    ``resolve_target_layer_ids``, vLLM's and EAGLE-3's default)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class HeadSpec:
    """What a head's ``config.json`` says, read without its weights.

    Attributes:
        path: the head's folder.
        layer_config: ``transformer_layer_config`` as a transformers config (its ``num_hidden_layers`` is the
            head's decoder layers, its ``hidden_size`` / ``vocab_size`` the target's).
        draft_vocab_size: rows of the head's ``lm_head``.
        layer_ids: the taps, or ``None`` (the default of the target's layer count).
        speculative_tokens: the chain length it was trained for (``proposal_methods[0].speculative_tokens``), or
            ``None``.
        verifier: ``speculators_config.verifier.name_or_path`` (informative: the target is checked by shape).
        norm_before_residual, norm_before_fc, fc_norm, norm_output: speculators' norm flags.
    """

    path: Path
    layer_config: object
    draft_vocab_size: int
    layer_ids: Optional[Tuple[int, ...]]
    speculative_tokens: Optional[int]
    verifier: Optional[str]
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    @property
    def hidden_size(self) -> int:
        return int(self.layer_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.layer_config.vocab_size)


def is_eagle3_head(path) -> bool:
    """``path`` is a folder whose ``config.json`` says ``speculators_model_type: "eagle3"``."""
    config = Path(str(path)) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("speculators_model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def read_head(path) -> HeadSpec:
    """Read an EAGLE-3 head's ``config.json``.

    Raises:
        ModelSourceError: no such folder, no ``config.json`` or weights, not an EAGLE-3 head, or a malformed field.
    """
    folder = Path(str(path)).expanduser()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"No EAGLE-3 head at {folder}: it has no config.json. Give the folder of a head in "
                               "the Speculators format (config.json and model.safetensors).")
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ModelSourceError(f"{config_file} is not valid JSON ({exc}).") from exc
    if raw.get("speculators_model_type") != MODEL_TYPE:
        raise ModelSourceError(f"{folder} is not an EAGLE-3 head: its config.json has speculators_model_type="
                               f"{raw.get('speculators_model_type')!r}, not 'eagle3'.")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict) or layer.get("model_type", "llama") not in LAYER_TYPES:
        kind = layer.get("model_type") if isinstance(layer, dict) else layer
        raise ModelSourceError(f"{config_file}: transformer_layer_config must be a config of one of "
                               f"{', '.join(LAYER_TYPES)}, got {kind!r}.")
    layer_config = _layer_config({"model_type": "llama", **layer})
    if not _weight_files(folder):
        raise ModelSourceError(f"{folder} has no *.safetensors weights beside its config.json.")
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and (not isinstance(ids, list) or not ids or any(
            isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ids)):
        raise ModelSourceError(f"{config_file}: eagle_aux_hidden_state_layer_ids must be a list of layer indices, "
                               f"got {ids!r}.")
    spec_config = raw.get("speculators_config") or {}
    methods = spec_config.get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    verifier = (spec_config.get("verifier") or {}).get("name_or_path")
    if raw.get("norm_before_fc") and raw.get("fc_norm"):
        raise ModelSourceError(f"{config_file}: norm_before_fc and fc_norm exclude each other.")
    draft_vocab = raw.get("draft_vocab_size", 32000)
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, numbers.Integral) or draft_vocab < 1:
        raise ModelSourceError(f"{config_file}: draft_vocab_size must be an int >= 1, got {draft_vocab!r}.")
    return HeadSpec(folder, layer_config, int(draft_vocab), tuple(int(i) for i in ids) if ids else None,
                    int(tokens) if isinstance(tokens, numbers.Integral) and tokens > 0 else None, verifier,
                    bool(raw.get("norm_before_residual", False)), bool(raw.get("norm_before_fc", False)),
                    bool(raw.get("fc_norm", False)), bool(raw.get("norm_output", False)))


def _weight_files(folder: Path) -> List[Path]:
    return sorted(folder.glob("*.safetensors"))


def _weight_shapes(folder: Path) -> Dict[str, Tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    shapes = {}
    for file in _weight_files(folder):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_head(spec: HeadSpec, hidden_size: int, vocab_size: int, num_layers: int) -> Tuple[int, ...]:
    """Check that ``spec`` drafts for a target of ``hidden_size``, ``vocab_size`` and ``num_layers`` (its
    transformers config), from the head's config and its weights' shapes, before anything is loaded.

    Returns:
        The taps (layer ids), the target's default where the head names none.

    Raises:
        DraftMismatchError: every mismatch, named (hidden size, vocabulary, a tap outside the target's layers, an
            ``fc`` that does not take the taps' width).
    """
    problems = []
    if spec.hidden_size != hidden_size:
        problems.append(f"hidden size {spec.hidden_size} (target: {hidden_size})")
    if spec.vocab_size != vocab_size:
        problems.append(f"vocabulary of {spec.vocab_size} tokens (target: {vocab_size})")
    if spec.draft_vocab_size > spec.vocab_size:
        problems.append(f"draft vocabulary of {spec.draft_vocab_size} tokens, above its vocabulary of {spec.vocab_size}")
    ids = spec.layer_ids if spec.layer_ids is not None else default_layer_ids(num_layers)
    outside = [i for i in ids if not 0 <= i <= num_layers]
    if outside or len(set(ids)) != len(ids):
        problems.append(f"tapped layers {list(ids)} (the target has {num_layers} layers: taps are distinct ids in "
                        f"0..{num_layers})")
    shapes = _weight_shapes(spec.path)
    fc = shapes.get("fc.weight")
    if fc is None:
        problems.append("no fc.weight in its safetensors")
    elif fc != (spec.hidden_size, len(ids) * hidden_size):
        problems.append(f"fc.weight of shape {list(fc)}, where {len(ids)} taps of a {hidden_size}-wide target need "
                        f"[{spec.hidden_size}, {len(ids) * hidden_size}]")
    head = shapes.get("lm_head.weight")
    if head is not None and head[0] != spec.draft_vocab_size:
        problems.append(f"lm_head.weight of {head[0]} rows, not draft_vocab_size {spec.draft_vocab_size}")
    embed = shapes.get("embed_tokens.weight")
    if embed is not None and embed != (vocab_size, hidden_size) and not problems:
        problems.append(f"embed_tokens.weight of shape {list(embed)} (target: [{vocab_size}, {hidden_size}])")
    if problems:
        name = f" (made for {spec.verifier})" if spec.verifier else ""
        raise DraftMismatchError(f"The EAGLE-3 head at {spec.path}{name} cannot draft for this target: "
                                 f"{'; '.join(problems)}. Use a head trained for this model (xpuspec train-draft "
                                 f"MODEL --method eagle3 makes one).")
    return tuple(ids)


def check_head_for(path, config) -> Tuple[int, ...]:
    """:func:`check_head` of the head at ``path`` against a target's transformers ``config`` (its ``text_config``
    where it has one): the taps.

    Raises:
        ModelSourceError: no head at ``path``.
        DraftMismatchError: as :func:`check_head`.
    """
    text = getattr(config, "text_config", None) or config
    return check_head(read_head(path), text.hidden_size, text.vocab_size, text.num_hidden_layers)


def target_embeddings(folder) -> torch.Tensor:
    """The token embeddings ``[vocab, hidden]`` in a transformers folder's safetensors.

    Raises:
        ModelSourceError: no safetensors in ``folder`` hold them.
    """
    from safetensors import safe_open

    for file in sorted(Path(str(folder)).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight"):
                    return f.get_tensor(name).float()
    raise ModelSourceError(f"The EAGLE-3 head has no embed_tokens.weight and {folder} has no safetensors with the "
                           "target's embeddings: save the head with embed_tokens.weight (speculators 0.9.0 does).")


def _layer_classes(model_type: str):
    """transformers' decoder layer, RMSNorm and rotary embedding classes of ``model_type``."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    found = {}
    for suffix in ("DecoderLayer", "RMSNorm", "RotaryEmbedding"):
        names = [n for n in dir(module) if n.endswith(suffix) and not n.startswith("_")]
        found[suffix] = getattr(module, min(names, key=len))
    return found["DecoderLayer"], found["RMSNorm"], found["RotaryEmbedding"]


class HeadCache:
    """A head's KV cache for one training sequence batch: entries ``1..length`` (see the module docstring), in
    transformers' ``DynamicCache`` (autograd flows through it)."""

    def __init__(self):
        from transformers import DynamicCache

        self.kv = DynamicCache()
        self.length = 0

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` entries."""
        if not 0 <= n <= self.length:
            raise ValueError(f"rollback({n}) with {self.length} entries in the head's cache")
        if n:
            self.length -= n
            self.kv.crop(self.length)


class DraftCache:
    """A head's KV cache for one drafting request: entries ``1..length``, per layer ``[1, kv_heads, capacity,
    head_dim]`` key and value buffers that double when full. A rollback only moves ``length`` (no copy); an entry is
    written where the next :meth:`Eagle3Head.draft` puts it."""

    def __init__(self):
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []
        self.length = 0

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` entries."""
        if not 0 <= n <= self.length:
            raise ValueError(f"rollback({n}) with {self.length} entries in the head's cache")
        self.length -= n

    def put(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write ``[1, kv_heads, n, head_dim]`` keys and values after the ``length`` entries of ``layer``; the
        layer's entries ``1..length + n`` as views."""
        end = self.length + keys.shape[2]
        if layer == len(self.keys):
            shape = (1, keys.shape[1], max(256, 2 * end), keys.shape[3])
            self.keys.append(torch.empty(shape))
            self.values.append(torch.empty(shape))
        elif end > self.keys[layer].shape[2]:
            for store in (self.keys, self.values):
                grown = torch.empty(store[layer].shape[:2] + (2 * end,) + store[layer].shape[3:])
                grown[:, :, :self.length] = store[layer][:, :, :self.length]
                store[layer] = grown
        self.keys[layer][:, :, self.length:end] = keys
        self.values[layer][:, :, self.length:end] = values
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class Eagle3Head(torch.nn.Module):
    """An EAGLE-3 head (see the module docstring for the math and positions); each request drafts on a
    :class:`DraftCache` of its own (:meth:`new_draft_cache`, :meth:`draft`), and training runs :meth:`forward` on a
    :class:`HeadCache`. Build it with :meth:`load`. Float32 on the CPU.
    """

    def __init__(self, spec: HeadSpec, layer_ids: Sequence[int]):
        super().__init__()
        config = copy.copy(spec.layer_config)
        config._attn_implementation = "sdpa"
        self.spec, self.layer_ids, self.config = spec, tuple(layer_ids), config
        hidden, taps = spec.hidden_size, len(layer_ids)
        layer_cls, norm_cls, rotary_cls = _layer_classes(config.model_type)
        eps = config.rms_norm_eps
        self.fc = torch.nn.Linear(taps * hidden, hidden, bias=False)
        self.input_norm = norm_cls(taps * hidden, eps=eps) if spec.norm_before_fc else None
        self.fc_norm = torch.nn.ModuleList([norm_cls(hidden, eps=eps) for _ in range(taps)]) if spec.fc_norm else None
        layers = [layer_cls(config, i) for i in range(config.num_hidden_layers)]
        first, heads, kv = layers[0], config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        attn = first.self_attn  # q/k/v take [embed ; hidden], 2H wide
        attn.q_proj = torch.nn.Linear(2 * hidden, heads * head_dim, bias=attn.q_proj.bias is not None)
        attn.k_proj = torch.nn.Linear(2 * hidden, kv * head_dim, bias=attn.k_proj.bias is not None)
        attn.v_proj = torch.nn.Linear(2 * hidden, kv * head_dim, bias=attn.v_proj.bias is not None)
        first.hidden_norm = norm_cls(hidden, eps=eps)
        self.layers = torch.nn.ModuleList(layers)
        rotary_config = copy.copy(config)  # speculators builds its rotary embedding on a 2H-wide config
        rotary_config.hidden_size = 2 * hidden
        rotary_config.head_dim = head_dim  # a config without head_dim (Qwen2) would take 2H / heads
        self.rotary = rotary_cls(rotary_config)
        self.norm = norm_cls(hidden, eps=eps)
        self.lm_head = torch.nn.Linear(hidden, spec.draft_vocab_size, bias=False)
        self.embed = torch.nn.Embedding(spec.vocab_size, hidden)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.format = "fp32"  # the weights' format while drafting (:meth:`quantized`)

    @classmethod
    def load(cls, spec: HeadSpec, layer_ids: Sequence[int], embeddings=None) -> "Eagle3Head":
        """Load ``spec``'s weights (checked first with :func:`check_head`).

        Args:
            spec: the head's config.
            layer_ids: the taps :func:`check_head` resolved.
            embeddings: the target's token embeddings ``[vocab, hidden]``, or a function returning them, used where
                the checkpoint has none.

        Raises:
            ModelSourceError: a weight missing or of the wrong shape, or no embeddings at all.
        """
        from safetensors.torch import load_file

        head = cls(spec, layer_ids)
        weights = {}
        for file in _weight_files(spec.path):
            weights.update(load_file(str(file)))
        for name in _TRAINING_ONLY:
            weights.pop(name, None)
        t2d = weights.pop("t2d", None)
        d2t = weights.pop("d2t", None)
        if spec.draft_vocab_size != spec.vocab_size:
            if d2t is None or tuple(d2t.shape) != (spec.draft_vocab_size,):
                raise ModelSourceError(f"The EAGLE-3 head at {spec.path} has a draft vocabulary of "
                                       f"{spec.draft_vocab_size} tokens but no d2t of that length.")
            weights["d2t"] = d2t.long()
            mapped = torch.arange(spec.draft_vocab_size) + weights["d2t"]
            if int(mapped.min()) < 0 or int(mapped.max()) >= spec.vocab_size or \
                    (t2d is not None and not bool(t2d.bool()[mapped].all())):
                raise ModelSourceError(f"The EAGLE-3 head at {spec.path} has a d2t that maps outside the target's "
                                       "vocabulary or disagrees with its t2d.")
        else:
            weights["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)
        if "embed_tokens.weight" in weights:
            weights["embed.weight"] = weights.pop("embed_tokens.weight")
        elif embeddings is not None:
            weights["embed.weight"] = (embeddings() if callable(embeddings) else embeddings).float()
        else:
            raise ModelSourceError(f"The EAGLE-3 head at {spec.path} has no embed_tokens.weight and the target's "
                                   "embeddings could not be read: load the target from a folder with safetensors.")
        if "fc_norm.0.weight" in weights and head.fc_norm is None or "input_norm.weight" in weights and \
                head.input_norm is None:
            raise ModelSourceError(f"The EAGLE-3 head at {spec.path} has input norms its config.json does not "
                                   "declare (norm_before_fc / fc_norm).")
        expected = dict(head.state_dict())
        missing = [k for k in expected if k not in weights and not k.startswith("rotary.")]
        unexpected = [k for k in weights if k not in expected]
        wrong = [k for k in weights if k in expected and tuple(weights[k].shape) != tuple(expected[k].shape)]
        if missing or unexpected or wrong:
            raise ModelSourceError(f"The EAGLE-3 head at {spec.path} does not have the weights its config.json "
                                   f"describes: missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape "
                                   f"{wrong[:5]}.")
        head.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        return head.eval()

    def quantized(self, fmt: str) -> "Eagle3Head":
        """This head in the drafting format ``fmt`` (:data:`HEAD_FORMATS`), converted in place; returns ``self``.

        Raises:
            SpeculativeConfigError: a format not in :data:`HEAD_FORMATS`, or ``"int8_sym"`` where this torch has no
                x86 or fbgemm quantized kernels.
        """
        import warnings

        from ..errors import SpeculativeConfigError

        if fmt not in HEAD_FORMATS:
            raise SpeculativeConfigError(f"An EAGLE-3 head drafts in {', '.join(map(repr, HEAD_FORMATS))}, not {fmt!r}.")
        if fmt == "fp32":
            return self
        engines = set(torch.backends.quantized.supported_engines)
        if not engines & {"x86", "fbgemm"}:
            raise SpeculativeConfigError(f"draft_low_bit={fmt!r}: this torch has no x86 or fbgemm quantized kernels "
                                         f"(it has {sorted(engines)}); use draft_low_bit='fp32'.")
        with warnings.catch_warnings():  # torch 2.13 marks torch.ao.quantization deprecated, in favour of torchao
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

            quantize_dynamic(self, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
        self.format = fmt
        return self

    def new_cache(self) -> "HeadCache":
        """An empty KV cache for :meth:`forward` (training; a head's weights serve any number of caches)."""
        return HeadCache()

    def new_draft_cache(self) -> "DraftCache":
        """An empty KV cache for :meth:`draft` (one drafting request)."""
        return DraftCache()

    # -- forward ----------------------------------------------------------------------------------------------------
    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """``fc`` over the taps: ``[n, len(layer_ids) * H]`` -> ``[n, H]`` (with the input norms the head declares)."""
        if self.input_norm is not None:
            taps = self.input_norm(taps)
        if self.fc_norm is not None:
            taps = torch.cat([norm(c) for norm, c in zip(self.fc_norm, taps.chunk(len(self.fc_norm), dim=-1))], -1)
        return self.fc(taps)

    def forward(self, tokens, hidden: torch.Tensor, cache: "HeadCache", positions: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append ``len(tokens)`` entries to ``cache``, at positions ``cache.length + 1`` on. Drafting calls it
        under ``torch.inference_mode()``; training passes ``positions`` and ``mask`` (its test-time-training steps).

        Args:
            tokens: target token ids, one per entry (a list, or a long tensor ``[n]``); training passes ``[B, n]``,
                ``B`` sequences of one length at once (the same positions and mask for every row).
            hidden: ``[n, H]`` (or ``[B, n, H]``) float32: :meth:`project`-ed taps, or the head's own outputs of the
                previous entries.
            cache: the request's :class:`HeadCache`.
            positions: ``[n]`` rotary positions (default ``cache.length + 1`` on).
            mask: ``[n, cache.length + n]`` additive attention mask (default causal).

        Returns:
            ``(logits, out)``: ``[n, draft_vocab_size]`` draft-vocabulary logits and ``[n, H]`` outputs to feed the
            next entries (``[B, n, ...]`` for ``[B, n]`` tokens).
        """
        ids = torch.as_tensor(tokens, dtype=torch.long)
        batched = ids.dim() == 2
        ids = ids.reshape(-1, ids.shape[-1])
        rows, n = ids.shape
        x = torch.cat([self.embed(ids), hidden.reshape(rows, n, -1).float()], dim=-1)
        past = cache.length
        positions = (torch.arange(past + 1, past + 1 + n) if positions is None else positions).reshape(1, n)
        cos_sin = self.rotary(x, positions)
        mask = (torch.full((n, past + n), float("-inf")).triu(past + 1) if mask is None else mask)[None, None]
        for i, layer in enumerate(self.layers):
            x = self._first(layer, x, cos_sin, mask, cache.kv) if i == 0 else layer(
                x, attention_mask=mask, position_ids=positions, past_key_values=cache.kv, position_embeddings=cos_sin)
        cache.length += n
        normed = self.norm(x)
        if self.spec.norm_output:  # the normed output is what the next entries are fed
            x = normed
        logits = self.lm_head(normed)
        return (logits, x) if batched else (logits[0], x[0])

    def _first(self, layer, x: torch.Tensor, cos_sin, mask, kv) -> torch.Tensor:
        """The first decoder layer on ``[embed ; hidden]`` (EAGLE-3's first layer: :meth:`_first_inputs`)."""
        residual, attn_in = self._first_inputs(layer, x)
        attended, _ = layer.self_attn(hidden_states=attn_in, position_embeddings=cos_sin, attention_mask=mask,
                                      past_key_values=kv)
        x = residual + attended
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _first_inputs(self, layer, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The first layer's residual and attention input from ``x`` = ``[embed ; hidden]``: the embedding through
        ``input_layernorm``, the hidden part through ``hidden_norm`` and kept as the residual (normed or not, by
        ``norm_before_residual``)."""
        embeds, hidden = x.split(x.shape[-1] // 2, dim=-1)
        normed = layer.hidden_norm(hidden)
        residual = normed if self.spec.norm_before_residual else hidden
        return residual, torch.cat([layer.input_layernorm(embeds), normed], dim=-1)

    def draft(self, tokens: Sequence[int], hidden: torch.Tensor,
              cache: DraftCache) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` of one sequence while drafting, written out without transformers' attention and rotary
        modules (a SmolLM2 head's int8 chain step took 0.75 ms this way against 1.12 ms through them:
        ``benchmarks/results/eagle3.md``): the same math, entries in a :class:`DraftCache`, rotary tables computed
        once per position range, ``lm_head`` of the last entry only. A layer's ``sliding_window`` is not applied
        (heads of the supported targets have none).

        Args:
            tokens: ``n`` target token ids, entries ``cache.length + 1 ..``.
            hidden: ``[n, H]`` float32, as for :meth:`forward`.
            cache: the request's :class:`DraftCache`.

        Returns:
            ``(logits, out)`` of the last entry only: ``[1, draft_vocab_size]`` and ``[1, H]``.
        """
        n, past = len(tokens), cache.length
        x = torch.cat([self.embed(torch.as_tensor(tokens, dtype=torch.long)), hidden.float()], dim=-1)[None]
        cos, sin = self._rotary(past + 1, past + 1 + n)
        mask = None if n == 1 else torch.full((n, past + n), float("-inf")).triu(past + 1)  # causal over the cache
        for i, layer in enumerate(self.layers):
            residual, attn_in = self._first_inputs(layer, x) if i == 0 else (x, layer.input_layernorm(x))
            x = residual + self._attend(layer.self_attn, i, attn_in, cos, sin, mask, cache)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.length += n
        x = x[:, -1]
        normed = self.norm(x)
        return self.lm_head(normed), (normed if self.spec.norm_output else x)

    def _rotary(self, start: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[1, end - start, head_dim]`` of rotary positions ``start..end-1``, from a table that
        grows by doubling (transformers' rotary embedding of the head, evaluated once per position)."""
        table = getattr(self, "_rotary_table", None)
        if table is None or table[0].shape[1] < end:
            positions = torch.arange(max(1024, 2 * end))[None]
            table = self._rotary_table = self.rotary(torch.zeros(1, dtype=torch.float32), positions)
        return table[0][:, start:end], table[1][:, start:end]

    @staticmethod
    def _attend(attn, layer: int, x: torch.Tensor, cos, sin, mask, cache: DraftCache) -> torch.Tensor:
        """One layer's self-attention of ``x`` ``[1, n, width]`` over the cache and itself (transformers'
        attention: projections, optional q/k norms, its model's ``apply_rotary_pos_emb``, grouped-query
        scaled-dot-product under ``mask`` ``[n, length + n]`` or ``None`` for one entry, ``o_proj``)."""
        n = x.shape[1]
        shape = (1, n, -1, attn.head_dim)
        q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = cache.put(layer, k, v)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling,
                                                               enable_gqa=keys.shape[1] != q.shape[1])
        return attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))

    def to_target(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits ``[n, draft_vocab_size]`` laid out on the target's vocabulary ``[n, vocab_size]``
        (``-inf`` where the draft vocabulary has no row)."""
        ids = torch.arange(self.spec.draft_vocab_size) + self.d2t
        out = torch.full((logits.shape[0], vocab_size), float("-inf"))
        out[:, ids] = logits.float()
        return out


def new_head(target_config, folder, draft_ids: Optional[Sequence[int]] = None, layer_ids: Optional[Sequence[int]] = None,
             speculative_tokens: int = 3, verifier: Optional[str] = None, seed: int = 0,
             embeddings: Optional[torch.Tensor] = None, force: bool = False, lm_head: Optional[torch.Tensor] = None,
             norm: Optional[torch.Tensor] = None) -> Path:
    """Write a randomly initialised head for a target (its transformers config) in the Speculators format, as
    ``speculators`` 0.9.0 saves one: one decoder layer of the target's architecture, ``norm_before_residual``,
    ``d2t`` / ``t2d`` where ``draft_ids`` (sorted target ids) reduce the vocabulary. The start of training, and a
    head for mechanics tests. Written to a temporary folder, then renamed to ``folder``.

    ``lm_head`` (the target's output matrix ``[vocab, hidden]``) and ``norm`` (its final norm's weight ``[hidden]``)
    start the head's readout as the target's own, restricted to the draft vocabulary (as speculators starts training
    from the verifier's ``lm_head``); otherwise they are random.

    Raises:
        ModelSourceError: a target architecture a head cannot be built from (see :data:`LAYER_TYPES`).
        OutputExistsError: ``folder`` exists and is not empty, and ``force`` is not set.
    """
    import os
    import shutil
    import tempfile

    from safetensors.torch import save_file

    model_type = getattr(target_config, "model_type", "llama")
    if model_type not in LAYER_TYPES:
        raise ModelSourceError(f"EAGLE-3 heads are built from {', '.join(LAYER_TYPES)} layers; this target is "
                               f"{model_type!r}.")
    layer = _one_layer(dict(target_config.to_dict(), model_type=model_type))
    for key in ("architectures", "_name_or_path", "transformers_version", "torch_dtype", "dtype", "auto_map"):
        layer.pop(key, None)
    vocab = int(target_config.vocab_size)
    draft_ids = sorted(int(i) for i in draft_ids) if draft_ids is not None else list(range(vocab))
    raw = {"speculators_model_type": MODEL_TYPE, "architectures": ["Eagle3DraftModel"],
           "transformer_layer_config": layer, "draft_vocab_size": len(draft_ids), "norm_before_residual": True,
           "norm_before_fc": False, "fc_norm": False, "norm_output": False, "target_hidden_size": None,
           "eagle_aux_hidden_state_layer_ids": list(layer_ids) if layer_ids is not None else None,
           "speculators_config": {"algorithm": MODEL_TYPE, "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": int(speculative_tokens)}],
                                  "verifier": {"name_or_path": verifier,
                                               "architectures": list(getattr(target_config, "architectures", None) or [])}}}
    folder = Path(str(folder))
    if folder.exists() and any(folder.iterdir()) and not force:
        raise OutputExistsError(f"{folder} exists and is not empty: choose another folder or pass force=True.")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=str(folder.parent)))
    try:
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        torch.manual_seed(seed)
        num_layers = int(target_config.num_hidden_layers)
        head = Eagle3Head(HeadSpec(tmp, _layer_config(layer), len(draft_ids),
                                   tuple(layer_ids) if layer_ids is not None else None, speculative_tokens, verifier,
                                   norm_before_residual=True),
                          layer_ids if layer_ids is not None else default_layer_ids(num_layers))
        state = {k: v.contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
        state.pop("d2t")
        embed = state.pop("embed.weight")
        state["embed_tokens.weight"] = (embeddings.float() if embeddings is not None else embed).contiguous()
        if lm_head is not None:
            state["lm_head.weight"] = lm_head.detach().float()[torch.tensor(draft_ids)].contiguous()
        if norm is not None:
            state["norm.weight"] = norm.detach().float().clone().contiguous()
        if len(draft_ids) != vocab:
            ids = torch.tensor(draft_ids, dtype=torch.long)
            state["d2t"] = ids - torch.arange(len(draft_ids))
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[ids] = True
            state["t2d"] = t2d
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _one_layer(layer: dict, layers: int = 1) -> dict:
    """A target's config (as a dict) made the config of ``layers`` decoder layers: its per-layer lists
    (``layer_types``, which Qwen2 and Qwen3 configs carry for every layer of the target, and which transformers
    requires to have one entry per layer) cut to the first ``layers``."""
    layer = dict(layer, num_hidden_layers=layers)
    if isinstance(layer.get("layer_types"), list):
        layer["layer_types"] = layer["layer_types"][:layers]
    return layer


def _layer_config(layer: dict):
    """``transformer_layer_config`` as a transformers config (a head written with the target's whole
    ``layer_types`` is read as one of its own layers)."""
    from transformers import AutoConfig

    layer = _one_layer(layer, int(layer.get("num_hidden_layers", 1)))
    fields = {k: v for k, v in layer.items() if k != "model_type"}
    return AutoConfig.for_model(layer["model_type"], **fields)
