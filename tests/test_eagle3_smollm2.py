"""EAGLE-3 on SmolLM2 with a head that ``train_head`` trains in this module (a few minutes on one torch thread, on
prompts of ``benchmarks/eagle3_corpus.py`` continued by the target): the head drafts what the target says, above
any rate a random head reaches, and the output is the plain greedy output alone, in a batch and through the server.

Slow tier: the training is minutes of work.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import MODEL

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: Prompts of kinds the head was not trained on (news, a story opening, code), none from its corpus.
PROMPTS = ["Summarize the following news report in two sentences.\n\nThe city council voted on Tuesday to extend "
           "the tram line to the airport. Work starts next spring and should take three years.\n\nSummary:",
           "Once upon a time, in a small village by the sea,",
           "def is_leap_year(year):\n    "]
#: Held-out acceptance of the first draft position that a head trained this briefly must pass. A random head's is
#: about 1 / draft_vocab_size (0.0002 here); this head's was 0.18 when the test was written (0.37 after 4000 steps
#: on 827 prompts: benchmarks/results/eagle3.md).
FIRST_POSITION_FLOOR = 0.1


def _corpus(count: int):
    spec = importlib.util.spec_from_file_location("eagle3_corpus", ROOT / "benchmarks" / "eagle3_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prompts(seed=1, count=count)


@pytest.fixture(scope="module")
def trained(smollm2_path, tmp_path_factory):
    """A head trained for 300 steps on 96 prompts continued by the target for up to 96 tokens: (folder, report)."""
    from xpuspec.speculative.eagle3_train import train_head

    root = tmp_path_factory.mktemp("eagle3")
    data = root / "corpus.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _corpus(96)))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = train_head(MODEL, [data], root / "head", steps=300, seq_len=224, lr=1e-3, draft_vocab_size=4096,
                            checkpoint_every=300, continue_tokens=96, progress=False)
    finally:
        torch.set_num_threads(before)
    return root / "head", report


def test_a_trained_head_drafts_what_the_target_says(trained):
    _, report = trained
    assert report.steps == 300
    assert report.acceptance[0] > FIRST_POSITION_FLOOR, report


def test_greedy_identity_alone_and_in_a_batch(trained, ov_int8, tokenizer):
    """The head drafts 3 tokens every round (the cost model off: with it on, this weak a head is soon left out);
    the output is the plain greedy output, and the target accepts drafts at a rate no random head reaches."""
    from xpuspec import AutoModelForCausalLM, SpeculativeConfig

    head, _ = trained
    spec = SpeculativeConfig(mode="eagle3", draft=str(head), cost_model=False, num_assistant_tokens=3,
                             num_assistant_tokens_schedule="constant")  # drafting every round, paying or not
    model = AutoModelForCausalLM.from_pretrained(MODEL, load_in_low_bit="int8_asym", speculative=spec)
    drafted = accepted = 0
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        want = ov_int8.generate(ids, max_new_tokens=32, do_sample=False)
        assert model.generate(ids, max_new_tokens=32, do_sample=False).tolist() == want.tolist(), text
        drafted += model.last_generate_stats.drafted_tokens
        accepted += model.last_generate_stats.accepted_tokens
    assert drafted >= 3 * 3 * 8 and accepted / drafted > 0.02, (drafted, accepted)  # random: about 0.0002
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    want = ov_int8.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    got = model.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert got.tolist() == want.tolist()
    assert model.last_generate_stats.accepted_tokens > 0


@pytest.mark.parametrize("target_format,head_format", [("int4_asym", "fp32"), ("fp32", "int8_sym")])
def test_greedy_identity_on_other_formats(trained, tokenizer, target_format, head_format):
    """The same identity with the target in INT4 and in float32, and the head in each of its drafting formats: the
    taps of every format feed the head, and whatever the head drafts, the output is the format's plain greedy
    output."""
    from xpuspec import AutoModelForCausalLM, SpeculativeConfig

    head, _ = trained
    spec = SpeculativeConfig(mode="eagle3", draft=str(head), cost_model=False, num_assistant_tokens=3,
                             num_assistant_tokens_schedule="constant", draft_low_bit=head_format)
    model = AutoModelForCausalLM.from_pretrained(MODEL, load_in_low_bit=target_format, speculative=spec)
    assert model.eagle3_head.format == head_format
    plain = AutoModelForCausalLM.from_pretrained(MODEL, load_in_low_bit=target_format)
    accepted = 0
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        want = plain.generate(ids, max_new_tokens=32, do_sample=False)
        assert model.generate(ids, max_new_tokens=32, do_sample=False).tolist() == want.tolist(), text
        accepted += model.last_generate_stats.accepted_tokens
    assert accepted > 0


def test_the_server_with_a_head_answers_the_plain_greedy_text(trained, ov_int8, tokenizer):
    """``xpuspec serve --speculative HEAD``: the head is loaded (``/health``) and every answer is the plain greedy
    text. (The server keeps the cost model on, which may leave this weak a head out of many rounds; the test above
    holds the drafting.)"""
    from test_serve import Server

    head, _ = trained
    server = Server("--speculative", str(head))
    try:
        assert server.health()["speculative"] == "eagle3", server.health()
        client = server.client()
        for text in PROMPTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            want = tokenizer.decode(ov_int8.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:],
                                    skip_special_tokens=True)  # the server's text ends before the end of sequence
            got = client.completions.create(model=MODEL, prompt=text, max_tokens=24, temperature=0)
            assert got.choices[0].text == want, text
    finally:
        server.stop()
