"""Speculative mechanics on tiny random models and on distributions: rejection sampling is
lossless (and the test catches a broken rule), drafts with another vocabulary are refused,
bad options raise, and prompt lookup finds n-grams."""

import pytest
import torch

from xpuspec import AutoModelForCausalLM, DraftMismatchError, SpeculativeConfig, SpeculativeConfigError
from xpuspec.speculative.drafters import HybridDrafter, ModelDrafter, PromptLookupDrafter
from xpuspec.speculative.overlap import OverlappedDrafter
from xpuspec.speculative.verify import greedy_accept, rejection_sample

from tiny import WORDS, tiny_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run thousands of microsecond-sized ops: spinning thread pools only slow them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny target that drafts with another tiny model (k=2, constant, cost model off)."""
    root = tmp_path_factory.mktemp("tiny")
    draft_path = tiny_model(root / "draft", seed=2)
    spec = SpeculativeConfig(mode="draft", draft=str(draft_path), num_assistant_tokens=2,
                             num_assistant_tokens_schedule="constant", cost_model=False)
    target = AutoModelForCausalLM.from_pretrained(tiny_model(root / "target", seed=1), device="cpu", backend="torch",
                                                  speculative=spec)
    return target, target.draft_model


def _tv(counts_a: torch.Tensor, counts_b: torch.Tensor) -> float:
    return 0.5 * float((counts_a / counts_a.sum() - counts_b / counts_b.sum()).abs().sum())


def _first_token_counts(sampler, trials, vocab):
    counts = torch.zeros(vocab)
    for _ in range(trials):
        counts[sampler()] += 1
    return counts


def broken_always_accept(drafts, draft_probs, target_probs, generator=None):
    """A wrong acceptance rule (accepts every draft) that the statistical test must catch."""
    return len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1))


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("rule, lossless", [(rejection_sample, True), (broken_always_accept, False)])
def test_rejection_sampling_follows_the_target_distribution(rule, lossless, cut):
    """First token of a 3-token draft round: its distribution must equal p_0 whatever q is, also a q that is 0
    on half the vocabulary (``cut``: a draft head that scores only some tokens, xpuspec.speculative.vocab).

    TV distance between two empirical distributions of N samples over V outcomes is about
    sqrt(V / (2 pi N)) under the null; with V=8, N=20000 that is ~0.008, so 0.03 is a safe bound,
    while the broken rule lands at TV(q_0, p_0) = 0.4 or more by construction.
    """
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 8, 20000
    p = torch.softmax(torch.randn(4, vocab, generator=gen) * 2, dim=-1)
    q_logits = torch.randn(3, vocab, generator=gen) * 2
    if cut:
        q_logits[:, vocab // 2:] = float("-inf")
    q = torch.softmax(q_logits, dim=-1)
    assert _tv(p[0], q[0]) > 0.4

    def speculative():
        drafts = [int(torch.multinomial(q[i], 1)) for i in range(3)]
        n, token = rule(drafts, q, p)
        return drafts[0] if n > 0 else token

    observed = _first_token_counts(speculative, trials, vocab)
    direct = _first_token_counts(lambda: int(torch.multinomial(p[0], 1)), trials, vocab)
    assert (_tv(observed, direct) < 0.03) == lossless


def test_deterministic_drafts_are_lossless_too():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, 6, generator=gen) * 2, dim=-1)
    counts = _first_token_counts(lambda: (lambda n, t: 3 if n else t)(*rejection_sample([3], None, p)), 20000, 6)
    assert _tv(counts, p[0] * 20000) < 0.03


def test_greedy_accept():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert greedy_accept([1, 2], scores) == (2, 0)
    assert greedy_accept([1, 0], scores) == (1, 2)
    assert greedy_accept([], scores[:1]) == (0, 1)


def test_sampled_speculation_matches_plain_sampling_on_tiny_models(tiny_pair):
    """End to end: the 2nd and 3rd sampled tokens (the first drafted round; the 1st comes from
    prefill) have the same joint distribution with the draft model as with plain sampling
    (TV over the 16 x 16 pairs, N=1500 each)."""
    target, _ = tiny_pair
    ids = torch.tensor([[1, 5, 6]])
    kwargs = dict(max_new_tokens=4, do_sample=True, temperature=0.8, top_p=0.95)

    def pair_counts(**extra):
        counts = torch.zeros(len(WORDS) ** 2)
        for _ in range(1500):
            a, b = target.generate(input_ids=ids, **kwargs, **extra)[0, 4:6].tolist()
            counts[a * len(WORDS) + b] += 1
        return counts

    torch.manual_seed(0)
    plain = pair_counts(speculative=False)
    spec = pair_counts()
    assert target.last_generate_stats.drafted_tokens >= 2
    assert _tv(plain, spec) < 0.12  # null ~ sqrt(256 / (2 pi 1500)) = 0.05 at most for 256 cells


def test_draft_with_another_vocabulary_is_refused(tiny_pair, tmp_path):
    target, _ = tiny_pair
    other_words = WORDS[:3] + [f"v{i}" for i in range(13)]
    other = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "other", 3, other_words), backend="torch")
    with pytest.raises(DraftMismatchError, match="another vocabulary"):
        target.generate(input_ids=torch.tensor([[1, 5]]), max_new_tokens=4, assistant_model=other)


def test_bad_speculative_options(tiny_pair):
    target, draft = tiny_pair
    ids = torch.tensor([[1, 5]])
    with pytest.raises(ValueError, match="num_assistant_tokens must be an int >= 1, got 0"):
        target.generate(input_ids=ids, max_new_tokens=4, assistant_model=draft, num_assistant_tokens=0)
    with pytest.raises(NotImplementedError, match="Beam search"):
        target.generate(input_ids=ids, max_new_tokens=4, assistant_model=draft, num_beams=2)
    with pytest.raises(TypeError, match="must be an xpuspec model"):
        target.generate(input_ids=ids, max_new_tokens=4, assistant_model=draft.runner)
    with pytest.raises(SpeculativeConfigError, match="Unknown speculative mode"):
        SpeculativeConfig(mode="medusa")
    with pytest.raises(SpeculativeConfigError, match="num_assistant_tokens_schedule must be 'heuristic' or 'constant'"):
        SpeculativeConfig(num_assistant_tokens_schedule="dynamic")


@pytest.mark.parametrize("name, value, message", [
    ("num_assistant_tokens", 2.5, "num_assistant_tokens must be an int >= 1, got 2.5"),
    ("num_assistant_tokens", "3", "num_assistant_tokens must be an int >= 1, got '3'"),
    ("num_assistant_tokens", True, "num_assistant_tokens must be an int >= 1, got True"),
    ("prompt_lookup_num_tokens", 2.5, "prompt_lookup_num_tokens must be an int >= 1, got 2.5"),
    ("prompt_lookup_num_tokens", -1, "prompt_lookup_num_tokens must be an int >= 1, got -1"),
    ("assistant_confidence_threshold", "0.5", r"assistant_confidence_threshold must be a number in \[0, 1\), got '0.5'"),
])
def test_draft_lengths_and_thresholds_are_refused_by_name(tiny_pair, name, value, message):
    """In SpeculativeConfig and in generate alike, before any token is drafted (a float length ran before, a
    string raised a bare TypeError, and generate's prompt_lookup_num_tokens was refused as num_assistant_tokens)."""
    target, draft = tiny_pair
    with pytest.raises(SpeculativeConfigError, match=message):
        SpeculativeConfig(mode="self", **{name: value})
    with pytest.raises(SpeculativeConfigError, match=message):
        target.generate(input_ids=torch.tensor([[1, 5]]), max_new_tokens=4, assistant_model=draft, **{name: value})


def test_options_of_another_mode_and_non_bool_flags_are_refused():
    with pytest.raises(SpeculativeConfigError, match="prompt_lookup_num_tokens applies to modes 'prompt_lookup' and"):
        SpeculativeConfig(mode="self", prompt_lookup_num_tokens=3)
    assert SpeculativeConfig(mode="hybrid", prompt_lookup_num_tokens=3).prompt_lookup_num_tokens == 3
    with pytest.raises(SpeculativeConfigError, match="cost_model must be True or False, got 'no'"):
        SpeculativeConfig(cost_model="no")
    with pytest.raises(SpeculativeConfigError, match="overlap must be True, False or None"):
        SpeculativeConfig(overlap="yes")
    for given in (dict(draft_device="gpu"), dict(draft_low_bit="int4_sym", draft="d")):
        with pytest.raises(SpeculativeConfigError, match="prompt_lookup uses no draft model: drop draft"):
            SpeculativeConfig(mode="prompt_lookup", **given)


def test_a_hybrids_lookup_drafts_at_most_prompt_lookup_num_tokens(tiny_pair):
    """generate(assistant_model=, prompt_lookup_num_tokens=) and SpeculativeConfig(mode="hybrid",
    prompt_lookup_num_tokens=) set the longest lookup draft, also for the lookup going on alone."""
    from xpuspec.speculative.pairing import plan_speculation

    target, draft = tiny_pair
    _, schedule = plan_speculation(target, None, True, assistant_model=draft, prompt_lookup_num_tokens=3)
    assert schedule.lookup_tokens == 3 and schedule.for_lookup().num_assistant_tokens == 3
    _, schedule = plan_speculation(target, SpeculativeConfig(mode="hybrid", draft=str(draft.source.path),
                                                             prompt_lookup_num_tokens=5), True)
    assert schedule.lookup_tokens == 5 and schedule.num_assistant_tokens == 4  # the model's k stays its own
    _, schedule = plan_speculation(target, SpeculativeConfig(mode="hybrid"), True)
    assert schedule.lookup_tokens == 10


def test_numpy_integers_count_as_ints():
    """A length computed with NumPy is taken and kept as a Python int (the bench writes the config to JSON)."""
    import numpy as np

    spec = SpeculativeConfig(mode="hybrid", num_assistant_tokens=np.int64(3), max_matching_ngram_size=np.int32(2),
                             draft_vocab_size=np.int64(4096), draft_context_length=np.uint16(32))
    values = (spec.num_assistant_tokens, spec.max_matching_ngram_size, spec.draft_vocab_size, spec.draft_context_length)
    assert values == (3, 2, 4096, 32) and all(type(v) is int for v in values)


def test_a_hybrid_looks_up_its_longest_ngram_only_by_default(tiny_pair):
    """Prompt lookup alone matches 3- down to 2-grams, a hybrid (either way it is asked for) 3-grams only,
    unless min_matching_ngram_size says otherwise."""
    from xpuspec.speculative.pairing import plan_speculation

    target, draft = tiny_pair

    def sizes(spec, **kwargs):
        """(max, min) of the lookup beside the draft model, and of the one that goes on once it is dropped."""
        drafter, _ = plan_speculation(target, spec, True, **kwargs)
        if not isinstance(drafter, HybridDrafter):
            return drafter.max_ngram, drafter.min_ngram
        return [(lookup.max_ngram, lookup.min_ngram) for lookup in (drafter.lookup, drafter.costless_part())]

    assert sizes(SpeculativeConfig(mode="prompt_lookup")) == (3, 2)
    assert sizes(SpeculativeConfig(mode="hybrid")) == [(3, 3), (3, 2)]
    assert sizes(SpeculativeConfig(mode="hybrid", min_matching_ngram_size=2)) == [(3, 2), (3, 2)]
    assert sizes(SpeculativeConfig(mode="hybrid", max_matching_ngram_size=4)) == [(4, 4), (4, 2)]
    assert sizes(SpeculativeConfig(mode="hybrid", max_matching_ngram_size=1)) == [(1, 1), (1, 1)]
    assert sizes(None, assistant_model=draft, prompt_lookup_num_tokens=3) == [(3, 3), (3, 2)]
    assert sizes(SpeculativeConfig(mode="hybrid", max_matching_ngram_size=1), prompt_lookup_num_tokens=3) == (1, 1)


@pytest.mark.parametrize("sizes, message", [
    (dict(max_matching_ngram_size=3.0), "max_matching_ngram_size must be an int >= 1"),
    (dict(min_matching_ngram_size=True), "min_matching_ngram_size must be an int >= 1, got True"),
    (dict(min_matching_ngram_size="2"), "min_matching_ngram_size must be an int >= 1, got '2'"),
    (dict(max_matching_ngram_size=None), "max_matching_ngram_size must be an int >= 1, got None"),
    (dict(min_matching_ngram_size=0), "min_matching_ngram_size must be an int >= 1, got 0"),
    (dict(max_matching_ngram_size=2, min_matching_ngram_size=3), "set min_matching_ngram_size to at most"),
])
@pytest.mark.parametrize("mode", ["prompt_lookup", "hybrid", "self"])
def test_bad_ngram_sizes_are_refused_by_name(mode, sizes, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        SpeculativeConfig(mode=mode, **sizes)


def test_prompt_lookup_finds_the_first_longest_match():
    lookup = PromptLookupDrafter(max_matching_ngram_size=2, min_matching_ngram_size=1)
    assert lookup.lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [3, 9, 1]  # the first (1, 2), not the latest
    assert lookup.lookup([9, 2, 5, 1, 2, 6, 3, 1, 2], 2) == [6, 3]  # the 2-gram before an earlier 1-gram
    assert lookup.lookup([7, 8, 9], 3) == []
    assert lookup.lookup([5, 6, 5], 2) == [6, 5]


def test_speculation_memory_skips_after_two_failures_and_backs_off():
    from xpuspec.speculative.memory import MAX_SKIPPED, SpeculationMemory

    memory, key = SpeculationMemory(), ("ModelDrafter", 1)
    pattern = []
    for _ in range(40):
        speculate = memory.should_speculate(key)
        pattern.append(speculate)
        if speculate:
            memory.record(key, switched_off=True)
    probes = [i for i, p in enumerate(pattern) if p]
    assert probes[:6] == [0, 1, 3, 6, 11, 20]  # two failures, then 1, 2, 4, 8 skipped between probes
    assert all(b - a - 1 <= MAX_SKIPPED for a, b in zip(probes, probes[1:]))
    memory.record(key, switched_off=False)  # a probe where speculation paid resets the count
    assert memory.should_speculate(key) and memory.should_speculate(("other", 2))

    hopeless, pattern = SpeculationMemory(), []  # a draft too slow to pay even when every draft is accepted
    for i in range(40):
        speculate = hopeless.should_speculate(key)
        pattern.append(speculate)
        if speculate:
            hopeless.record(key, switched_off=True, cannot_pay=i != 1)
    probes = [i for i, p in enumerate(pattern) if p]
    # the second failure could have paid (1 skipped, then 2); after two that could not, MAX_SKIPPED at once
    assert probes[:5] == [0, 1, 3, 6, 6 + MAX_SKIPPED + 1]


def test_acceptance_remembered_across_requests_is_the_next_prior():
    from xpuspec.speculative.costmodel import REMEMBERED_ROUNDS, AcceptanceCounts, CostModel
    from xpuspec.speculative.memory import DECAY, SpeculationMemory

    memory, key = SpeculationMemory(), ("ModelDrafter", 1, False)
    assert memory.acceptance(key) is None
    memory.record(key, switched_off=False, acceptance=AcceptanceCounts([2.0, 1.0], [1.0, 0.0]))
    memory.record(key, switched_off=False, acceptance=AcceptanceCounts([1.0], [1.0]))
    assert memory.acceptance(key) == AcceptanceCounts([DECAY * 2 + 1, DECAY * 1], [DECAY * 1 + 1, 0.0])

    # a pair that accepted 18 of 20 first drafts before opens with 3 rejections: its rate at position 1 stays
    # (18 + 0.7 * 3) / 23 worth REMEMBERED_ROUNDS rounds, where the fixed prior (0.7 worth 3) falls to 0.35
    remembered, fixed = CostModel(True, False, prior=AcceptanceCounts([20.0], [18.0])), CostModel(True, False)
    for cost in (remembered, fixed):
        for _ in range(3):
            cost.note_drafts(drafted=4, accepted=0, draft_s=0.01)
    before = (18 + 0.7 * 3) / 23
    assert remembered.acceptance_by_position(2) == pytest.approx(
        [before * REMEMBERED_ROUNDS / (3 + REMEMBERED_ROUNDS)] * 2)
    assert fixed.acceptance_by_position(1) == pytest.approx([2.1 / 6])
    assert remembered.counts() == AcceptanceCounts([3.0], [0.0])
    remembered.become_costless()  # a hybrid dropped its draft model: what follows is lookup's
    remembered.note_drafts(drafted=5, accepted=5, draft_s=0.0)
    assert remembered.counts() == AcceptanceCounts([3.0], [0.0])  # the memory keeps the draft model's rounds
    assert remembered.acceptance_by_position(1) == pytest.approx([(1 + 2.1) / 4])  # lookup's round, the fixed prior

    # a position barely measured before weighs as the fixed prior does, not less
    barely = CostModel(True, False, prior=AcceptanceCounts([0.01], [0.01]))
    barely.note_drafts(drafted=2, accepted=0, draft_s=0.01)
    fixed = CostModel(True, False)
    fixed.note_drafts(drafted=2, accepted=0, draft_s=0.01)
    assert barely.acceptance_by_position(1) == pytest.approx(fixed.acceptance_by_position(1), abs=0.01)


def test_a_request_starts_from_the_acceptance_of_the_ones_before(tmp_path, monkeypatch):
    import xpuspec.decode
    from xpuspec.speculative.costmodel import CostModel
    from xpuspec.speculative.memory import DECAY

    priors = []
    monkeypatch.setattr(xpuspec.decode, "CostModel", lambda *a, prior=None, **k: priors.append(prior) or CostModel(
        *a, prior=prior, **k))
    spec = SpeculativeConfig(mode="draft", draft=str(tiny_model(tmp_path / "draft", seed=2)), num_assistant_tokens=2)
    target = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "target", seed=1), device="cpu",
                                                  backend="torch", speculative=spec)
    ids = torch.tensor([[3, 4, 5, 6]])
    target.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    first = target.last_generate_stats.acceptance_counts
    target.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    second = target.last_generate_stats.acceptance_counts
    assert priors[0] is None and priors[1] == first  # the first request had only the fixed prior
    assert first.judged and all(a <= j for a, j in zip(first.accepted, first.judged))
    memory = target._speculation_memory.acceptance(("ModelDrafter", id(None), False))
    assert memory.judged[0] == pytest.approx(DECAY * first.judged[0] + second.judged[0])
    target.generate(ids, max_new_tokens=8, do_sample=True, top_k=0)  # sampling keeps its own memory
    assert priors[2] is None


