"""Prefix caching (xpuspec/kv_blocks.py, the OpenVINO paged runner, the engine): the block book's rules on their
own, then on real SmolLM2 that a shared block survives a neighbour's rollback and that output is identical with the
cache on and off (plain, prompt lookup, suffix, a draft model, a batch of sessions, a cache that evicts)."""

import pytest
import torch

from xpuspec import AutoModelForCausalLM, SpeculativeConfig
from xpuspec.errors import KVBudgetError
from xpuspec.kv_blocks import BlockPool, block_hashes

from conftest import MODEL, PROMPTS

SYSTEM = ("You are a careful assistant. Answer in plain words, keep to the facts, and say when you do not know. " * 5)


# -- the block book --------------------------------------------------------------------------------------------------
def _pool(block_size=4):
    grown = []

    def grow(blocks):
        grown.append(blocks)
        return blocks

    pool = BlockPool(block_size, grow)
    pool.set_prefix_caching(True)
    return pool, grown


def test_a_block_key_names_every_token_before_it():
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2  # the last two tokens fill no block
    assert block_hashes(list(range(8)), 4) == a
    changed_first = block_hashes([99] + list(range(1, 10)), 4)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # same tokens in block 2, another prefix
    assert block_hashes([0, 1, 2, 3, 4, 5, 6, 99], 4) == [a[0], block_hashes([0, 1, 2, 3, 4, 5, 6, 99], 4)[1]]


def test_published_blocks_are_matched_held_and_evicted_least_recent_first():
    pool, grown = _pool()
    first = pool.take(3, str)
    pool.publish(first, list(range(12)))
    assert pool.match(list(range(10))) == first[:2]  # two whole blocks, the third is not all there
    assert (pool.queries, pool.hits) == (10, 8)
    assert all(pool.shared(b) for b in first)  # cached: copied before any write
    pool.release(first)  # the first sequence leaves: block 3 idle, blocks 1-2 still held by the second
    assert pool.in_use == 2 and pool.cached == 3
    pool.release(first[:2])
    assert pool.in_use == 0 and pool.cached == 3
    other = pool.take(pool.blocks, str)  # every block: the free ones, then the idle ones, oldest first
    assert pool.cached == 0 and sorted(other) == sorted(set(other)) and set(first) <= set(other)
    assert pool.match(list(range(12))) == []


def test_only_accepted_full_blocks_are_published_and_a_second_copy_stays_private():
    pool, _ = _pool()
    a, b = pool.take(2, str), pool.take(2, str)
    pool.publish(a, list(range(6)))  # one full block
    pool.publish(b, list(range(8)))  # block 1's prefix is cached already in a[0]: b[0] stays private
    assert pool.cached == 2 and not pool.shared(b[0]) and pool.shared(b[1])
    pool.release(b)
    assert pool.in_use == 2 and pool.cached == 2


def test_the_budget_counts_held_blocks_not_idle_cached_ones():
    pool, _ = _pool()
    pool.budget = 3
    blocks = pool.take(3, str)
    pool.publish(blocks, list(range(12)))
    with pytest.raises(KVBudgetError):
        pool.take(1, lambda n: f"needs {n}")
    pool.release(blocks)
    assert len(pool.take(3, str)) == 3  # the idle cached blocks are evicted for a new request


def test_turning_it_off_empties_the_cache_and_matches_nothing():
    pool, _ = _pool()
    blocks = pool.take(2, str)
    pool.publish(blocks, list(range(8)))
    pool.release(blocks)
    pool.set_prefix_caching(False)
    assert pool.cached == 0 and pool.match(list(range(8))) == [] and pool.in_use == 0


# -- on SmolLM2 ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(smollm2_path):
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym")
    model.runner.set_prefix_caching(True)
    return model.runner


def _prompt(tokenizer, text=PROMPTS[0], system=SYSTEM):
    return tokenizer(system + text).input_ids


