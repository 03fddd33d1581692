"""The speculation bound (xpuspec.bench.bound): the replay of the decode loop's rounds on known traces, the
oracle never slower than a schedule, and the replay's target passes against the real loop's on SmolLM2."""

import random

import pytest
import torch

from conftest import MODEL, PROMPTS
from xpuspec.bench.bound import MAX_WIDTH, Policy, Trace, View, measure, oracle, policies, simulate, summarize


def make_trace(target, pred, prob=None, lookup=None, verify=1.0, step=0.1):
    """A trace whose every target pass costs ``verify`` seconds and every draft step ``step``, with no prefill."""
    view = View(list(pred), list(prob or [1.0] * len(target)), step, 0.0)
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
    lookup[1] = [1, 2, 3, 77]  # 3 of 4 looked-up tokens right: a lookup round (pass + the draft's catch-up step)
    lookup[6] = [6, 7, 8]  # after the model's first draft at i=5: the chain ends with these
    trace = make_trace(target, target, lookup=lookup)
    # i=1: lookup, 3 accepted (i=5); i=5: draft 5, then lookup 6, 7 (k=3 leaves room for 2), all right, and the
    # target's 8 (i=9); i=9: room for 2 drafts (i=12, the end).
    assert simulate(trace, Policy("k3", 3)) == (11, pytest.approx(1.1 + 1.1 + 1.2), 3)
    assert simulate(trace, Policy("k3", 3, lookup=False))[2] == 3  # 1..4, 5..8, 9..11: as many passes, more steps


def test_the_oracle_is_never_slower_than_a_schedule():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(2, 40)
        target = [rng.randrange(5) for _ in range(n)]
        pred = [t if rng.random() < 0.7 else 9 for t in target]
        prob = [rng.random() for _ in range(n)]
        context = [rng.randrange(5) for _ in range(20)]
        lookup = [(context[i % 20:i % 20 + rng.randint(0, 10)] if rng.random() < 0.3 else []) for i in range(n + 1)]
        trace = make_trace(target, pred, prob=prob, lookup=lookup, step=rng.uniform(0.05, 0.5))
        trace.verify_s = sorted(rng.uniform(0.5, 2.0) for _ in range(MAX_WIDTH))
        best = oracle(trace)
        for policy in policies():
            if policy.view == "xpuspec":
                assert best[1] <= simulate(trace, policy)[1] + 1e-9, policy
    rows = summarize([trace])
    assert rows[0]["vs_genai"] == 1.0 and rows[-1]["schedule"].startswith("oracle")
    hybrid = [r["tokens_per_s"]["all"] for r in rows if r["schedule"].startswith("hybrid")]
    assert rows[-1]["tokens_per_s"]["all"] >= max(hybrid)


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