def test_the_draft_step_leaves_looked_up_tokens_out():
    """Seconds per drafted token count the tokens a model drafted: a hybrid's lookup round (all free) and the
    lookup that ended a model's chain (2 of 4 free) cost nothing, while their acceptance still counts."""
    from xpuspec.speculative.costmodel import CostModel

    cost = CostModel(enabled=True, costless=False)
    cost.note_drafts(4, 4, 0.040, free=2)  # 2 model drafts in 40 ms, then 2 looked up
    cost.note_drafts(5, 1, 0.0001, free=5)  # a lookup round
    assert cost.draft_step() == pytest.approx(0.040 / 2)
    assert cost.counts().judged == [2, 2, 1, 1] and cost.counts().accepted == [2, 1, 1, 1]


def test_cost_model_switches_a_draft_model_off_and_pauses_prompt_lookup():
    from xpuspec.speculative.costmodel import FIRST_PAUSE_TOKENS, MAX_PAUSE_TOKENS, WINDOW_ROUNDS, CostModel

    model = CostModel(enabled=True, costless=False)
    assert model.measuring()
    model.record(0.014, 1, 0, speculative=False)  # the first plain steps after a prefill are slow
    model.record(0.012, 1, 0, speculative=False)
    assert model.measuring()
    model.record(0.010, 1, 0, speculative=False)
    assert not model.measuring()
    for _ in range(WINDOW_ROUNDS - 1):  # 2 tokens per 0.025 s round: slower than 1 per 0.010 s
        model.record(0.025, 2, 4, speculative=True)
        assert model.keep_speculating(produced=10)  # not judged before a full window
    model.record(0.025, 2, 4, speculative=True)
    assert not model.keep_speculating(produced=10) and model.full_accept_pays()  # a full accept would have paid
    # a window that failed, where the request's measured rates still predict a speed-up (an unlucky start)
    assert model.keep_speculating(produced=10, predicted_speedup=1.2)
    assert not model.keep_speculating(produced=10, predicted_speedup=1.05)

    guessing = CostModel(enabled=True, costless=False)  # plain steps that carry a free guess: 1.5 tokens each
    for tokens in (1, 2):
        guessing.record(0.010, tokens, 0, speculative=False)
    assert guessing.plain_step() == pytest.approx(0.010 / 1.5)

    fast = CostModel(enabled=True, costless=False)
    fast.record(0.010, 1, 0, speculative=False)
    fast.record(0.060, 1, 4, speculative=True)  # even a full accept, 5 tokens in 6 steps' time, cannot pay
    assert not fast.keep_speculating(produced=3) and not fast.full_accept_pays()  # off after one round

    lookup = CostModel(enabled=True, costless=True)
    lookup.record(0.010, 1, 0, speculative=False)
    pauses, produced = [], 0
    for _ in range(7):  # every probe fails: after each failing window, 2, 4, 8, ... tokens of pause, at most 32
        for _ in range(WINDOW_ROUNDS - 1):  # judged over a window, not on a single miss
            lookup.record(0.020, 1, 4, speculative=True)
            assert lookup.keep_speculating(produced) and not lookup.paused(produced)
            produced += 1
        lookup.record(0.020, 1, 4, speculative=True)
        assert lookup.keep_speculating(produced)  # a costless drafter is never switched off
        pauses.append(lookup.resume_at - produced)
        assert lookup.paused(produced) and lookup.paused(lookup.resume_at - 1) and not lookup.paused(lookup.resume_at)
        produced = lookup.resume_at
    assert pauses == [FIRST_PAUSE_TOKENS * 2 ** i for i in range(5)] + [MAX_PAUSE_TOKENS] * 2
    for _ in range(WINDOW_ROUNDS):  # a probe in a copying stretch: 5 tokens per 0.020 s round pays
        lookup.record(0.020, 5, 4, speculative=True)
        assert lookup.keep_speculating(produced) and not lookup.paused(produced)
    assert lookup.pause == 0 and lookup.pauses == 7  # the next failure pauses for 2 tokens again

    known = CostModel(enabled=True, costless=True, known_plain_s=0.010)  # T1 from an earlier request
    assert not known.measuring() and known.plain_step() == 0.010
    known.record(0.012, 1, 0, speculative=False)
    assert known.plain_step() == 0.010  # the faster of the two
    known.record(0.020, 1, 4, speculative=True)
    assert known.keep_speculating(0) and known.pays()  # best case 5 tokens in 2 steps' time

    # the native engine finishes sooner only when the steps it saves outweigh prefilling the context again
    assert not known.handover_pays(remaining=60, native_step_s=0.009, prefill_s=0.3)  # saves 60 ms, costs 300
    assert known.handover_pays(remaining=600, native_step_s=0.009, prefill_s=0.3)  # saves 600 ms
    assert not known.handover_pays(remaining=600, native_step_s=None, prefill_s=0.3)  # engine never timed

    off = CostModel(enabled=False, costless=False)
    assert not off.measuring()
    off.record(1.0, 1, 4, speculative=True)
    assert off.keep_speculating(0)


