"""Issue 21 items 3 and 5: a draft model the policy leaves out is released and comes back; speculation is prepared
at load (setup_s 0 on the first request); the switch-off is logged once per model. Real SmolLM2, INT8."""

import logging

import pytest
import torch

from conftest import MODEL, PROMPTS
from xpuspec import AutoModelForCausalLM
from xpuspec.speculative import policy, resident
from xpuspec.speculative.config import SpeculativeConfig
from xpuspec.speculative.resident import ReleasableRunner


@pytest.fixture
def never_pays(monkeypatch):
    """The draft model never pays (stopped in every request it starts), and never 'cannot pay' at all, so that the
    policy skips it after FAILURES_BEFORE_SKIPPING requests and probes it again after one skipped request; the test
    releases the draft after one skipped request (release_draft_after=1)."""
    monkeypatch.setattr(policy, "SPEEDUP_TO_KEEP", float("inf"))
    monkeypatch.setattr(policy.Stop, "cannot_pay", property(lambda self: False))


@pytest.mark.parametrize("reload_share", [float("inf"), resident.RELOAD_TIME_SHARE])
def test_a_skipped_layer_skip_draft_is_released_and_comes_back(tokenizer, never_pays, caplog, monkeypatch,
                                                               reload_share):
    """At an unbounded reload share the probe right after the release loads the draft again; at the default share
    (a reload may take 5% of the time since the release) that probe is skipped: the draft stays released."""
    monkeypatch.setattr(resident, "RELOAD_TIME_SHARE", reload_share)
    with caplog.at_level(logging.INFO, logger="xpuspec"):
        model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                     speculative=SpeculativeConfig("layer_skip", release_draft_after=1))
    draft = model.draft_model.runner
    assert isinstance(draft, ReleasableRunner) and draft.resident
    # RSS added at load: 0 where the allocator reuses pages an earlier test's model freed (the order of modules
    # decides; it measured 0 after test_prefix_cache and test_paged), so only that it is measured is asserted.
    assert isinstance(model.draft_memory_bytes, int)
    assert any(r.getMessage().startswith("speculative mode layer_skip on cpu: ") and "MiB of extra memory" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    seen = []
    with caplog.at_level(logging.INFO, logger="xpuspec"):
        for prompt in PROMPTS:  # started, started (stopped both times), skipped -> released, probed -> loaded again
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            fast = model.generate(ids, max_new_tokens=24, do_sample=False)
            stats = model.last_generate_stats
            seen.append((stats.draft_model_skipped, draft.resident, stats.drafted_tokens > 0, stats.setup_s))
            assert torch.equal(fast, model.generate(ids, max_new_tokens=24, do_sample=False, speculative=False))
    reloaded = reload_share == float("inf")
    fourth = (False, True, True) if reloaded else (True, False, False)
    assert [s[:3] for s in seen] == [(False, True, True), (False, True, True), (True, False, False), fourth]
    assert seen[0][3] == 0.0  # prepared at load: no second copy or cost profile to make in the first request
    assert (seen[3][3] > 0.0) == reloaded  # the reload counts as setup
    assert (draft.releases, draft.reloads) == (1, int(reloaded))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("stopped after" in m for m in messages) == 1  # once per model
    stop = next(m for m in messages if "stopped after" in m)
    assert "measured acceptance" in stop and "predicted" in stop and "plain decoding at best" in stop
    assert sum(" released (" in m for m in messages) == 1
    assert sum("loaded again (" in m for m in messages) == int(reloaded)


def test_prompt_lookup_is_prepared_at_load(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                 speculative="prompt_lookup")
    assert model._costs.profile is not None
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=16, do_sample=False)
    assert model.last_generate_stats.setup_s == 0.0
