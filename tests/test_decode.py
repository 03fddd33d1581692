"""The decode loop (xpuspec.decode) on tiny random models and rule-based runners: sampled speculation follows
plain sampling, padded steps carry a free guess, the first token comes before the draft's prefill, drafts accepted
past the end are not counted, stop strings cut where plain decoding would, and torch runs on one thread beside
other backends."""

import pytest
import torch
from transformers import GenerationConfig

from xpuspec import AutoModelForCausalLM
from xpuspec.engine import decode
from xpuspec.generation import resolve_generation_config
from xpuspec.runner import RunnerTraits
from xpuspec.speculative.drafters import ModelDrafter, PromptLookupDrafter
from xpuspec.speculative.policy import SpeculationPolicy
from xpuspec.speculative.schedule import DraftSchedule

from fakes import Successor
from test_verify import tv
from tiny import WORDS, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**kwargs):
    return resolve_generation_config(GenerationConfig(), None, dict(do_sample=False, **kwargs))


def _policy(schedule=DraftSchedule(cost_model=False), uses_model=True):
    return SpeculationPolicy(uses_model).begin(schedule, None, with_model=uses_model)


def test_sampled_speculation_matches_plain_sampling_on_tiny_models(tiny_pair):
    """End to end: the 2nd and 3rd sampled tokens (the first drafted round; the 1st comes from prefill) have the
    same joint distribution with the draft model as with plain sampling (TV over the 16 x 16 pairs, N=1500 each)."""
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
    assert tv(plain, spec) < 0.12  # null ~ sqrt(256 / (2 pi 1500)) = 0.05 at most for 256 cells


def test_padded_steps_carry_a_guess_and_keep_the_output(tmp_path, monkeypatch):
    """A target whose 1-token steps run 2 wide (set by hand on a tiny torch model here) gets a free guess from
    prompt lookup in the second slot of every round without drafts: plain greedy output unchanged, the guesses
    counted apart from drafts, none under sampling."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "t", seed=4), device="cpu", backend="torch")
    ids = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]])
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert plain.shape[1] == ids.shape[1] + 24 and model.last_generate_stats.guessed_tokens == 0
    monkeypatch.setattr(model.runner, "traits", RunnerTraits(single_step_width=2, uses_torch_threads=True))
    assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False), plain)
    stats = model.last_generate_stats
    assert stats.guessed_tokens > 0 and stats.drafted_tokens == 0
    # each accepted guess saves a pass (but one that comes with the last token)
    assert 1 + 23 - stats.guesses_accepted <= stats.target_forwards < 1 + 23
    torch.manual_seed(0)
    model.generate(ids, max_new_tokens=8, do_sample=True)
    assert model.last_generate_stats.guessed_tokens == 0


def test_the_first_token_comes_before_the_draft_models_prefill():
    """The target's prefill alone gives the first token: the draft model prefills once drafting begins (TTFT
    without the draft's prefill); a request with no room for a draft never prefills it."""
    events = []

    class Streamer:
        def put(self, value):
            events.append(("token", value.numel()))

        def end(self):
            pass

    class Draft(Successor):
        def forward(self, tokens, logits_to_keep=None, exact=True):
            events.append(("draft", len(tokens)))
            return super().forward(tokens, logits_to_keep, exact)

    draft = Draft(8)
    new = decode(Successor(8), [1, 5, 6, 7, 5, 6], _config(max_new_tokens=6), Streamer(), ModelDrafter(draft, 8),
                 _policy(DraftSchedule(num_assistant_tokens=2, schedule="constant", cost_model=False)))[0]
    assert new == [7, 0, 1, 2, 3, 4]
    assert events[:3] == [("token", 1), ("draft", 7), ("draft", 1)]  # the first token, the draft's prefill, a step
    events.clear()
    decode(Successor(8), [1, 5], _config(max_new_tokens=1), None, ModelDrafter(draft, 8), _policy())
    assert events == []


def test_drafts_accepted_past_eos_are_not_counted():
    """EOS at new token 4 inside an accepted block: 4 new tokens, and only the drafts among them count."""
    target, draft = Successor(16), Successor(16)
    schedule = DraftSchedule(num_assistant_tokens=8, schedule="constant", cost_model=False)
    config = _config(max_new_tokens=20, eos_token_id=6)
    new, _, _, stats = decode(target, [1, 2], config, None, ModelDrafter(draft, 16), _policy(schedule))
    assert new == [3, 4, 5, 6]  # the first from the prefill, then a round whose drafts 4, 5, 6 end at EOS
    assert stats.new_tokens == 4 and stats.drafted_tokens == 8 and stats.accepted_tokens == 3
    assert stats.acceptance_counts.judged[:3] == [1, 1, 1]