def test_prompt_lookup_minimum_ngram():
    lookup = PromptLookupDrafter(max_matching_ngram_size=3, min_matching_ngram_size=2)
    assert lookup.lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [3, 9, 1]
    assert lookup.lookup([5, 6, 7, 8, 5], 2) == []  # only a 1-gram matches
    assert PromptLookupDrafter(3, 1).lookup([5, 6, 7, 8, 5], 2) == [6, 7]


def test_draft_length_follows_the_measured_verify_widths():
    from xpuspec.speculative.widths import best_draft_length, expected_tokens

    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 3) == 4.0
    smollm2 = [1.0, 1.2, 1.3, 1.5, 1.83, 2.0]  # plain steps per width 1..6, single measurements of this session
    qwen = [1.0, 1.2, 1.33, 1.66, 2.33, 2.37]  # (widths.py gives the ranges; the choices are close calls)
    # prompt lookup (no draft cost) in a copying stretch: SmolLM2 takes k=5, Qwen stops before its wide kernels
    assert best_draft_length(0.9, 0.0, smollm2) == 5  # 4.69 tokens / 2.0 > 3.44 / 1.5
    assert best_draft_length(0.9, 0.0, qwen) == 3  # 3.44 / 1.66 = 2.07 > 4.69 / 2.37 = 1.98
    assert best_draft_length(0.5, 0.0, smollm2) == 2  # 1.75 / 1.3 = 1.35 > 1.875 / 1.5
    assert best_draft_length(0.0, 0.0, qwen) == 1
    # a draft model at 0.4 of a step per token with acceptance 0.67 (the Qwen 0.5B draft): one token
    assert best_draft_length(0.67, 0.4, qwen) == 1  # 1.67 / 1.6 = 1.04 > 2.12 / 2.13
    # ... but where drafts are right in runs (a_1 = 0.67, later positions 0.95), two: 2.31 / 2.13 > 1.67 / 1.6
    assert expected_tokens([0.5, 1.0], 2) == pytest.approx(2.0) and expected_tokens([0.9] * 3, 3) == expected_tokens(0.9, 3)
    assert best_draft_length([0.67] + [0.95] * 4, 0.4, qwen) == 2