def test_a_shared_block_survives_a_neighbours_rollback(runner, tokenizer):
    """B starts on A's cached blocks, rolls back into them and writes other tokens there: A's next logits stay what
    a sequence that never shared computes. Without copy on write B would overwrite A's keys and values."""
    prompt = _prompt(tokenizer)
    size = runner.block_size
    assert len(prompt) > 3 * size
    a = runner.open_sequence()
    a.forward(prompt, logits_to_keep=1)
    a.share(prompt)
    b = runner.open_sequence()
    held = b.reuse_prefix(prompt)
    assert held == (len(prompt) - 1) // size * size and b.blocks == a.blocks[:held // size]
    b.rollback(size + 3)  # into the last shared block and the one before it
    b.forward([7] * (size + 10))
    assert b.blocks[:held // size - 2] == a.blocks[:held // size - 2]  # untouched blocks still shared
    assert b.blocks[held // size - 2] != a.blocks[held // size - 2]  # the written ones are copies
    next_token = [int(prompt[-1])]
    got = a.forward(next_token)
    runner.set_prefix_caching(False)
    try:
        fresh = runner.open_sequence()
        fresh.forward(prompt, logits_to_keep=1)
        want = fresh.forward(next_token)
    finally:
        runner.set_prefix_caching(True)
    assert torch.equal(got, want)
    for seq in (a, b, fresh):
        seq.close()


def _session(model, tokenizer, turns=3, max_new_tokens=24, system=SYSTEM):
    """A chat-like session: each turn resends the whole conversation so far; returns each turn's new tokens and
    cached prompt tokens."""
    ids, out = _prompt(tokenizer, system=system), []
    for turn in range(turns):
        new = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids):]
        out.append((new.tolist(), model.last_generate_stats.cached_tokens))
        ids = ids + new.tolist() + tokenizer(" Next: " + PROMPTS[(turn + 1) % len(PROMPTS)]).input_ids
    return out


#: A draft model (an INT4 copy) that drafts 4 tokens every round, kept loaded (the policy would leave SmolLM2's out),
#: and sees the whole context (with a window of the last tokens, each turn's draft sequence starts elsewhere).
DRAFT_MODEL = SpeculativeConfig(mode="self", num_assistant_tokens=4, cost_model=False, release_draft_after=0,
                                draft_context_length=0)


@pytest.mark.parametrize("speculative", [None, "prompt_lookup", "suffix", pytest.param(DRAFT_MODEL, id="draft")])
def test_a_session_gives_the_same_tokens_with_the_cache_on_and_off(smollm2_path, tokenizer, speculative):
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                 speculative=speculative)
    off = _session(model, tokenizer)
    model.set_prefix_caching(True)
    on = _session(model, tokenizer)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert [c for _, c in off] == [0, 0, 0]
    assert on[0][1] == 0 and all(c > len(SYSTEM) // 8 for _, c in on[1:])  # later turns start on the cache
    if speculative is DRAFT_MODEL:  # the draft model caches its own prefixes
        assert model.last_generate_stats.drafted_tokens > 0 and model.draft_model.runner.prefix_cache.hits > 0
    model.close()


def test_a_batch_of_sessions_sharing_a_system_prompt_gives_the_same_tokens(smollm2_path, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                 speculative="prompt_lookup")
    tokenizer.padding_side = "left"
    texts = [SYSTEM + PROMPTS[i % len(PROMPTS)] + " (%d)" % i for i in range(8)]
    batch = tokenizer(texts, return_tensors="pt", padding=True)

    def run():
        return model.generate(**batch, max_new_tokens=20, do_sample=False).tolist()

    off = run()
    model.set_prefix_caching(True)
    _session(model, tokenizer, turns=1)  # the system prompt's blocks are cached
    on = run()
    assert on == off and all(r.cached_tokens > 0 for r in model.last_generate_stats.rows)
    model.close()


def test_a_cache_that_evicts_mid_session_gives_the_same_tokens(smollm2_path, tokenizer):
    """A KV budget of little more than one session's blocks: a second session evicts the first one's."""
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                 speculative="prompt_lookup")
    runner = model.runner
    budget = runner.blocks_for(len(_prompt(tokenizer)) + 4 * 40) + 2
    runner.set_kv_budget(budget * runner.block_bytes)
    other = "Reply in French, in short sentences, and give one example for every rule you state. " * 5
    plain = _session(model, tokenizer, turns=4), _session(model, tokenizer, turns=4, system=other)
    model.set_prefix_caching(True)
    first = _session(model, tokenizer, turns=4)
    second = _session(model, tokenizer, turns=4, system=other)
    again = _session(model, tokenizer, turns=4)
    assert [[t for t, _ in s] for s in (first, second, again)] == [[t for t, _ in s] for s in (*plain, plain[0])]
    assert runner.prefix_cache.cached <= budget
    assert runner.prefix_cache.evicted > 0 and again[0][1] > 0  # the tail went, the system prompt's blocks stayed
    model.close()


def test_prefix_caching_on_a_runner_without_paged_kv_blocks_is_refused(smollm2_path):
    with pytest.raises(ValueError, match="paged KV cache"):
        AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", backend="torch", enable_prefix_caching=True)
