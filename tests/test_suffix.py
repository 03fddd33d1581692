"""SuffixDecoding: the suffix structure against a brute-force search, its scoring on hand-made cases, the
global cache's bound, eviction and file, and the drafter against a fake target (no model)."""

import inspect
import random
import struct
import textwrap
import warnings

import pytest

from xpuspec.errors import SpeculativeConfigError
from xpuspec.speculative import suffix_cache
from xpuspec.speculative.suffix import Candidate, SpeculationLimits, SuffixAutomaton
from xpuspec.speculative.suffix_cache import SuffixCache, SuffixCacheWarning
from xpuspec.speculative.drafters import Draft, DraftRequest
from xpuspec.speculative.policy import Widths
from xpuspec.speculative.suffix_drafter import (SHARED_MIN_ACCEPTANCE, SHARED_PATIENCE,
                                                SuffixDrafter)

LIMITS = SpeculationLimits()


def brute_force(texts, pattern, k, depth, limits):
    """The scoring of :mod:`xpuspec.speculative.suffix` by scanning every occurrence: for each match length m,
    follow the most frequent continuation (ties: seen last) of all occurrences followed by a token."""
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text) + 1  # each sequence is followed by an end marker
    best = Candidate()
    for m in range(1, min(len(pattern), depth) + 1):
        s = list(pattern[-m:])
        tokens, probs, end, prob = [], [], -1, 1.0
        for _ in range(limits.cap(m, k, depth)):
            counts, last = {}, {}
            for offset, text in zip(offsets, texts):
                for i in range(len(text) - len(s)):
                    if text[i:i + len(s)] == s:
                        t = text[i + len(s)]
                        counts[t] = counts.get(t, 0) + 1
                        last[t] = max(last.get(t, -1), offset + i + len(s))
            if not counts:
                break
            t = max(counts, key=lambda t: (counts[t], last[t]))
            prob *= counts[t] / sum(counts.values())
            if prob < limits.min_token_prob:
                break
            tokens.append(t)
            probs.append(prob)
            end = last[t]
            s.append(t)
        if tokens and sum(probs) >= best.score:  # increasing m: ties go to the longer match
            best = Candidate(tuple(tokens), tuple(probs), sum(probs), m, end)
    return best


def automaton(texts, depth):
    a = SuffixAutomaton(depth)
    for text in texts:
        a.extend(text)
        a.separate()
    return a


def random_limits(rng):
    return SpeculationLimits(rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 1.0, -1.0]), rng.choice([0.0, 0.1, 0.3]))


@pytest.mark.parametrize("seed", range(200))
def test_random_texts_match_brute_force(seed):
    """Random texts over 2..20 symbols: a request's structure extended in chunks (its own end as the pattern), and
    a structure over several sequences queried with foreign patterns, equal the brute force exactly (tokens,
    probabilities, score, match length, position)."""
    rng = random.Random(seed)
    vocab, depth, k = rng.choice([2, 3, 5, 20]), rng.choice([2, 3, 4, 8, 32]), rng.choice([1, 3, 10])
    limits = random_limits(rng)
    context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    own, i = SuffixAutomaton(depth), 0
    while i < len(context):
        j = min(len(context), i + rng.randrange(1, 8))
        own.extend(context[i:j])
        i = j
        assert own.speculate_tail(k, limits) == brute_force([context[:i]], context[:i], k, depth, limits)
    texts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(rng.randrange(1, 5))]
    shared = automaton(texts, depth)
    for _ in range(3):
        pattern = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        assert shared.speculate(pattern, k, limits) == brute_force(texts, pattern, k, depth, limits)


@pytest.mark.parametrize("seed", range(20))
def test_counts_match_brute_force(seed):
    rng = random.Random(seed)
    texts = [[rng.randrange(3) for _ in range(rng.randrange(0, 40))] for _ in range(3)]
    depth = rng.choice([2, 5, 16])
    a = automaton(texts, depth)
    for m in range(1, depth + 1):
        for _ in range(10):
            s = [rng.randrange(3) for _ in range(m)]
            expected = sum(t[i:i + m] == s for t in texts for i in range(len(t) - m + 1))
            assert a.occurrences(s) == expected


