"""The core invariant on a real target/draft pair of different sizes: Qwen2.5-Coder-1.5B-Instruct
(int8_asym) verifying drafts of Qwen2.5-Coder-0.5B-Instruct (int4_sym) gives, on 8 prompts x 64
tokens, exactly the target's own greedy output. Slow: two pulls and two IR builds on a cold cache."""

import pytest

from xpuspec import AutoModelForCausalLM, AutoTokenizer, SpeculativeConfig
from xpuspec.speculative.audit import IDENTICAL, audit

from test_speculative_greedy import ALWAYS, PROMPTS_8

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


@pytest.mark.slow
def test_qwen_1_5b_target_with_0_5b_draft_is_identical():
    spec = SpeculativeConfig(mode="draft", draft=DRAFT, draft_low_bit="int4_sym", **ALWAYS)
    target = AutoModelForCausalLM.from_pretrained(TARGET, device="cpu", load_in_low_bit="int8_asym", speculative=spec)
    assert len(target.draft_model.runner.head_tokens) == 32768  # by default the draft's head scores the most frequent
    assert target.runner.head_tokens is None  # and the target's scores every token
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    results = [audit(target, tokenizer(p, return_tensors="pt").input_ids, max_new_tokens=64) for p in PROMPTS_8]
    assert [r.status for r in results] == [IDENTICAL] * len(PROMPTS_8), [(r.first_difference, r.margin) for r in results]
    drafted = sum(r.stats.drafted_tokens for r in results)
    assert drafted > 200 and sum(r.stats.accepted_tokens for r in results) / drafted > 0.4
