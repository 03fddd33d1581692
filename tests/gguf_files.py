"""Small GGUF files written with the ``gguf`` package from tiny Hugging Face models and real tokenizers, laid out as
llama.cpp's converter lays them out (Llama's q/k rows permuted for its rope, Gemma's norm weights stored plus one),
for the GGUF path's default-tier tests."""

from pathlib import Path

import numpy as np
import torch

#: ``model_type`` -> (gguf architecture, HF layers' q/k permuted as llama.cpp's converter does, norms stored + 1).
LAYOUT = {"llama": ("llama", True, False), "qwen2": ("qwen2", False, False), "gemma3_text": ("gemma3", False, True)}


def tiny_model(model_type: str, vocab_size: int, seed: int = 0, **token_ids):
    """A random 2-layer model of ``model_type`` (a key of :data:`LAYOUT`) with ``vocab_size`` rows, its head sharpened
    so that greedy decoding is not a tie; fields a GGUF cannot carry keep transformers' defaults."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    extra = {"gemma3_text": dict(head_dim=16, sliding_window=512), "qwen2": dict(), "llama": dict()}[model_type]
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=2048, tie_word_embeddings=model_type == "gemma3_text",
                                  rms_norm_eps=1e-6, **token_ids, **extra)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norm weights, so a norm stored without Gemma's +1 would show
                p.copy_(1 + 0.1 * torch.randn_like(p)) if model_type != "gemma3_text" else p.normal_(0, 0.1)
        model.get_output_embeddings().weight.mul_(8)
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of Llama's q/k rows (rotate-half pairs to interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model, tokenizer: dict) -> Path:
    """Write ``model`` (from :func:`tiny_model`) and the ``tokenizer.ggml.*`` fields in ``tokenizer`` as an F32 GGUF.

    ``tokenizer`` keys: ``model``, ``pre``, ``tokens``, ``types``, and any of ``scores``, ``merges``, ``bos``,
    ``eos``, ``unk``, ``pad``, ``add_bos``, ``add_eos``, ``add_space_prefix``.
    """
    import gguf

    c = model.config
    arch, permute, plus_one = LAYOUT[c.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = getattr(c, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    if c.model_type == "gemma3_text":
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_sliding_window(c.sliding_window)
    writer.add_vocab_size(c.vocab_size)
    writer.add_tokenizer_model(tokenizer["model"])
    writer.add_tokenizer_pre(tokenizer.get("pre", "default"))
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["types"])
    if tokenizer.get("scores") is not None:
        writer.add_token_scores(tokenizer["scores"])
    if tokenizer.get("merges") is not None:
        writer.add_token_merges(tokenizer["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if tokenizer.get(key) is not None:
            add(tokenizer[key])
    for key, add in (("add_bos", writer.add_add_bos_token), ("add_eos", writer.add_add_eos_token),
                     ("add_space_prefix", writer.add_add_space_prefix)):
        if tokenizer.get(key) is not None:
            add(tokenizer[key])
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), c.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.float().numpy().copy()
        if permute and hf_name.endswith("q_proj.weight"):
            data = _permute(data, c.num_attention_heads)
        elif permute and hf_name.endswith("k_proj.weight"):
            data = _permute(data, c.num_key_value_heads)
        if plus_one and hf_name.endswith("norm.weight"):
            data = data + 1
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
