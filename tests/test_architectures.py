"""Architectures beyond Llama on OpenVINO: for each tiny random model (Gemma-2, Gemma-3 text, Phi-3, Mistral,
Qwen3; sliding windows shorter than the text), the exported IR computes the torch model's logits, greedy decoding in
fp32 gives transformers' own tokens, and greedy decoding in fp32, INT8, INT4 and fp16 (plain and prompt lookup) and on
the torch backend (plain and prompt lookup) agree token for token."""

import pytest
import torch

from xpuspec import AutoModelForCausalLM

from tiny import ARCHITECTURES, TINY_WINDOW, tiny_arch_model

#: A prompt that repeats (so prompt lookup drafts) and passes the sliding window.
PROMPT = torch.tensor([[1] + [3, 4, 5, 6, 7, 8] * 3])
NEW_TOKENS = 16
assert PROMPT.shape[1] > TINY_WINDOW


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request, tmp_path_factory):
    """``(model_type, folder, transformers model, its greedy ids)``."""
    from transformers import AutoModelForCausalLM as HF

    folder = tiny_arch_model(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    reference = HF.from_pretrained(folder).eval()
    with torch.no_grad():
        greedy = reference.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, min_new_tokens=NEW_TOKENS)
    return request.param, str(folder), reference, greedy


def _greedy(model, **kwargs):
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def test_openvino_export_matches_torch(arch):
    model_type, folder, reference, greedy = arch
    fp32 = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="openvino", load_in_low_bit="fp32")
    with torch.no_grad():
        want = reference(PROMPT).logits[0]
    got = fp32.runner.forward(PROMPT[0].tolist())
    fp32.runner.reset()
    assert (got - want).abs().max().item() < 1e-3, model_type  # measured 2e-6 to 6e-6
    assert _greedy(fp32).tolist() == greedy.tolist()
    lookup = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="openvino", load_in_low_bit="fp32",
                                                  speculative="prompt_lookup")
    assert _greedy(lookup).tolist() == greedy.tolist()


@pytest.mark.parametrize("fmt", ["int8_asym", "int4_asym", "fp16"])
def test_openvino_low_bit_plain_and_speculative_agree(arch, fmt):
    """Each format the README claims for these architectures loads, and prompt lookup gives plain's tokens (fp16:
    Gemma-2's soft-capping scalars reach the head's Multiply through a Convert)."""
    model_type, folder, _, greedy = arch
    model = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="openvino", load_in_low_bit=fmt)
    assert model.low_bit.format == fmt, model_type
    plain = _greedy(model)
    lookup = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="openvino",
                                                  load_in_low_bit=fmt, speculative="prompt_lookup")
    assert _greedy(lookup).tolist() == plain.tolist(), model_type
    assert _greedy(model, prompt_lookup_num_tokens=4).tolist() == plain.tolist(), model_type


def test_torch_backend_plain_and_speculative_match_transformers(arch):
    _, folder, _, greedy = arch
    plain = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="torch")
    assert _greedy(plain).tolist() == greedy.tolist()
    assert _greedy(plain, prompt_lookup_num_tokens=4).tolist() == greedy.tolist()
