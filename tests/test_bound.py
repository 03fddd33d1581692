"""The speculation bound (xpuspec.bench.bound): the replay of the decode loop's rounds on known traces, the
oracle never slower than a schedule, and the replay's target passes against the real loop's on SmolLM2."""

import random

import pytest
import torch

from conftest import MODEL, PROMPTS
from xpuspec.bench.bound import (MAX_WIDTH, Policy, Trace, View, lookup_continuations, measure, oracle, pass_costs,
                                  policies, simulate, summarize)


def make_trace(target, pred, prob=None, lookup=None, verify=1.0, step=0.1, prefill=0.0):
    """A trace whose every target pass costs ``verify`` seconds, every draft step ``step``, the prefill ``prefill``."""
    view = View(list(pred), list(prob or [1.0] * len(target)), step, prefill)
    return Trace("code", 4, list(target), lookup or [[] for _ in range(len(target) + 1)],
                 [verify] * MAX_WIDTH, {"xpuspec": view, "genai": view})


def test_every_draft_right():
    # 8 decode tokens at k=3: two rounds of 3 accepted drafts and the target's token, each 3 steps + 1 pass.
    trace = make_trace(range(9), range(9))
    assert simulate(trace, Policy("k3", 3)) == (8, pytest.approx(2.6), 2)


def test_a_wrong_draft_ends_the_round():
    pred = list(range(9))
    pred[2] = 99  # the draft is wrong at new token 2
    # i=1: drafts 1, 2, 3 -> 1 accepted (i=3); i=3: 3, 4, 5 accepted (i=7); i=7: room for 1 draft (i=9).
    assert simulate(make_trace(range(9), pred), Policy("k3", 3)) == (8, pytest.approx(1.3 + 1.3 + 1.1), 3)


def test_a_confidence_threshold_stops_before_an_unsure_draft_and_pays_its_step():
    prob = [1.0] * 9
    prob[2] = 0.1
    trace = make_trace(range(9), range(9), prob=prob)
    # i=1: draft 1, then the step that scores position 2 (0.1 < 0.5) stops the chain: 2 steps, 1 draft (i=3);
    # i=3: 3 drafts (i=7); i=7: 1 draft (i=9).
    assert simulate(trace, Policy("t", 3, threshold=0.5)) == (8, pytest.approx(1.2 + 1.3 + 1.1), 3)
    assert simulate(trace, Policy("k3", 3))[1] == pytest.approx(2.6)  # without the threshold: as if all sure


def test_lookup_rounds_and_a_chain_ended_by_lookup():
    target = list(range(12))
    lookup = [[] for _ in range(13)]
    lookup[1] = [1, 2, 3, 77]  # 3 of 4 looked-up tokens right: a lookup round, one target pass
    lookup[6] = [6, 7, 8]  # after the model's first draft at i=5: the chain ends with these
    trace = make_trace(target, target, lookup=lookup, prefill=0.5)
    # i=1: lookup, 3 accepted (i=5); i=5: the draft's prefill, draft 5, then lookup 6, 7 (k=3 leaves room for 2),
    # all right, and the target's 8 (i=9); i=9: room for 2 drafts (i=12, the end).
    assert simulate(trace, Policy("k3", 3)) == (11, pytest.approx(1.0 + 0.5 + 1.1 + 1.2), 3)
    assert simulate(trace, Policy("k3", 3, lookup=False))[2] == 3  # 1..4, 5..8, 9..11: as many passes, more steps


def test_the_drafts_prefill_is_paid_only_where_the_draft_drafts():
    target = [1, 2, 3, 4, 5, 6]
    lookup = [[], target[1:], [], [], [], [], []]  # one lookup round takes every token
    trace = make_trace(target, [0] * 6, lookup=lookup, prefill=9.0)
    assert simulate(trace, Policy("k3", 3)) == (5, pytest.approx(1.0), 1)
    assert oracle(trace) == (5, pytest.approx(1.0))


def test_costs_are_made_non_decreasing_in_width():
    trace = make_trace(range(4), range(4))
    trace.verify_s = [0.5, 0.3, 0.4, 0.2] + [0.9] * (MAX_WIDTH - 4)
    assert pass_costs(trace)[:5] == [0.2, 0.2, 0.2, 0.2, 0.9]


