"""Layer-skip self-draft mechanics on a tiny random model: the speed-up model, calibration, the
derived draft folder, and greedy identity end to end. The real-model identity test is in
test_speculative_greedy.py."""

import pytest
import torch

from xpuspec import AutoModelForCausalLM, ModelSourceError, SpeculativeConfig, SpeculativeConfigError
from xpuspec.sources import resolve_source
from xpuspec.speculative import layerskip
from xpuspec.speculative.layerskip import (LayerSkipPlan, calibrate, expected_tokens_per_round, layer_skip_model,
                                           predicted_speedup)

from tiny import tiny_model

LAYERS = 6


@pytest.fixture(scope="module")
def tiny_deep(tmp_path_factory, one_thread):
    return tiny_model(tmp_path_factory.mktemp("tiny6") / "m", seed=3, layers=LAYERS)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path / "cache"))


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_speedup_model_known_values():
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens_per_round(1.0, 4) == 5
    assert expected_tokens_per_round(0.0, 4) == 1
    assert predicted_speedup(1.0, 0.0, 4) == pytest.approx(5 / 1.6)
    assert predicted_speedup(0.0, 0.5, 1) < 1


def test_calibration_keeps_first_and_last_layers_and_picks_the_best_candidate(tiny_deep):
    ids = torch.randint(3, 16, (1, 64), generator=torch.Generator().manual_seed(0))
    plan = calibrate(_hf(tiny_deep), ids)
    assert plan.num_layers == LAYERS and plan.calibration_tokens == 64
    assert plan.skip and set(plan.skip) <= set(range(1, LAYERS - 1))
    assert 0 <= plan.agreement <= 1 and 0 < plan.draft_cost < 1
    assert plan.predicted_speedup == pytest.approx(max(c["predicted_speedup"] for c in plan.candidates), abs=1e-3)
    assert [c["skip"] for c in plan.candidates] == list(range(1, len(plan.candidates) + 1))


def test_derived_folder_equals_the_model_run_without_those_layers(tiny_deep):
    """Kept layers renumbered: the saved draft, decoding with its KV cache, gives the logits of
    the full model run without the skipped layers."""
    skip = [1, 3]
    draft = _hf(layer_skip_model(resolve_source(str(tiny_deep)), skip))
    assert draft.config.num_hidden_layers == LAYERS - 2
    ids = torch.tensor([[1, 5, 7, 9, 4, 11, 6]])
    with layerskip._Skipping(_hf(tiny_deep), skip) as skipped, torch.no_grad():
        reference = skipped(input_ids=ids, use_cache=False).logits[0]
        first = draft(input_ids=ids[:, :4], use_cache=True)
        rest = draft(input_ids=ids[:, 4:], past_key_values=first.past_key_values, use_cache=True)
    assert torch.allclose(torch.cat([first.logits[0], rest.logits[0]]), reference, atol=1e-5)


def test_layer_skip_speculation_is_greedy_identical(tiny_deep):
    spec = SpeculativeConfig(mode="layer_skip", skip_layers=(2, 3), num_assistant_tokens=3, cost_model=False)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_deep), device="cpu", backend="torch", speculative=spec)
    assert model.draft_model.config.num_hidden_layers == LAYERS - 2
    ids = torch.tensor([[1, 5, 7, 9, 4]])
    plain = model.generate(ids, max_new_tokens=24, do_sample=False, speculative=False)
    fast = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert model.last_generate_stats.drafted_tokens > 0
    assert fast.tolist() == plain.tolist()


def test_calibrated_plan_is_cached(tiny_deep, monkeypatch):
    source = resolve_source(str(tiny_deep))
    first = layerskip.layer_skip_plan(source)
    monkeypatch.setattr(layerskip, "calibrate", lambda *a: pytest.fail("calibrated twice"))
    assert layerskip.layer_skip_plan(source) == first and isinstance(first, LayerSkipPlan)


def test_bad_layer_skip_requests(tiny_deep, tmp_path):
    source = resolve_source(str(tiny_deep))
    for skip in ([LAYERS], list(range(LAYERS)), []):
        with pytest.raises(SpeculativeConfigError, match="skip_layers"):
            layer_skip_model(source, skip)
    with pytest.raises(ValueError, match="skip_layers applies to mode='layer_skip'"):
        SpeculativeConfig(mode="self", skip_layers=(1,))
    for bad in ("1,2", (), (1, -1), (1.0,), (True,), 3):  # refused when the config is built, before any load
        with pytest.raises(SpeculativeConfigError, match="skip_layers must be a non-empty sequence"):
            SpeculativeConfig(mode="layer_skip", skip_layers=bad)
    assert SpeculativeConfig(mode="layer_skip", skip_layers=[3, 1, 3]).skip_layers == (1, 3)
    with pytest.raises(ModelSourceError, match="at least 3"):
        calibrate(_hf(tiny_model(tmp_path / "two", seed=4)), torch.tensor([[1, 5, 7]]))
    ir = tmp_path / "ir"
    ir.mkdir()
    (ir / "openvino_model.xml").write_text("<net/>")
    with pytest.raises(ModelSourceError, match="original Hugging Face weights"):
        layerskip.layer_skip_plan(resolve_source(str(ir)))