def test_verify_widths_are_measured_once_and_leave_the_cache_as_it_was(tiny_pair):
    from xpuspec.speculative.costmodel import CostModel
    from xpuspec.speculative.widths import measure_widths

    runner = tiny_pair[0].runner
    runner.reset()
    runner.forward([3, 4, 5, 6, 7] * 3 + [8, 9], logits_to_keep=1)
    before = runner.forward([7])[0].clone()
    runner.rollback(1)
    seconds = measure_widths(runner, 7, 4)
    assert list(seconds) == [1, 2, 3, 4] and all(s > 0 for s in seconds.values())
    assert runner.length == 17 and torch.equal(runner.forward([7])[0], before)
    calls = []
    real = runner.forward
    runner.forward = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        again = measure_widths(runner, 7, 5)  # only width 5 is new
    finally:
        del runner.forward
    assert [len(a[0]) for a in calls] == [5, 5] and {w: again[w] for w in seconds} == seconds

    cost = CostModel(enabled=True, costless=True)
    assert cost.acceptance_by_position(2) == pytest.approx([0.7, 0.7]) and cost.draft_step() == 0.0  # the prior
    cost.note_drafts(drafted=4, accepted=1, draft_s=0.004)  # judged: 1 accepted, 1 rejected
    cost.note_drafts(drafted=3, accepted=3, draft_s=0.002)  # judged: 3 accepted
    assert cost.draft_step() == pytest.approx(0.006 / 7)
    # per position: 1 judged 2 rounds and accepted both, 2 judged 2 and accepted 1, 3 judged 1 and accepted it;
    # each from a prior of 3 rounds at the rate before it (0.7 at position 1), position 4 the prior alone
    first = (2 + 2.1) / 5
    second = (1 + 3 * first) / 5
    third = (1 + 3 * second) / 4
    assert cost.acceptance_by_position(4) == pytest.approx([first, second, third, third])


