"""Speculative settings (xpuspec.speculative.config, pairing): bad options are refused by name before any
token is drafted, drafts with another vocabulary are refused, and each mode gets the drafter it names."""

import pytest
import torch

from xpuspec import AutoModelForCausalLM, DraftMismatchError, SpeculativeConfig, SpeculativeConfigError
from xpuspec.speculative.drafters import HybridDrafter

from tiny import WORDS, tiny_model


def test_draft_with_another_vocabulary_is_refused(tiny_pair, tmp_path):
    target, _ = tiny_pair
    other_words = WORDS[:3] + [f"v{i}" for i in range(13)]
    other = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "other", 3, other_words), backend="torch")
    with pytest.raises(DraftMismatchError, match="another vocabulary"):
        target.generate(input_ids=torch.tensor([[1, 5]]), max_new_tokens=4, assistant_model=other)


def test_a_draft_with_another_vocabulary_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    from xpuspec.devices import get_backend

    target = tiny_model(tmp_path / "target", 1)
    other = tiny_model(tmp_path / "other", 3, WORDS[:3] + [f"v{i}" for i in range(13)])
    loads = []
    torch_backend = get_backend("torch")
    real_load = torch_backend.load
    monkeypatch.setattr(torch_backend, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    with pytest.raises(DraftMismatchError, match=r"The draft of speculative='draft' .*another vocabulary"):
        AutoModelForCausalLM.from_pretrained(str(target), backend="torch",
                                             speculative=SpeculativeConfig(mode="draft", draft=str(other)))
    assert loads == []


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
    with pytest.raises(SpeculativeConfigError, match="prompt_lookup_num_tokens applies to modes 'prompt_lookup', 'hybrid'"):
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
    plan = plan_speculation(target, None, True, assistant_model=draft, prompt_lookup_num_tokens=3)
    assert plan.schedule.lookup_tokens == 3 and plan.without_model().schedule.num_assistant_tokens == 3
    plan = plan_speculation(target, SpeculativeConfig(mode="hybrid", draft=str(draft.source.path),
                                                      prompt_lookup_num_tokens=5), True)
    assert plan.schedule.lookup_tokens == 5 and plan.schedule.num_assistant_tokens == 4  # the model's k: its own
    plan = plan_speculation(target, SpeculativeConfig(mode="hybrid"), True)
    assert plan.schedule.lookup_tokens == 10 and plan.kind == "hybrid"


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
        drafter = plan_speculation(target, spec, True, **kwargs).drafter
        if not isinstance(drafter, HybridDrafter):
            return drafter.max_ngram, drafter.min_ngram
        return [(lookup.max_ngram, lookup.min_ngram) for lookup in (drafter.lookup, drafter.without_model())]

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


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_bad_draft_context_lengths_are_refused_by_name(value):
    with pytest.raises(SpeculativeConfigError, match="draft_context_length"):
        SpeculativeConfig(mode="hybrid", draft_context_length=value)
    with pytest.raises(SpeculativeConfigError, match="draft_context_length"):
        SpeculativeConfig(mode="prompt_lookup", draft_context_length=8)
