"""The speculation policy (xpuspec.speculative.policy): draft lengths from measured costs and counted acceptance,
stopping a draft model that cannot pay, the hybrid's fallback, memory across requests, and decisions that a noisy
machine does not flip."""

import pytest

from xpuspec.speculative.policy import (DRAFT_RATIO_ROUNDS, FAILURES_BEFORE_SKIPPING, FIRST_PAUSE_TOKENS,
                                        MAX_PAUSE_TOKENS, MAX_SKIPPED, MIN_JUDGED_ROUNDS, PRIOR_ACCEPTANCE,
                                        PRIOR_TRIALS, REMEMBERED_ROUNDS, AcceptanceCounts, Decision, PolicyBook,
                                        RoundOutcome, SpeculationPolicy, Widths, best_draft_length, expected_tokens)
from xpuspec.speculative.profile import SWEEP_ROUNDS, CostProfile, measure_profile, round_costs
from xpuspec.speculative.schedule import DraftSchedule

from fakes import Successor

#: Plain steps per width 1..6: a small model whose wide passes are cheap, and one whose kernels step up after 4.
SMOLLM2 = CostProfile({1: 1.0, 2: 1.2, 3: 1.3, 4: 1.5, 6: 2.0}, context=100)
QWEN = CostProfile({1: 1.0, 2: 1.2, 3: 1.33, 4: 1.66, 6: 2.37}, context=100)


def test_expected_tokens_and_the_best_length_follow_the_measured_widths():
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75) and expected_tokens([1.0] * 3, 3) == 4.0
    smollm2, qwen = round_costs(SMOLLM2, 6), round_costs(QWEN, 6)
    assert smollm2[4] == pytest.approx(1.75)  # width 5, interpolated
    # prompt lookup (no draft cost) in a copying stretch: SmolLM2 takes k=5, Qwen stops before its wide kernels
    assert best_draft_length([0.9] * 5, 0.0, smollm2) == 5
    assert best_draft_length([0.9] * 5, 0.0, qwen) == 3
    assert best_draft_length([0.0] * 5, 0.0, qwen) == 1
    # a draft model at 0.4 of a step per token, accepted at 0.67 everywhere: one token; right in runs: two
    assert best_draft_length([0.67] * 5, 0.4, qwen) == 1
    assert best_draft_length([0.67] + [0.95] * 4, 0.4, qwen) == 2
    # a backend that pads rounds to 6 tokens: every width up to 6 costs as much, so lookup drafts 5
    assert best_draft_length([0.5] * 5, 0.0, round_costs(QWEN, 6, pad_to=6)) == 5


def test_rates_per_position_start_from_a_prior_and_from_earlier_requests():
    counts = AcceptanceCounts()
    assert counts.rates(2) == pytest.approx([PRIOR_ACCEPTANCE] * 2)
    counts.add_round(drafted=4, accepted=1)  # judged: 1 accepted, 1 rejected
    counts.add_round(drafted=3, accepted=3)  # judged: 3 accepted
    assert counts.judged == [2, 2, 1] and counts.accepted == [2, 1, 1]
    first = (2 + PRIOR_ACCEPTANCE * PRIOR_TRIALS) / (2 + PRIOR_TRIALS)
    second = (1 + first * PRIOR_TRIALS) / (2 + PRIOR_TRIALS)
    third = (1 + second * PRIOR_TRIALS) / (1 + PRIOR_TRIALS)
    assert counts.rates(4) == pytest.approx([first, second, third, third])
    # a pair that accepted 18 of 20 first drafts before opens with 3 rejections: its rate at position 1 stays high
    earlier, opening = AcceptanceCounts([20.0], [18.0]), AcceptanceCounts()
    for _ in range(3):
        opening.add_round(drafted=4, accepted=0)
    before = (18 + PRIOR_ACCEPTANCE * PRIOR_TRIALS) / (20 + PRIOR_TRIALS)
    assert opening.rates(1, earlier) == pytest.approx([before * REMEMBERED_ROUNDS / (3 + REMEMBERED_ROUNDS)])
    assert opening.rates(1) == pytest.approx([PRIOR_ACCEPTANCE * PRIOR_TRIALS / (3 + PRIOR_TRIALS)])
    assert earlier.decayed_plus(opening) == AcceptanceCounts([10.0 + 3, ], [9.0])