def test_a_short_request_measures_no_wider_pass_than_it_may_verify(tmp_path):
    """The first speculative request times verify widths only up to the widest pass it may still verify
    (3 new tokens: the first comes from the prefill, and T1 is remembered from the plain request, so the first
    round drafts at once, with room for 1 draft + the pending token), and its output stays the plain greedy one."""
    from xpuspec.speculative.widths import _WIDTH_S

    model = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "t", seed=3), device="cpu", backend="torch",
                                                 speculative="prompt_lookup")
    ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    plain = model.generate(ids, max_new_tokens=3, do_sample=False, speculative=False)
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), plain)
    assert sorted(_WIDTH_S[model.runner]) == [1, 2]


def test_padded_steps_carry_a_guess_and_keep_the_output(tmp_path):
    """A target whose 1-token steps run as 2-token passes (single_step_width 2, set by hand on a tiny torch
    model here) gets a prompt-lookup guess in the second slot of every round without drafts: plain greedy
    output unchanged, the guesses counted apart from drafts, none under sampling."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "t", seed=4), device="cpu", backend="torch")
    ids = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]])
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert plain.shape[1] == ids.shape[1] + 24 and "step_guesses" not in model.last_generate_stats.extra
    model.runner.single_step_width = 2
    assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False), plain)
    stats = model.last_generate_stats
    assert stats.extra["step_guesses"] > 0 and stats.drafted_tokens == 0
    # each accepted guess saves a pass (but one that comes with the last token)
    assert 1 + 23 - stats.extra["step_guesses_accepted"] <= stats.target_forwards < 1 + 23
    torch.manual_seed(0)
    model.generate(ids, max_new_tokens=8, do_sample=True)
    assert "step_guesses" not in model.last_generate_stats.extra


def test_a_draft_whose_scored_tokens_are_all_masked_drafts_nothing():
    """A cut head (xpuspec.speculative.vocab) whose every token the processors mask (e.g. its only token is an
    EOS before min_new_tokens): sampling drafts nothing rather than drawing from a NaN distribution."""
    from xpuspec.runner import Runner
    from xpuspec.speculative.drafters import ModelDrafter

    class Masked(Runner):
        device, vocab_size, weight_bytes, num_layers = "cpu", 4, 0, 1
        length = 0

        def forward(self, tokens, logits_to_keep=None):
            return torch.full((logits_to_keep or len(tokens), 4), float("-inf"))

        def rollback(self, n):
            pass

        def reset(self):
            pass

    drafter = ModelDrafter(Masked(), vocab_size=4)
    assert drafter.propose([1, 2], 3, lambda prefix, logits: logits, sample=True) == ([], None)


def test_the_loop_gives_a_hybrids_lookup_rounds_the_costless_width(tiny_pair):
    """With verify passes of every width costing alike, drafts that cost nothing favour the widest pass: the
    decode loop gives a hybrid (model rounds k = 1 here) costless_k = that length, at most the schedule's
    lookup_tokens (prompt_lookup_num_tokens), and prompt lookup alone, whose every round is costless, none. The
    output stays the plain greedy output."""
    from xpuspec.decode import DraftSchedule, decode
    from xpuspec.generation import resolve_generation_config
    from xpuspec.speculative.widths import _WIDTH_S

    target, draft = tiny_pair
    calls = []

    def recording(cls):
        class Recording(cls):
            def propose(self, context, k, score, sample, threshold=0.0, costless_k=None):
                calls.append((cls.__name__, k, costless_k))
                return super().propose(context, k, score, sample, threshold, costless_k=costless_k)
        return Recording

    ids = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]
    config = resolve_generation_config(target.generation_config, None, dict(max_new_tokens=24, do_sample=False))
    plain = decode(target.runner, ids, config)[0]
    _WIDTH_S[target.runner] = {w: 0.01 for w in range(1, 12)}  # every verify width as dear as a plain step
    hybrid = recording(HybridDrafter)(PromptLookupDrafter(3, 3), ModelDrafter(draft.runner, target.runner.vocab_size))
    schedule = DraftSchedule(num_assistant_tokens=1, schedule="constant")
    assert decode(target.runner, ids, config, drafter=hybrid, schedule=schedule)[0] == plain
    widths = {costless for name, k, costless in calls if k == 1 and costless is not None}
    assert widths and max(widths) > 1  # some lookup round could take more than the model's single draft
    calls.clear()
    capped = DraftSchedule(num_assistant_tokens=1, schedule="constant", lookup_tokens=2)  # prompt_lookup_num_tokens=2
    assert decode(target.runner, ids, config, drafter=hybrid, schedule=capped)[0] == plain
    assert {costless for _, _, costless in calls} - {None} == {2}
    calls.clear()
    lookup = recording(PromptLookupDrafter)(3, 1)
    assert decode(target.runner, ids, config, drafter=lookup, schedule=schedule.for_lookup())[0] == plain
    assert calls and all(costless is None for _, _, costless in calls)
    del _WIDTH_S[target.runner]


def test_a_hybrid_chain_ends_with_prompt_lookup_once_its_drafts_match():
    """A hybrid's draft model stops as soon as its drafts make an n-gram match, and prompt lookup's continuation
    ends the chain (one-hot rows when sampling); without a match it drafts its k tokens."""
    from xpuspec.runner import Runner
    from xpuspec.speculative.drafters import ModelDrafter

    class Successor(Runner):
        """A draft whose next token is the last token + 1 (mod 8), counting its forward passes."""
        device, vocab_size, weight_bytes, num_layers = "cpu", 8, 0, 1

        def __init__(self):
            self.held, self.passes = 0, 0

        @property
        def length(self):
            return self.held

        def forward(self, tokens, logits_to_keep=None):
            self.held += len(tokens)
            self.passes += 1
            return torch.nn.functional.one_hot(torch.tensor([(tokens[-1] + 1) % 8]), 8).float() * 50

        def rollback(self, n):
            self.held -= n

        def reset(self):
            self.held = 0

    def scores(prefix, logits):
        return logits

    runner = Successor()
    hybrid = HybridDrafter(PromptLookupDrafter(3, 2), ModelDrafter(runner, vocab_size=8))
    # no n-gram matches at the end of the context; the draft's 3 makes a 2-gram match ([2, 3]), which is not
    # enough, and its 4 a 3-gram match ([2, 3, 4]), which continues 5, 0, 7
    context = [2, 3, 4, 5, 0, 7, 2]
    assert hybrid.propose(context, 5, scores, sample=False) == ([3, 4, 5, 0, 7], None)
    assert (runner.passes, runner.length) == (2, len(context) + 1)  # prefill, one step; none after the match
    assert not hybrid.last_round_costless()
    tokens, probs = hybrid.propose(context, 5, scores, sample=True)
    assert tokens == [3, 4, 5, 0, 7]
    assert probs.shape == (5, 8) and float(probs[0, 3]) > 0.99 and float(probs[1, 4]) > 0.99
    assert torch.equal(probs[2:], torch.nn.functional.one_hot(torch.tensor([5, 0, 7]), 8).float())
    assert hybrid.extended_tokens() == 3
    # a lookup round (right after an extended one) takes costless_k tokens, the width of a costless draft, and
    # reports none as extended
    assert hybrid.propose(context + [3, 4], 2, scores, sample=False, costless_k=3) == ([5, 0, 7], None)
    assert hybrid.last_round_costless() and hybrid.extended_tokens() == 0
    assert hybrid.propose(context + [3, 4], 2, scores, sample=False) == ([5, 0], None)  # k without costless_k
    runner.passes = 0
    assert hybrid.propose([3, 4, 7], 3, scores, sample=False) == ([0, 1, 2], None)  # never matches: k drafts
    assert runner.passes == 3 and hybrid.extended_tokens() == 0


def test_sampling_with_lookup_ended_chains_follows_the_target_distribution():
    """Rejection sampling over hybrid chains that prompt lookup ends (one-hot rows) keeps the target's
    distribution: the first 3 tokens of 4000 sampled requests over a 3-token vocabulary against the exact
    probabilities (TV over 27 sequences: null about sqrt(27 / (2 pi 4000)) = 0.03, seeds 0-2 gave 0.026-0.039;
    uniform rows in place of the one-hot ones give 0.079)."""
    import itertools

    from xpuspec.runner import Runner
    from xpuspec.speculative.drafters import HybridDrafter, ModelDrafter

    vocab, prompt = 3, [0, 1, 2, 0, 1]

    def target(prefix):
        return torch.softmax(torch.tensor([((prefix[-2] * 7 + prefix[-1] * 3 + j * 5) % 11) / 4.0
                                           for j in range(vocab)]), -1)

    class Draft(Runner):
        device, vocab_size, weight_bytes, num_layers = "cpu", vocab, 0, 1

        def __init__(self):
            self.seq = []

        @property
        def length(self):
            return len(self.seq)

        def forward(self, tokens, logits_to_keep=None):
            self.seq += list(tokens)
            return torch.tensor([[((self.seq[-1] * 5 + j * 2) % 7) / 3.0 for j in range(vocab)]])

        def rollback(self, n):
            del self.seq[len(self.seq) - n:]

        def reset(self):
            self.seq = []

    hybrid = HybridDrafter(PromptLookupDrafter(3, 3), ModelDrafter(Draft(), vocab))
    ended, extension = [], hybrid.extension.lookup

    def counted(prefix, n):
        found = extension(prefix, n)
        ended.extend(found[:1])
        return found

    hybrid.extension.lookup = counted
    torch.manual_seed(0)
    counts, trials = {}, 4000
    for _ in range(trials):
        context, out = list(prompt), []
        hybrid.reset()
        while len(out) < 3:
            drafts, probs = hybrid.propose(context, 4, lambda prefix, logits: logits, sample=True)
            p = torch.stack([target(context + drafts[:i]) for i in range(len(drafts) + 1)])
            n, token = rejection_sample(drafts, probs, p)
            for t in (drafts[:n] + [token])[:3 - len(out)]:
                out.append(t)
                context.append(t)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert len(ended) > trials / 4  # the path under test ran
    tv = 0.0
    for seq in itertools.product(range(vocab), repeat=3):
        exact, prefix = 1.0, list(prompt)
        for t in seq:
            exact *= float(target(prefix)[t])
            prefix.append(t)
        tv += 0.5 * abs(counts.get(seq, 0) / trials - exact)
    assert tv < 0.06


def test_the_first_token_comes_before_the_draft_models_prefill(tiny_pair):
    """The target's prefill alone gives the first token: the draft model prefills once drafting begins (TTFT
    without the draft's prefill, as openvino_genai's speculative pipeline); the output stays the plain output."""
    target, draft = tiny_pair
    events = []

    class Streamer:
        def put(self, value):
            events.append(("token", value.numel()))

        def end(self):
            pass

    forward, rollback = draft.runner.forward, draft.runner.rollback
    draft.runner.forward = lambda tokens, logits_to_keep=None: events.append(("draft", len(tokens))) or forward(
        tokens, logits_to_keep)
    draft.runner.rollback = lambda n: (events.append(("rollback", n)) if n else None) or rollback(n)
    ids = torch.tensor([[1, 5, 6, 7, 5, 6]])
    try:
        out = target.generate(input_ids=ids, max_new_tokens=6, do_sample=False, streamer=Streamer())
        calls = len(events)
        target.generate(input_ids=ids, max_new_tokens=2, do_sample=False)  # no round can hold a draft
        assert len(events) == calls  # so the draft never prefills
    finally:
        del draft.runner.forward, draft.runner.rollback
    assert torch.equal(out, target.generate(input_ids=ids, max_new_tokens=6, do_sample=False, speculative=False))
    assert events[:2] == [("token", 6), ("token", 1)]  # the prompt, then the first new token
    assert events[2:4] == [("draft", 6), ("draft", 1)]  # the draft's prefill, then its first step: nothing fed twice


def test_an_overlapped_draft_model_starts_before_the_prefill_also_in_a_hybrid(tiny_pair):
    """Only a draft model computing in its own thread prefills beside the target's prefill."""
    target, draft = tiny_pair
    model = ModelDrafter(draft.runner, target.runner.vocab_size)
    lookup = PromptLookupDrafter(3, 3)
    assert not model.starts_before_prefill and not HybridDrafter(lookup, model).starts_before_prefill
    assert HybridDrafter(lookup, OverlappedDrafter(model)).starts_before_prefill


