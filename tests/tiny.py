"""Tiny random Llama models with a 16-token word-level tokenizer, for fast mechanics tests."""

from pathlib import Path

import torch

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(13)]


def tiny_model(folder: Path, seed: int, words=WORDS, layers: int = 2) -> Path:
    """Write a random Llama with ``layers`` decoder layers and its tokenizer to ``folder``; return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    return _save(model, folder, words)


#: Architectures beyond Llama built by :func:`tiny_arch_model` (transformers ``model_type``).
ARCHITECTURES = ("gemma2", "gemma3_text", "phi3", "mistral", "qwen3")
#: Sliding window of the tiny models that have one: shorter than a test's prompt plus new tokens, so it is used.
TINY_WINDOW = 8


def tiny_arch_model(folder: Path, model_type: str, seed: int = 0, layers: int = 2) -> Path:
    """Write a random model of ``model_type`` (one of :data:`ARCHITECTURES`, or ``"gemma"``) with the 16-token
    tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    extra = {
        "gemma2": dict(head_dim=8, sliding_window=TINY_WINDOW),
        "gemma3_text": dict(head_dim=8, sliding_window=TINY_WINDOW,
                            layer_types=["sliding_attention", "full_attention"] * (layers // 2) +
                            ["sliding_attention"] * (layers % 2)),
        "phi3": dict(),
        "mistral": dict(head_dim=8, sliding_window=TINY_WINDOW),
        "qwen3": dict(head_dim=8),
        "gemma": dict(head_dim=8),  # refused on OpenVINO under the pinned stack (not verified past its cap)
    }[model_type]
    config = AutoConfig.for_model(model_type, **common, **extra)
    model = AutoModelForCausalLM.from_config(config)
    return _save(model, folder, WORDS)


def _save(model, folder: Path, words) -> Path:
    """Sharpen ``model``'s head (init noise is near uniform), save it with a word-level tokenizer over ``words``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    model.save_pretrained(folder)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    return Path(folder)