def _model_round(policy, drafted, accepted, produced, draft_s=0.5, verify_s=1.3, width=None):
    outcome = RoundOutcome(drafted, accepted, 0, draft_s * drafted, verify_s, width or drafted + 1)
    return policy.report(outcome, produced)


def test_a_draft_model_that_keeps_missing_is_stopped_after_enough_rounds():
    parent = SpeculationPolicy(uses_model=True)
    policy = parent.begin(DraftSchedule(num_assistant_tokens=3), QWEN, with_model=True)
    assert policy.widths(produced=1, room=30).model >= 1
    decisions = [_model_round(policy, 2, 0, produced=i + 1) for i in range(MIN_JUDGED_ROUNDS)]
    assert decisions[:-1] == [Decision.GO_ON] * (MIN_JUDGED_ROUNDS - 1)  # not judged on fewer rounds
    assert decisions[-1] is Decision.DROP_MODEL and policy.stopped.predicted < 1.0 and not policy.stopped.cannot_pay
    assert policy.widths(produced=5, room=30).model == 0


def test_a_draft_model_that_cannot_pay_even_when_every_draft_is_accepted_stops_at_once():
    """Its drafted token costs as much as a target pass: no k yields more tokens per second than plain steps."""
    policy = SpeculationPolicy(uses_model=True).begin(DraftSchedule(), SMOLLM2, with_model=True)
    assert _model_round(policy, 2, 2, produced=3, draft_s=1.5, verify_s=1.2, width=3) is Decision.DROP_MODEL
    assert policy.stopped.cannot_pay


def test_a_draft_model_that_pays_goes_on_and_drafts_longer_after_full_accepts():
    policy = SpeculationPolicy(uses_model=True).begin(DraftSchedule(num_assistant_tokens=2), SMOLLM2, with_model=True)
    for i in range(8):
        k = policy.widths(produced=i * 3 + 1, room=40).model
        assert _model_round(policy, k, k, produced=i * 3 + 1, draft_s=0.1, verify_s=1.3) is Decision.GO_ON
    assert policy.widths(produced=30, room=40).model > 2 and policy.stopped is None


def test_decisions_do_not_change_when_one_pass_is_ten_times_slower():
    """The draft step is a median over rounds of draft-to-verify ratios: one round whose draft or verify took 10x
    (another process on the core) changes no width and no decision."""
    def run(slow_round):
        policy = SpeculationPolicy(uses_model=True).begin(DraftSchedule(num_assistant_tokens=3), QWEN, True)
        trail = []
        for i in range(12):
            k = policy.widths(produced=i + 1, room=40).model
            draft_s, verify_s = (0.45, 1.3) if i != slow_round else (4.5, 1.3)
            verify_s = verify_s * (10 if i == slow_round + 1 else 1)
            trail.append((k, _model_round(policy, k, k - (i % 3 == 0), i + 1, draft_s=draft_s, verify_s=verify_s)))
        return trail

    assert run(slow_round=4) == run(slow_round=-10)
    assert DRAFT_RATIO_ROUNDS >= 3


class _Clocked(Successor):
    """A runner on its own clock: a w-token pass advances it by ``1 + w / 10`` seconds, times ``load(pass number)``."""

    def __init__(self, load=lambda count: 1.0):
        super().__init__(8)
        self.now, self.load, self.count = 0.0, load, 0

    def forward(self, tokens, logits_to_keep=None, exact=True):
        self.count += 1
        self.now += (1 + len(tokens) / 10) * self.load(self.count)
        return super().forward(tokens, logits_to_keep, exact)


