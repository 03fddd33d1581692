"""An EAGLE-3 head in the Speculators format, made into the draft IR openvino_genai's EAGLE-3 decoding loads: the
``genai-eagle3`` system of ``xpuspec bench``, the peer that drafts with the same head as ``xpuspec-spec:eagle3``.

openvino_genai (2026.4) runs EAGLE-3 on the CPU with a draft IR as optimum-intel exports one
(``LlamaEagle3ForCausalLM``, optimum-intel's ``model_patcher``): inputs ``input_ids`` and ``hidden_states``
(``[batch, seq, 3H]``), outputs ``logits`` over the draft vocabulary and ``d2t``, and the ``rt_info``
``eagle3_mode = True`` and ``hidden_layers_list``. What genai does with it (read in openvino.genai's
``eagle3_model_transforms.cpp``): it moves the head's ``fc`` MatMul into the target, taps the target's residual
stream at the output of each listed decoder layer, finds the draft's next hidden state by the name ``midlayer``, and
uses the target's embeddings.

So the conversion here:
- renames Speculators' ``layers.0.*`` to ``model.midlayer.*`` and prefixes the rest with ``model.``;
- lists the taps one lower: Speculators' layer id ``k`` is the input of decoder layer ``k`` (transformers'
  ``hidden_states[k]``), genai's ``N`` the output of layer ``N``;
- applies ``norm_before_residual`` (the flag xpuspec's and speculators' heads train with), which optimum-intel's
  class lacks, by its layer's own forward.

Limits (refused with :class:`~xpuspec.errors.ModelSourceError`): a LLaMA-type layer only (optimum-intel's class),
one layer, and no ``norm_before_fc`` / ``fc_norm`` / ``norm_output`` (genai moves a bare ``fc`` and taps before any
norm). The draft IR is float32, cached under ``genai-eagle3/`` in xpuspec's cache by the head's files.
"""

import json
import shutil
import types
from pathlib import Path
from typing import List, Tuple

import torch

from ..cache import cache_root, cached_folder, digest, folder_fingerprint
from ..errors import ModelSourceError


def draft_ir(head: str, target_hf: str, target_ir: str) -> Path:
    """The genai EAGLE-3 draft IR folder of ``head`` for the target whose transformers folder is ``target_hf`` and
    IR folder ``target_ir`` (its tokenizer IRs are copied in), built once.

    Raises:
        ModelSourceError: a head this conversion cannot express (see the module docstring).
    """
    head_dir = Path(head)
    final = cache_root() / "genai-eagle3" / digest(folder_fingerprint(head_dir), folder_fingerprint(Path(target_hf)))

    def build(tmp: Path) -> None:
        model, layers = _optimum_model(head_dir, Path(target_hf))
        _export(model, layers, tmp)
        for f in Path(target_ir).glob("openvino_*tokenizer.*"):
            shutil.copy(f, tmp / f.name)

    return cached_folder(final, build)


def _optimum_model(head: Path, target_hf: Path) -> Tuple[torch.nn.Module, List[int]]:
    from optimum.exporters.openvino.model_patcher import LlamaEagle3ForCausalLM
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    raw = json.loads((head / "config.json").read_text())
    layer = dict(raw["transformer_layer_config"])
    if layer.get("model_type", "llama") != "llama" or int(layer.get("num_hidden_layers", 1)) != 1:
        raise ModelSourceError(f"{head}: openvino_genai's EAGLE-3 draft is one LLaMA-type layer; this head's is "
                               f"{layer.get('num_hidden_layers', 1)} of {layer.get('model_type')!r}.")
    flags = [f for f in ("norm_before_fc", "fc_norm", "norm_output") if raw.get(f)]
    if flags:
        raise ModelSourceError(f"{head}: {', '.join(flags)} cannot be expressed in openvino_genai's EAGLE-3 draft "
                               "(it moves a bare fc into the target).")
    target = json.loads((target_hf / "config.json").read_text())
    settings = {k: v for k, v in layer.items() if k not in ("model_type", "architectures")}
    settings.update(num_hidden_layers=1, vocab_size=int(target["vocab_size"]), tie_word_embeddings=False,
                    architectures=["LlamaForCausalLMEagle3"])
    config = LlamaConfig(**settings)
    config.draft_vocab_size = int(raw["draft_vocab_size"])
    config.target_hidden_size = raw.get("target_hidden_size") or layer["hidden_size"]
    # a class of this module: optimum's export infers the library from the model class's module
    cls = type("Eagle3Draft", (LlamaEagle3ForCausalLM,), {"__module__": __name__})
    model = cls(config).eval()
    state = {}
    for f in sorted(head.glob("*.safetensors")):
        for name, value in load_file(str(f)).items():
            for old in ("layers.0.", "midlayer."):
                if name.startswith(old):
                    name = "midlayer." + name[len(old):]
            state["model." + name] = value.float() if value.is_floating_point() else value
    if "model.embed_tokens.weight" not in state:  # genai uses the target's embeddings anyway
        from ..speculative.eagle3 import target_embeddings

        state["model.embed_tokens.weight"] = target_embeddings(target_hf)
    if "model.d2t" not in state:
        state["model.d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["model.t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise ModelSourceError(f"{head}: weights that do not fit openvino_genai's EAGLE-3 draft: missing {missing}, "
                               f"unexpected {unexpected}.")
    if raw.get("norm_before_residual", False):
        model.model.midlayer.forward = types.MethodType(_norm_before_residual, model.model.midlayer)
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    n = int(target["num_hidden_layers"])
    return model, [int(i) - 1 for i in (ids if ids is not None else (2, n // 2, n - 3))]


def _norm_before_residual(self, input_emb, hidden_states, attention_mask=None, position_ids=None,
                          past_key_values=None, position_embeddings=None, output_attentions=False, use_cache=False):
    """The Speculators layer with ``norm_before_residual``: the residual is the normed hidden state."""
    hidden_states = self.hidden_norm(hidden_states)
    x = torch.cat((self.input_layernorm(input_emb), hidden_states), dim=-1)
    x, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=past_key_values, position_embeddings=position_embeddings,
                          use_cache=use_cache)
    x = hidden_states + x
    return x + self.mlp(self.post_attention_layernorm(x))


def _export(model, layers: List[int], out: Path) -> None:
    import openvino as ov
    from optimum.exporters.openvino import export_from_model

    export_from_model(model, out, task="text-generation-with-past", stateful=True)
    graph = ov.Core().read_model(out / "openvino_model.xml")
    graph.set_rt_info("True", ["eagle3_mode"])
    graph.set_rt_info(" ".join(map(str, layers)), ["hidden_layers_list"])
    ov.save_model(graph, out / "eagle3.xml", compress_to_fp16=False)
    del graph
    (out / "eagle3.xml").replace(out / "openvino_model.xml")
    (out / "eagle3.bin").replace(out / "openvino_model.bin")