def random_trace(rng):
    """A trace over a 2-token alphabet with prompt lookup's real 3-gram continuations, costs in any order."""
    n = rng.randint(2, 30)
    prompt = [rng.randrange(2) for _ in range(rng.randint(3, 12))]
    target = [rng.randrange(2) for _ in range(n)]
    pred = [t if rng.random() < 0.7 else 9 for t in target]
    continuations = lookup_continuations(prompt, target, 3, 10)
    trace = make_trace(target, pred, prob=[rng.random() for _ in range(n)], lookup=continuations,
                       step=rng.uniform(0.05, 0.5), prefill=rng.uniform(0.0, 2.0))
    trace.verify_s = [rng.uniform(0.3, 1.5) for _ in range(MAX_WIDTH)]
    return trace


def test_the_oracle_is_never_slower_than_a_schedule():
    # A review's counter-example (cutting a lookup short pays; the oracle took only whole matches), then random ones.
    target, pred = [0, 0, 1, 1, 0, 0, 1, 1, 0], [0, 0, 9, 1, 9, 0, 1, 1, 9]
    lookup = [[], [], [1, 1, 0, 0], [1, 0, 0, 1], [0, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 0, 1, 1, 0, 0],
              [1, 0, 0, 1, 1, 0, 0, 1], [0, 0, 1, 1, 0, 0, 1, 1], [0, 1, 1, 0, 0, 1, 1, 0]]
    first = make_trace(target, pred, lookup=lookup, step=0.42)
    first.verify_s = [.52, .55, .56, .57, .65, .72, .90, 1.06, 1.10, 1.12, 1.18, 1.32]
    rng = random.Random(0)
    for trace in [first] + [random_trace(rng) for _ in range(3000)]:
        fastest = oracle(trace)[1]
        for policy in policies():
            if policy.view == "xpuspec":
                assert fastest <= simulate(trace, policy)[1] + 1e-9, (policy, trace)
        assert fastest <= (len(trace.target) - 1) * pass_costs(trace)[0] + 1e-9  # plain decoding
    rows = summarize([first])
    assert rows[0]["vs_genai"] == 1.0 and rows[-1]["schedule"].startswith("oracle")
    assert rows[-1]["tokens_per_s"]["all"] >= max(r["tokens_per_s"]["all"] for r in rows[:-1])


def test_the_oracle_decodes_long_outputs():
    trace = make_trace(list(range(3000)), list(range(3000)))  # no recursion: 3000 tokens
    assert oracle(trace) == (2999, pytest.approx(2999 / 12 * 1.0 + 2999 * 11 / 12 * 0.1, rel=0.01))


def test_replay_makes_the_real_loops_target_passes(smollm2_path, tokenizer):
    """The replay of a constant k=3 draft without lookup against the decode loop running it (cost model off):
    the same target passes per prompt (9, 12, 11 and 14 both ways on a 2-core AMD EPYC with AVX-512), within one
    where the draft's incremental steps and its one pass over the output could part at a near-tie on another CPU."""
    from xpuspec import AutoModelForCausalLM, SpeculativeConfig

    common = dict(draft=MODEL, draft_low_bit="int4_sym", draft_context_length=0)
    measured = AutoModelForCausalLM.from_pretrained(MODEL, load_in_low_bit="int8_asym",
                                                    speculative=SpeculativeConfig(mode="hybrid", **common))
    real = AutoModelForCausalLM.from_pretrained(MODEL, load_in_low_bit="int8_asym", speculative=SpeculativeConfig(
        mode="draft", cost_model=False, num_assistant_tokens=3, num_assistant_tokens_schedule="constant", **common))
    replayed, ran = [], []
    for text in PROMPTS:
        ids = tokenizer(text).input_ids
        trace = measure(measured, measured.draft_model.runner, "code", ids, 32)
        out = real.generate(input_ids=torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out[0, len(ids):].tolist() == trace.target
        replayed.append(simulate(trace, Policy("k3", 3, lookup=False))[2])
        ran.append(real.last_generate_stats.target_forwards - 1)  # less the prefill
    assert all(abs(a - b) <= 1 for a, b in zip(replayed, ran)), (replayed, ran)
    assert sum(replayed) >= 4 * 8  # 31 decode tokens at most 4 a pass: the drafts were not all free


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "1"], "--max-new-tokens must be at least 2"),
    (["--prompts", "poems"], "Unknown prompt set 'poems'"),
    (["--json", "/no/such/folder/bound.json"], "a folder that does not exist"),
])
def test_bound_cli_refuses_bad_input_before_loading(args, message, capsys):
    from xpuspec.cli import main

    assert main(["bound", "--model", "no-such-model", "--draft", "no-such-draft", *args]) == 2  # no model looked up
    assert message in capsys.readouterr().err