def test_a_draft_prefills_only_its_context_length(tiny_pair):
    """A draft model started with context_length=4 on a 9-token context prefills its last 4 tokens and follows
    every token after: it proposes what the same draft proposes when the request starts at those 4 tokens."""
    target, draft = tiny_pair
    context, score = [1, 5, 6, 7, 5, 6, 2, 3, 4], (lambda prefix, logits: logits)
    windowed = ModelDrafter(draft.runner, target.runner.vocab_size, context_length=4)
    windowed.start(context, score, False)
    assert draft.runner.length == 4
    ahead = windowed.propose(context + [5], 3, score, False)[0]
    assert windowed.tokens == context[-4:] + [5] + ahead[:-1]
    alone = ModelDrafter(draft.runner, target.runner.vocab_size)
    alone.start(context[-4:], score, False)
    assert alone.propose(context[-4:] + [5], 3, score, False)[0] == ahead
    windowed.start(context[:3], score, False)  # a context shorter than the length: all of it
    assert draft.runner.length == 3


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_bad_draft_context_lengths_are_refused_by_name(value):
    with pytest.raises(SpeculativeConfigError, match="draft_context_length"):
        SpeculativeConfig(mode="hybrid", draft_context_length=value)
    with pytest.raises(SpeculativeConfigError, match="draft_context_length"):
        SpeculativeConfig(mode="prompt_lookup", draft_context_length=8)