def test_stop_strings_cut_where_plain_decoding_stops(tiny_pair):
    """transformers' stop_strings with tokenizer=: the output ends with the token that completes the string, with
    prompt lookup drafting blocks past it, exactly where plain decoding ends."""
    from xpuspec import AutoTokenizer, GenerationConfigError

    target, _ = tiny_pair
    tokenizer = AutoTokenizer.from_pretrained(target.source.path)
    ids = torch.tensor([[1, 3, 4, 5, 6, 3, 4, 5]])
    free = target.generate(ids, max_new_tokens=16, do_sample=False, speculative=False)[0, ids.shape[1]:].tolist()
    words = tokenizer.decode(free).split()
    stop = " ".join(words[2:4])  # two words in, split over two tokens
    for kwargs in (dict(speculative=False), dict(prompt_lookup_num_tokens=4), {}):
        out = target.generate(ids, max_new_tokens=16, do_sample=False, stop_strings=stop, tokenizer=tokenizer, **kwargs)
        assert out[0, ids.shape[1]:].tolist() == free[:4], kwargs
    with pytest.raises(GenerationConfigError, match="pass tokenizer= to generate"):
        target.generate(ids, max_new_tokens=4, stop_strings=["x"])


@pytest.mark.parametrize("prompt, stop", [("1\n2\n3\n4", "\n"), (
    "def add(a, b):\n    result = a + b\n    return result\n\n\ndef sub(a, b):\n    result = a - b\n    return", "result")])
def test_a_stop_string_the_prompt_already_holds_still_stops(ov_int8, tokenizer, prompt, stop):
    """A stop string that also occurs in the prompt's last tokens stops where transformers' StopStringCriteria first
    fires on the same tokens (it used to be ignored while the earlier occurrence stayed in the window)."""
    from transformers.generation import StopStringCriteria

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    free = ov_int8.generate(ids, max_new_tokens=16, do_sample=False, speculative=False)[0].tolist()
    criteria = StopStringCriteria(tokenizer, [stop])
    ends = [n for n in range(ids.shape[1] + 1, len(free) + 1)
            if bool(criteria(torch.tensor([free[:n]]), None)[0])]
    assert ends, "the stop string should occur in the free output"
    for kwargs in (dict(speculative=False), dict(prompt_lookup_num_tokens=4)):
        out = ov_int8.generate(ids, max_new_tokens=16, do_sample=False, stop_strings=stop, tokenizer=tokenizer,
                               **kwargs)
        assert out[0].tolist() == free[:ends[0]], kwargs


def test_the_profile_is_measured_once_per_target_up_to_the_widest_pass_needed(tmp_path):
    """A model loaded with speculation measures its profile at load; one loaded without measures it in its first
    speculative request, after its first token (counted as setup); the next request reuses it; the output stays the
    plain greedy one."""
    folder = tiny_model(tmp_path / "t", seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="torch", speculative="prompt_lookup")
    assert loaded._costs.profile is not None and max(loaded._costs.profile.seconds) >= 8
    model = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="torch")
    ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(loaded.generate(ids, max_new_tokens=12, do_sample=False), plain)
    assert loaded.last_generate_stats.setup_s == 0
    assert model._costs.profile is None
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=10), plain)
    profile = model._costs.profile
    assert profile is not None and max(profile.seconds) >= 8 and model.last_generate_stats.setup_s > 0
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=10), plain)
    assert model._costs.profile is profile and model.last_generate_stats.setup_s == 0


@pytest.mark.parametrize("target_uses, draft_uses, inside", [(False, None, 1), (True, None, 2), (False, True, 2),
                                                             (False, False, 1)])
def test_the_loop_runs_torch_on_one_thread_unless_a_runner_computes_with_its_threads(target_uses, draft_uses, inside):
    """Where no runner of a request computes with torch's threads (OpenVINO), decode() runs torch on one thread
    (its OpenMP threads would compete with the backend's), and restores the count afterwards."""
    target = Successor(8, RunnerTraits(uses_torch_threads=target_uses))
    draft = None if draft_uses is None else Successor(8, RunnerTraits(uses_torch_threads=draft_uses))
    drafter = None if draft is None else ModelDrafter(draft, vocab_size=8)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = decode(target, [1, 2], _config(max_new_tokens=6), None, drafter, _policy() if drafter else None)[0]
        assert out == [3, 4, 5, 6, 7, 0]
        assert target.threads == {inside} and (draft is None or draft.threads == {inside})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_hybrid_whose_model_stops_goes_on_with_lookup():
    """A draft model that never agrees is stopped by the policy; the hybrid's prompt lookup drafts the rest."""
    from xpuspec.speculative.drafters import HybridDrafter
    from xpuspec.speculative.profile import CostProfile

    class Wrong(Successor):
        def forward(self, tokens, logits_to_keep=None, exact=True):
            return super().forward(tokens, logits_to_keep, exact).roll(1, dims=-1)

    target = Successor(8)
    hybrid = HybridDrafter(PromptLookupDrafter(3, 3), ModelDrafter(Wrong(8), 8), PromptLookupDrafter(3, 2))
    policy = SpeculationPolicy(uses_model=True).begin(DraftSchedule(), None, with_model=True)
    policy.profile = CostProfile({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8, 16: 2.8}, 10)
    new, _, _, stats = decode(target, [1, 2], _config(max_new_tokens=30), None, hybrid, policy)
    assert new == [(3 + i) % 8 for i in range(30)]
    assert stats.draft_model_stopped_after is not None and stats.accepted_tokens > 0  # lookup's, after the stop
    # Each drafter counted its own rounds (the hybrid before the stop, its fallback after); gathered, they account
    # for every token: the prefill's, and per verify pass the accepted drafts plus the target's own token.
    assert stats.new_tokens == stats.target_forwards + stats.accepted_tokens
    assert sum(stats.acceptance_counts.accepted) == stats.accepted_tokens