def _profile(load, widest=4):
    runner = _Clocked(load)
    runner.forward([1, 2, 3])
    profile = measure_profile(runner, 5, widest=widest, clock=lambda: runner.now)
    assert runner.length == 3  # every pass rolled back
    return profile


def test_the_profile_is_a_median_and_ignores_one_slow_pass():
    """One pass 10x slower, wherever it falls in the sweep (timed or preparing), leaves the profile as it was."""
    quiet = _profile(lambda count: 1.0)
    assert quiet.seconds == {w: pytest.approx(1 + w / 10) for w in (1, 2, 3, 4)}
    for slow in range(2, 2 + 2 * 4 * SWEEP_ROUNDS):
        assert _profile(lambda count: 10.0 if count == slow else 1.0).seconds == pytest.approx(quiet.seconds), slow


def test_the_profile_keeps_its_ratios_when_a_competing_load_starts_during_the_sweep():
    """Another process takes the cores from some pass on (every pass 3x slower): the ratios between widths, which
    the policy decides by, stay those of the quiet machine, wherever the load starts. (Timing each width's rounds in
    a row, widths swept after the load started looked 3x dearer, and the policy stopped drafting for good.)"""
    quiet = _profile(lambda count: 1.0, widest=16)
    passes = 2 * len(quiet.seconds) * SWEEP_ROUNDS
    for start in range(2, 2 + passes):
        loaded = _profile(lambda count: 3.0 if count >= start else 1.0, widest=16)
        for w in quiet.seconds:
            assert loaded.seconds[w] / loaded.seconds[1] == pytest.approx(quiet.seconds[w] / quiet.seconds[1]), start


def test_prompt_lookup_that_does_not_pay_is_paused_and_probed_again():
    """On a target whose 1-token steps are 1 wide (no free slot), lookup rounds that keep missing pause lookup for
    2, 4, 8 ... at most 32 tokens; a lookup round that pays ends the pauses."""
    policy = SpeculationPolicy(uses_model=False).begin(DraftSchedule().for_lookup(), SMOLLM2, with_model=False)
    produced, pauses, misses = 1, [], 0
    while len(pauses) < 7:
        k = policy.widths(produced, room=1000).free
        if k == 0:  # paused
            produced += 1
            continue
        before = policy.resume_at
        policy.report(RoundOutcome(k, 0, k, 0.0, 1.2, k + 1), produced)
        misses += 1
        if policy.resume_at != before:
            pauses.append(policy.resume_at - produced)
        produced += 1
    assert misses >= 7 * 3  # judged on counts over several rounds, not on one miss
    policy.report(RoundOutcome(5, 5, 5, 0.0, 2.0, 6), produced)
    assert policy.pause == 0


def test_the_cost_model_off_drafts_the_schedule_as_it_is():
    policy = SpeculationPolicy(uses_model=True).begin(DraftSchedule(num_assistant_tokens=3, cost_model=False),
                                                       QWEN, with_model=True)
    assert policy.widths(produced=1, room=40) == Widths(3, 10)
    assert policy.widths(produced=1, room=2) == Widths(2, 2)
    for _ in range(5):
        assert _model_round(policy, 3, 0, produced=2) is Decision.GO_ON  # never stopped