@pytest.mark.parametrize("target_uses, draft_uses, inside", [(False, None, 1), (True, None, 2), (False, True, 2),
                                                             (False, False, 1)])
def test_the_loop_runs_torch_on_one_thread_unless_a_runner_computes_with_its_threads(target_uses, draft_uses, inside):
    """Where no runner of a request computes with torch's threads (OpenVINO), decode() runs torch on one thread
    (its OpenMP threads would compete with the backend's), and restores the count afterwards."""
    from transformers import GenerationConfig

    from xpuspec.decode import decode
    from xpuspec.generation import resolve_generation_config
    from xpuspec.runner import Runner

    class Successor(Runner):
        """The next token is the last + 1 (mod 8); notes torch's thread count during each pass."""
        device, vocab_size, weight_bytes, num_layers = "cpu", 8, 0, 1

        def __init__(self, uses_torch_threads):
            self.uses_torch_threads, self.held, self.seen = uses_torch_threads, 0, set()

        @property
        def length(self):
            return self.held

        def forward(self, tokens, logits_to_keep=None):
            self.seen.add(torch.get_num_threads())
            self.held += len(tokens)
            rows = torch.tensor(list(tokens)[-(logits_to_keep or len(tokens)):])
            return torch.nn.functional.one_hot((rows + 1) % 8, 8).float() * 50

        def rollback(self, n):
            self.held -= n

        def reset(self):
            self.held = 0

    target = Successor(target_uses)
    draft = None if draft_uses is None else Successor(draft_uses)
    drafter = None if draft is None else ModelDrafter(draft, vocab_size=8)
    config = resolve_generation_config(GenerationConfig(), None, dict(max_new_tokens=6, do_sample=False))
    torch.set_num_threads(2)
    try:
        assert decode(target, [1, 2], config, drafter=drafter)[0] == [3, 4, 5, 6, 7, 0]
        assert target.seen == {inside} and (draft is None or draft.seen == {inside})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