def _real_sources():
    """Real text: standard-library source and documentation."""
    import colorsys
    import textwrap as tw

    import pydoc_data.topics

    return [inspect.getsource(colorsys), inspect.getsource(tw)[:6000], pydoc_data.topics.topics["for"]]


def test_real_texts_match_brute_force(tokenizer):
    """SmolLM2's tokens of stdlib source and docs: a request's structure at many points of its growth, and a
    structure over the other texts queried with each text's prefixes."""
    texts = [tokenizer(t).input_ids[:1200] for t in _real_sources()]
    depth, k = 24, 10
    for n, text in enumerate(texts):
        own = SuffixAutomaton(depth)
        points = set(range(40, len(text), len(text) // 6))
        others = [t for i, t in enumerate(texts) if i != n]
        shared = automaton(others, depth)
        for i, token in enumerate(text, 1):
            own.extend([token])
            if i in points:
                assert own.speculate_tail(k, LIMITS) == brute_force([text[:i]], text[:i], k, depth, LIMITS)
                assert shared.speculate(text[:i], k, LIMITS) == brute_force(others, text[:i], k, depth, LIMITS)
        assert own.states <= 2 * len(text)


def test_real_text_copy_drafts_its_source(tokenizer):
    """A request that starts rewriting a function in its prompt drafts the prompt's next lines."""
    source = tokenizer(inspect.getsource(textwrap.dedent)).input_ids
    own = SuffixAutomaton()
    own.extend(source + source[:40])
    draft = own.speculate_tail(10, LIMITS)
    assert list(draft.tokens) == source[40:50] and draft.match_len >= 10


# ---- frequency scoring on hand-made cases (letters as tokens) ----

def _ids(text):
    return [ord(c) for c in text]


def test_most_frequent_continuation_and_its_probability():
    a = automaton([_ids("abc"), _ids("abc"), _ids("abd")], 8)
    draft = a.speculate(_ids("xab"), 5, LIMITS)
    assert draft.tokens == (ord("c"),) and draft.probs == (2 / 3,) and draft.match_len == 2  # 'abc' ends: no more


def test_ties_go_to_the_continuation_seen_last():
    assert automaton([_ids("abc"), _ids("abd")], 8).speculate(_ids("ab"), 1, LIMITS).tokens == (ord("d"),)
    assert automaton([_ids("abd"), _ids("abc")], 8).speculate(_ids("ab"), 1, LIMITS).tokens == (ord("c"),)


def test_length_is_capped_by_factor_times_match():
    a = automaton([_ids("qwertyuiop")], 32)
    assert len(a.speculate(_ids("we"), 10, LIMITS).tokens) == 2  # MAX_SPEC = 1.0 * 2
    assert len(a.speculate(_ids("we"), 10, SpeculationLimits(max_spec_factor=2.0)).tokens) == 4
    assert len(a.speculate(_ids("we"), 10, SpeculationLimits(max_spec_offset=3)).tokens) == 5
    assert len(a.speculate(_ids("qwer"), 3, LIMITS).tokens) == 3  # and by k
    # and by the depth: with max_depth 6 a match of m tokens drafts at most 6 - m, so 'wer' drafts 3 and 'qwer' 2
    assert automaton([_ids("qwertyuiop")], 6).speculate(_ids("qwer"), 10, LIMITS).tokens == tuple(_ids("tyu"))


def test_probability_floor_stops_the_draft():
    # after 'ab': c 3 times of 4 (0.75); 'abc' goes on with d, e or f, each once: f, seen last (0.75 / 3)
    a = automaton([_ids("abcd"), _ids("abce"), _ids("abcf"), _ids("abz")], 8)
    draft = a.speculate(_ids("ab"), 5, SpeculationLimits(max_spec_factor=3))
    assert draft.tokens == tuple(_ids("cf")) and draft.probs == pytest.approx((0.75, 0.25))
    assert a.speculate(_ids("ab"), 5, SpeculationLimits(max_spec_factor=3, min_token_prob=0.3)).tokens == (ord("c"),)


def test_the_best_scoring_match_length_wins():
    # 'xab' goes on only as 'cd' (score 2); 'ab' and 'b' as q, 3 times of 4 (0.75)
    a = automaton([_ids("xabcd"), _ids("yabq"), _ids("yabq"), _ids("yabq")], 8)
    draft = a.speculate(_ids("xab"), 2, LIMITS)
    assert draft.tokens == tuple(_ids("cd")) and draft.match_len == 3 and draft.score == 2.0
    # 'pza' (and 'za') goes on as b or c, half the time each (0.5); 'a' alone as k, 3 times of 5 (0.6)
    assert automaton([_ids("pzab"), _ids("pzac")], 8).speculate(_ids("pza"), 1, LIMITS).probs == (0.5,)
    b = automaton([_ids("pzab"), _ids("pzac"), _ids("akkk"), _ids("akkk"), _ids("akkk")], 8)
    draft = b.speculate(_ids("pza"), 1, LIMITS)
    assert draft.tokens == (ord("k"),) and draft.match_len == 1 and draft.probs == (0.6,)


def test_ends_of_text_and_sequences_have_no_continuation():
    own = SuffixAutomaton(8)
    own.extend(_ids("abab"))
    assert own.speculate_tail(4, LIMITS).tokens == tuple(_ids("ab"))  # 'ab' at the end continues nothing
    assert automaton([_ids("ab"), _ids("ab")], 8).speculate(_ids("ab"), 4, LIMITS) == Candidate()
    assert automaton([_ids("ab")], 8).speculate(_ids("a"), 4, LIMITS).tokens == (ord("b"),)


def test_bad_settings_are_refused():
    with pytest.raises(SpeculativeConfigError):
        SuffixAutomaton(1)
    with pytest.raises(SpeculativeConfigError):
        SpeculationLimits(min_token_prob=1.5).check()
    with pytest.raises(SpeculativeConfigError):
        SuffixCache("", 100)
    with pytest.raises(SpeculativeConfigError):
        SuffixCache("m", 1)
    with pytest.raises(ValueError, match=">= 0"):
        SuffixAutomaton().extend([3, -1])
    cache = SuffixCache("m", 100)
    with pytest.raises(ValueError, match=">= 0"):
        cache.add([1, -5])
    assert len(cache) == 0
    drafter = SuffixDrafter(cache)
    drafter.begin(DraftRequest([1, 2, 3], None, False))
    assert drafter.propose(Widths(0, 4)).tokens == []
    with pytest.raises(ValueError, match="0..0"):
        drafter.accept(1)


# ---- the global cache: bound, least-recently-used eviction, file ----

def test_eviction_keeps_the_bound_and_the_recently_used():
    rng = random.Random(0)
    cache = SuffixCache("m", max_tokens=500, max_depth=16)
    for i in range(200):
        cache.add([rng.randrange(50) for _ in range(rng.randrange(1, 120))])
        assert len(cache) <= 500 and cache.states <= 2 * len(cache) + 1
    assert cache.outputs < 200
    # a used output survives evictions that take older, unused ones
    cache = SuffixCache("m", max_tokens=100, max_depth=16)
    keep = list(range(1000, 1020))
    cache.add(keep)
    for i in range(12):
        draft = cache.speculate(keep[:5], 5, LIMITS)
        assert draft.tokens == tuple(keep[5:10])
        cache.touch(draft.end)
        cache.add([i] * 20)
    assert cache.speculate(keep[:5], 5, LIMITS).tokens == tuple(keep[5:10])
    assert cache.speculate([0, 0, 0], 3, LIMITS) == Candidate()  # the first filler went long ago


def test_a_long_output_keeps_its_end():
    cache = SuffixCache("m", max_tokens=100)
    cache.add(list(range(500)))
    assert len(cache) <= 100 and cache.speculate([480, 481], 2, LIMITS).tokens == (482, 483)


def test_file_round_trip(tmp_path):
    rng = random.Random(1)
    cache = SuffixCache("org/model@rev", max_tokens=1000, cache_dir=tmp_path)
    outputs = [[rng.randrange(30) for _ in range(40)] for _ in range(5)]
    for o in outputs:
        cache.add(o)
    (saved,) = tmp_path.iterdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = SuffixCache("org/model@rev", max_tokens=1000, cache_dir=tmp_path)
    assert again.outputs == 5 and len(again) == len(cache)
    for o in outputs:
        assert again.speculate(o[:12], 10, LIMITS) == cache.speculate(o[:12], 10, LIMITS)
    assert SuffixCache("another/model", max_tokens=1000, cache_dir=tmp_path).outputs == 0  # its own file
    assert len(list(tmp_path.iterdir())) == 1 and saved.stat().st_size < 4 * 1000 + 200


def _spoil(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[:len(data) // 2]
    elif how == "corrupt":
        data[len(data) // 2] ^= 0xFF
    elif how == "version":
        data[8:12] = struct.pack("<I", suffix_cache.FORMAT_VERSION + 1)
    elif how == "garbage":
        data = bytearray(b"not a cache at all")
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "corrupt", "version", "garbage", "empty", "over bound"])
def test_unusable_file_warns_once_and_rebuilds(tmp_path, how):
    cache = SuffixCache("m", max_tokens=1000, cache_dir=tmp_path)
    for i in range(4):
        cache.add(list(range(i, i + 100)))
    if how == "over bound":
        max_tokens = 200
    else:
        max_tokens = 1000
        _spoil(cache.path, how)
    with pytest.warns(SuffixCacheWarning) as caught:
        rebuilt = SuffixCache("m", max_tokens=max_tokens, cache_dir=tmp_path)
    assert len(caught) == 1 and rebuilt.outputs == 0 and len(rebuilt) == 0
    rebuilt.add([7, 8, 9, 10])  # the next save replaces the bad file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = SuffixCache("m", max_tokens=max_tokens, cache_dir=tmp_path)
    assert again.speculate([7, 8], 2, LIMITS).tokens == (9, 10)


def test_file_saved_for_another_model_is_not_read(tmp_path):
    cache = SuffixCache("model-a", max_tokens=1000, cache_dir=tmp_path)
    cache.add([1, 2, 3])
    (tmp_path / suffix_cache._file_name("model-b")).write_bytes(cache.path.read_bytes())
    with pytest.warns(SuffixCacheWarning, match="model-a"):
        assert SuffixCache("model-b", max_tokens=1000, cache_dir=tmp_path).outputs == 0


# ---- the drafter against a fake target ----

class NgramTarget:
    """A deterministic "model": its greedy next token is a fixed random function of the last ``n`` tokens."""

    def __init__(self, seed, vocab=12, n=3):
        self.rng, self.vocab, self.n, self.table = random.Random(seed), vocab, n, {}

    def __call__(self, context):
        key = tuple(context[-self.n:])
        if key not in self.table:
            self.table[key] = self.rng.randrange(self.vocab)
        return self.table[key]

    def plain(self, prompt, max_new):
        context = list(prompt)
        for _ in range(max_new):
            context.append(self(context))
        return context[len(prompt):]


def run(drafter, target, prompt, max_new, k=8):
    """Greedy speculative decoding with ``drafter`` on ``target``: (output, target passes). The loop owns the
    context list and appends to it in place, as the engine does."""
    context = list(prompt)
    request = DraftRequest(context, None, False)
    drafter.begin(request)
    passes = 0
    while len(context) - len(prompt) < max_new:
        before = list(context)
        draft = drafter.propose(Widths(0, k))
        assert isinstance(draft, Draft) and draft.probs is None and draft.free == len(draft.tokens) <= k
        assert context == before and request.context is context  # the drafter read the context, never wrote it
        passes += 1
        kept = 0
        for token in draft.tokens:
            if len(context) - len(prompt) >= max_new or target(context) != token:
                break
            context.append(token)
            kept += 1
        if len(context) - len(prompt) < max_new:
            context.append(target(context))
        drafter.accept(kept)
    drafter.end()
    return context[len(prompt):], passes


def test_share_needs_a_cache():
    with pytest.raises(SpeculativeConfigError, match="share_across_requests"):
        SuffixDrafter(None)
    SuffixDrafter(None, share_across_requests=False)


def test_output_is_the_targets_and_a_session_drafts_from_earlier_outputs():
    """8 prompts, then a 5-request session asking the same question after another preamble each time (the target
    answers alike): every output equals plain greedy, and the session's later requests draft the earlier answer
    from the cache in a fraction of the target passes."""
    target = NgramTarget(0)
    rng = random.Random(0)
    private, shared = SuffixDrafter(None, share_across_requests=False), SuffixDrafter(SuffixCache("fake", 4096))
    for _ in range(8):
        prompt = [rng.randrange(12) for _ in range(rng.randrange(3, 30))]
        for drafter in (private, shared):
            assert run(drafter, target, prompt, 48)[0] == target.plain(prompt, 48)
    base, passes = [rng.randrange(12) for _ in range(20)], {}
    for name, drafter in (("private", SuffixDrafter(None, share_across_requests=False)),
                          ("shared", SuffixDrafter(SuffixCache("fake", 4096)))):
        passes[name] = []
        for turn in range(5):
            prompt = [turn, (turn * 5) % 12] * (turn + 1) + base
            output, n = run(drafter, target, prompt, 64)
            assert output == target.plain(prompt, 64)
            passes[name].append(n)
    # a draft grows with its match (MAX_SPEC = p): 1, 3, 7, then k = 8 tokens a pass
    assert all(p <= 10 < passes["private"][i + 1] / 2 for i, p in enumerate(passes["shared"][1:])), passes


def test_per_request_state_does_not_outlive_its_request():
    """llama.cpp#27852 replay, first half: a slot's per-request table kept across requests, so a shorter follow-up
    prompt drafted from the request before. Here the second request ends with a 3-gram that only the first
    request's prompt continued; its drafter (reused, not sharing) must draft nothing from it."""
    drafter = SuffixDrafter(SuffixCache("fake", 4096), share_across_requests=True)
    first_prompt = [1, 2, 3] + list(range(20, 60))
    context = list(first_prompt)
    drafter.begin(DraftRequest(context, None, False))
    drafter.end()  # an empty output: nothing of the first prompt reaches the cache
    second = [9, 9, 1, 2, 3]
    drafter.begin(DraftRequest(list(second), None, False))
    assert drafter.propose(Widths(0, 8)).tokens == []
    # and a longer follow-up prompt is indexed from its start (not from where the last request's index ended)
    third = [5, 6, 7, 8, 1, 2, 3] + list(range(40, 80)) + [5, 6, 7]
    drafter.begin(DraftRequest(list(third), None, False))
    assert drafter.propose(Widths(0, 8)).tokens == [8, 1, 2]


def test_failing_shared_drafts_stop_and_acceptance_does_not_collapse():
    """llama.cpp#27852 replay, second half: state from earlier unrelated requests made acceptance fall from 86% to
    11%, slower than no speculation. A cache full of one target's outputs drafts for requests to unrelated targets
    (same vocabulary, other continuations): each request stops drafting from the cache after a few failures and
    needs no more target passes than drafting from its own text alone; the next request of the first kind drafts
    from the cache again."""
    first = NgramTarget(1, vocab=6)
    drafter = SuffixDrafter(SuffixCache("fake", 1 << 14))
    rng = random.Random(3)
    prompts = [[rng.randrange(6) for _ in range(8)] for _ in range(12)]
    for prompt in prompts:
        run(drafter, first, prompt, 96)
    stopped = 0
    for i, prompt in enumerate(prompts[:6]):
        other = NgramTarget(100 + i, vocab=6, n=4)
        output, with_cache = run(drafter, other, prompt[::-1], 96)
        assert output == other.plain(prompt[::-1], 96)
        stats = drafter.stats
        assert stats.shared_drafts <= SHARED_PATIENCE + 2, stats
        assert stats.shared_stopped or stats.shared_accepted >= SHARED_MIN_ACCEPTANCE * stats.shared_tokens, stats
        stopped += stats.shared_stopped
        _, alone = run(SuffixDrafter(None, share_across_requests=False), other, prompt[::-1], 96)
        assert with_cache <= alone + 2
    assert stopped >= 4
    run(drafter, first, prompts[0], 96)
    stats = drafter.stats
    assert not stats.shared_stopped and stats.shared_accepted >= 0.8 * stats.shared_tokens > 0, stats


def test_not_sharing_keeps_requests_apart():
    """With share_across_requests=False no token of one request's output is drafted in another."""
    cache = SuffixCache("fake", 4096)
    drafter = SuffixDrafter(cache, share_across_requests=False)
    target = NgramTarget(4)
    run(drafter, target, [1, 2, 3], 64)
    assert cache.outputs == 0
    context = [1, 2, 3]
    drafter.begin(DraftRequest(context, None, False))
    assert drafter.propose(Widths(0, 8)).tokens == []


# ---- sampling with suffix drafts ----

def test_sampling_with_suffix_drafts_follows_the_target_distribution():
    """Rejection sampling over suffix drafts (deterministic, so one-hot draft rows) keeps the target's distribution:
    the first 3 tokens of 4000 sampled requests over a 3-token vocabulary, drafted from the request's own text and
    from a cache of earlier outputs, against the exact probabilities (TV over 27 sequences: null about
    sqrt(27 / (2 pi 4000)) = 0.03)."""
    import torch

    from fakes import total_variation
    from xpuspec.speculative.verify import rejection_sample

    vocab, prompt = 3, [0, 1, 2, 0, 1, 2, 0, 1]

    def target(prefix):
        return torch.softmax(torch.tensor([((prefix[-2] * 7 + prefix[-1] * 3 + j * 5) % 11) / 4.0
                                           for j in range(vocab)]), -1)

    cache = SuffixCache("fake", 4096)
    for _ in range(3):
        cache.add([2, 0, 1, 1, 2, 2, 0, 0, 1])
    drafter = SuffixDrafter(cache, share_across_requests=True)
    torch.manual_seed(0)
    counts, trials, drafted, shared = {}, 4000, 0, 0
    for _ in range(trials):
        context, out = list(prompt), []
        drafter.begin(DraftRequest(context, None, True))
        while len(out) < 3:
            draft = drafter.propose(Widths(0, 4))
            assert draft.probs is None
            drafted += len(draft.tokens)
            p = torch.stack([target(context + draft.tokens[:i]) for i in range(len(draft.tokens) + 1)])
            n, token = rejection_sample(draft.tokens, draft.probs, p)
            drafter.accept(n)
            for t in (draft.tokens[:n] + [token])[:3 - len(out)]:
                out.append(t)
                context.append(t)
        shared += drafter.stats.shared_drafts
        drafter.end()
        cache.clear()  # every trial sees the same cache (a trial's output would otherwise join it)
        for _ in range(3):
            cache.add([2, 0, 1, 1, 2, 2, 0, 0, 1])
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert drafted > trials and shared > trials / 4  # both sources drafted
    assert total_variation(counts, trials, target, prompt, vocab) < 0.06


# ---- the real model: greedy identity over a session ----

#: Five questions over one document, each request repeating the document and every earlier answer.
SESSION_QUESTIONS_5 = ("What does the statement described in the text do? Answer in one sentence.",
                       "Quote the first sentence of the text exactly.",
                       "Which Python keywords does the text name? List them.",
                       "Quote the first sentence of the text exactly, once more.",
                       "Summarise the text in two sentences.")


@pytest.mark.parametrize("mode", ["suffix", "suffix_hybrid"])
def test_a_five_request_session_on_smollm2_is_plain_greedy(smollm2_path, tokenizer, mode):
    """A 5-request session on SmolLM2 (each prompt holds the document and the earlier answers, decoded from the
    plain greedy outputs): every speculative output is the plain greedy output token for token, the model's cache
    holds the session's outputs, and later requests draft."""
    import pydoc_data.topics
    import torch

    from xpuspec import AutoModelForCausalLM, SpeculativeConfig

    spec = SpeculativeConfig(mode=mode, cost_model=False)
    model = AutoModelForCausalLM.from_pretrained("smollm2-135m-instruct", device="cpu", load_in_low_bit="int8_asym",
                                                 speculative=spec)
    model.suffix_cache().clear()
    document = pydoc_data.topics.topics["for"][:1000]
    history, drafted = "", []
    for question in SESSION_QUESTIONS_5:
        text = f"Read the text, then answer each question.\n\nText:\n{document}\n\n{history}Question: {question}\nAnswer:"
        ids = tokenizer(text, return_tensors="pt").input_ids
        plain = model.generate(ids, max_new_tokens=32, do_sample=False, speculative=False)
        spec_out = model.generate(ids, max_new_tokens=32, do_sample=False)
        assert torch.equal(spec_out, plain), (question, tokenizer.decode(plain[0, ids.shape[1]:]),
                                              tokenizer.decode(spec_out[0, ids.shape[1]:]))
        drafted.append(model.last_generate_stats.drafted_tokens)
        answer = tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True)
        history += f"Question: {question}\nAnswer: {answer.strip()}\n\n"
    assert model.suffix_cache().outputs == 5 and sum(drafted[1:]) > 20, drafted