def test_requests_skip_a_draft_model_that_stopped_twice_and_probe_again():
    def stopping_request(parent, cannot_pay):
        policy = parent.begin(DraftSchedule(), QWEN, with_model=True)
        draft_s = 2.0 if cannot_pay else 0.3
        while policy.stopped is None:
            _model_round(policy, 2, 0, produced=3, draft_s=draft_s)
        parent.finish(policy)

    parent, pattern = SpeculationPolicy(uses_model=True), []
    for _ in range(40):
        starts = parent.starts_model(DraftSchedule())
        pattern.append(starts)
        if starts:
            stopping_request(parent, cannot_pay=False)
    probes = [i for i, p in enumerate(pattern) if p]
    assert probes[:6] == [0, 1, 3, 6, 11, 20]  # two failures, then 1, 2, 4, 8 skipped between probes
    assert all(b - a - 1 <= MAX_SKIPPED for a, b in zip(probes, probes[1:]))
    assert SpeculationPolicy(True).starts_model(DraftSchedule())  # a fresh pair starts

    hopeless, pattern = SpeculationPolicy(uses_model=True), []
    for _ in range(30):
        starts = hopeless.starts_model(DraftSchedule())
        pattern.append(starts)
        if starts:
            stopping_request(hopeless, cannot_pay=True)
    probes = [i for i, p in enumerate(pattern) if p]
    assert probes[:3] == [0, 1, 1 + MAX_SKIPPED + 1]  # after FAILURES_BEFORE_SKIPPING that could never pay
    assert FAILURES_BEFORE_SKIPPING == 2


def test_a_request_starts_from_the_acceptance_of_the_ones_before():
    parent = SpeculationPolicy(uses_model=True)
    first = parent.begin(DraftSchedule(num_assistant_tokens=2), QWEN, with_model=True)
    for _ in range(4):
        _model_round(first, 2, 2, produced=3, draft_s=0.1)
    parent.finish(first)
    assert parent.model_counts.judged == [4, 4] and parent.draft_ratio is not None
    second = parent.begin(DraftSchedule(num_assistant_tokens=2), QWEN, with_model=True)
    assert second.model_counts.rates(1, parent.model_counts)[0] > PRIOR_ACCEPTANCE


def test_the_book_keeps_one_policy_per_drafter_and_mode():
    book, draft = PolicyBook(step_width=2), Successor()
    a = book.policy("hybrid", draft, sample=False, uses_model=True, name="d")
    assert book.policy("hybrid", draft, sample=False, uses_model=True, name="d") is a
    assert book.policy("hybrid", draft, sample=True, uses_model=True, name="d") is not a  # sampling accepts less
    assert book.policy("lookup", None, sample=False, uses_model=False, name="l").step_width == 2


def test_best_length_summed_as_k_grows_equals_the_reference():
    """best_draft_length sums expected tokens incrementally; the reference recomputes each k with
    expected_tokens (rates shorter than the widths too)."""
    import random

    def reference(rates, draft_step, pass_s):
        best, best_rate = 1, -1.0
        for k in range(1, len(pass_s)):
            rate = expected_tokens(rates, k) / max(k * draft_step + pass_s[k], 1e-12)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best

    rng = random.Random(0)
    for _ in range(500):
        longest = rng.randint(2, 17)
        rates = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(rng.randint(0, longest))]
        profile = CostProfile({w: rng.uniform(0.5, 3.0) for w in rng.sample(range(1, 17), rng.randint(1, 6))} | {1: 1.0},
                              context=10)
        costs = round_costs(profile, longest, pad_to=rng.choice([0, 0, 4, 8]))
        step = rng.choice([0.0, 0.1, 0.4])
        assert best_draft_length(rates, step, costs) == reference(rates, step, costs)


def test_profile_answers_are_computed_once_and_equal_the_interpolation():
    profile = CostProfile({1: 1.0, 2: 1.2, 4: 1.5, 8: 2.5}, context=10)
    fresh = CostProfile({1: 1.0, 2: 1.2, 4: 1.5, 8: 2.5}, context=10)
    for w in range(1, 20):
        assert profile.pass_s(w) == fresh._interpolated(w)
    costs = round_costs(profile, 12, pad_to=6)
    assert list(costs) == [fresh._interpolated(w if w == 1 else max(w, 6)) for w in range(1, 13)]
    assert round_costs(profile, 12, pad_to=6) is costs
    assert profile == fresh  # the memo is not part of the value
