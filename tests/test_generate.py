"""generate() on the real SmolLM2: greedy identity with transformers, low-bit agreement,
transformers' keyword arguments and return types, and clear errors on bad input."""

import pytest
import torch
from transformers import TextIteratorStreamer
from transformers.generation import GenerateDecoderOnlyOutput

from xpuspec import AutoModelForCausalLM

from conftest import MODEL, PROMPTS

#: Measured with openvino 2026.4.1: int8_asym matches transformers fp32 greedy on all 32 tokens for 1 of
#: the 4 prompts on a 2-core AMD EPYC (the others diverge at near-ties: top-2 logit margins of the fp32
#: model 0.05, 0.15 and 0.14), for 2 of 4 on a 2-core Xeon with AMX (dynamic quantization on). At least 1.
INT8_FULL_MATCHES = 1
NEAR_TIE = 0.5


def _greedy(model, tokenizer, prompt, **kwargs):
    ids = tokenizer(prompt, return_tensors="pt")
    return model.generate(**ids, max_new_tokens=32, do_sample=False, **kwargs)[0].tolist()


def test_openvino_fp32_is_token_identical_to_transformers(ov_fp32, tokenizer, hf_greedy):
    for prompt in PROMPTS:
        assert _greedy(ov_fp32, tokenizer, prompt) == hf_greedy[prompt], prompt


def test_torch_backend_is_token_identical_to_transformers(tokenizer, hf_greedy):
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", backend="torch")
    assert model.backend_name == "torch"
    for prompt in PROMPTS:
        assert _greedy(model, tokenizer, prompt) == hf_greedy[prompt], prompt


def test_int8_asym_greedy_matches_transformers_fp32(ov_int8, tokenizer, hf_model, hf_greedy):
    full = 0
    for prompt in PROMPTS:
        ours, ref = _greedy(ov_int8, tokenizer, prompt), hf_greedy[prompt]
        if ours == ref:
            full += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        with torch.no_grad():
            top2 = hf_model(torch.tensor([ref[:first]])).logits[0, -1].topk(2).values
        assert float(top2[0] - top2[1]) < NEAR_TIE, f"{prompt!r}: int8 diverged where fp32 was confident"
    assert full >= INT8_FULL_MATCHES


def test_int4_asym_is_fluent_and_agrees_on_first_tokens(smollm2_path, tokenizer, hf_model, hf_greedy):
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_4bit=True)
    assert model.low_bit.format == "int4_asym" and model.low_bit.group_size == 64  # fitted from 128
    agree = 0
    for prompt in PROMPTS:
        ours, ref = _greedy(model, tokenizer, prompt), hf_greedy[prompt]
        n = len(tokenizer(prompt).input_ids)
        agree += ours[n] == ref[n]
        # Fluency: the fp32 model finds the int4 continuation about as likely as its own text.
        with torch.no_grad():
            loss = hf_model(torch.tensor([ours]), labels=torch.tensor([[-100] * n + ours[n:]])).loss
        assert loss.exp() < 8.0, f"{prompt!r}: int4 text has fp32 perplexity {loss.exp():.1f}"
    assert agree >= 3


def test_call_returns_transformers_logits(ov_fp32, hf_model, tokenizer):
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    ours = ov_fp32(ids).logits
    with torch.no_grad():
        ref = hf_model(ids).logits
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert torch.allclose(ours, ref, atol=2e-3)
    with torch.no_grad():
        ref_loss = hf_model(ids, labels=ids).loss
    assert abs(float(ov_fp32(ids, labels=ids).loss) - float(ref_loss)) < 1e-4


def test_return_dict_scores_and_streamer(ov_fp32, tokenizer, hf_greedy):
    ids = tokenizer(PROMPTS[1], return_tensors="pt")
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    out = ov_fp32.generate(**ids, max_new_tokens=32, return_dict_in_generate=True, output_scores=True,
                           output_logits=True, streamer=streamer)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert out.sequences[0].tolist() == hf_greedy[PROMPTS[1]]
    assert len(out.scores) == len(out.logits) == 32 and out.scores[0].shape == (1, ov_fp32.runner.vocab_size)
    n = ids.input_ids.shape[1]
    assert "".join(streamer) == tokenizer.decode(out.sequences[0, n:])
    stats = ov_fp32.last_generate_stats
    # one pass per token, but for the free guesses accepted in steps run 2 wide (xpuspec.decode)
    assert stats.new_tokens == 32 and stats.prompt_tokens == n
    assert stats.target_forwards + stats.guesses_accepted in (32, 33)


def test_eos_stops_and_min_new_tokens_holds(ov_fp32, tokenizer, hf_greedy):
    ids = tokenizer(PROMPTS[0], return_tensors="pt")
    n = ids.input_ids.shape[1]
    ref = hf_greedy[PROMPTS[0]]
    eos = ref[n + 3]  # the 4th greedy token becomes "end of sequence"
    out = ov_fp32.generate(**ids, max_new_tokens=32, eos_token_id=eos)[0].tolist()
    stop = ref[n:].index(eos)
    assert out == ref[: n + stop + 1]
    longer = ov_fp32.generate(**ids, max_new_tokens=32, eos_token_id=eos, min_new_tokens=stop + 5)[0].tolist()
    assert len(longer) > n + stop + 1 and eos not in longer[n: n + stop + 5]


def test_sampling_processors_match_transformers(ov_fp32, hf_model, tokenizer):
    ids = tokenizer(PROMPTS[3], return_tensors="pt")
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.3)
    torch.manual_seed(0)
    ours = ov_fp32.generate(**ids, **kwargs)[0].tolist()
    torch.manual_seed(0)
    ref = hf_model.generate(**ids, **kwargs)[0].tolist()
    assert ours == ref
    greedy_pen = dict(max_new_tokens=24, do_sample=False, repetition_penalty=1.3)
    assert ov_fp32.generate(**ids, **greedy_pen)[0].tolist() == hf_model.generate(**ids, **greedy_pen)[0].tolist()


def test_transformers_defaults_hold(ov_fp32, hf_model, tokenizer):
    """No length given: transformers' max_length of 20; do_sample without a temperature works."""
    ids = tokenizer(PROMPTS[0], return_tensors="pt")
    assert ov_fp32.generate(**ids).tolist() == hf_model.generate(**ids, do_sample=False).tolist()
    assert ov_fp32.generate(**ids, do_sample=True, max_new_tokens=3).shape[1] == ids.input_ids.shape[1] + 3


def test_model_cannot_draft_for_itself(ov_fp32, tokenizer):
    ids = tokenizer(PROMPTS[0], return_tensors="pt")
    with pytest.raises(ValueError, match="share one KV cache"):
        ov_fp32.generate(**ids, max_new_tokens=4, assistant_model=ov_fp32)


@pytest.mark.parametrize("kwargs, error, phrase", [
    (dict(max_new_tokens=1.5), TypeError, "max_new_tokens must be an integer"),
    (dict(num_beams=2), NotImplementedError, "Beam search"),
    (dict(no_repeat_ngram_size=3), NotImplementedError, "no_repeat_ngram_size"),
    (dict(max_new_tokenz=3), TypeError, "max_new_tokenz"),
])
def test_bad_generation_arguments(ov_fp32, tokenizer, kwargs, error, phrase):
    ids = tokenizer(PROMPTS[0], return_tensors="pt")
    with pytest.raises(error, match=phrase):
        ov_fp32.generate(**ids, **kwargs)
