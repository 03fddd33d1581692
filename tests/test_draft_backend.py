"""Drafts on the target's backend: a torch target's self and layer-skip drafts load on torch (or on draft_backend=),
every draft is checked before the target loads and its errors name the draft, and a layer-skip draft that cannot
be used leaves nothing in the cache."""

import pytest
import torch

from xpuspec import AutoModelForCausalLM, DraftMismatchError, UnsupportedArchitectureError
from xpuspec.cache import cache_root

from tiny import tiny_arch_model, tiny_model

PROMPT = torch.tensor([[1, 5, 6, 7, 8, 5, 6, 7]])


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """A tiny Gemma-2 (sliding-window layers, which a speculative torch runner must roll back)."""
    return str(tiny_arch_model(tmp_path_factory.mktemp("gemma2"), "gemma2", seed=1, layers=4))


@pytest.mark.parametrize("mode", ["self", "layer_skip", "hybrid"])
def test_a_torch_targets_draft_loads_on_torch(gemma2, mode, empty_cache):
    plain = AutoModelForCausalLM.from_pretrained(gemma2, device="cpu", backend="torch")
    spec = AutoModelForCausalLM.from_pretrained(gemma2, device="cpu", backend="torch", speculative=mode)
    assert spec.draft_model.backend_name == "torch"
    assert spec.draft_model.low_bit.format == ("fp16" if mode != "layer_skip" else "fp32") \
        if spec.draft_model.low_bit else mode == "layer_skip"
    want = plain.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert spec.generate(PROMPT, max_new_tokens=16, do_sample=False).tolist() == want.tolist()


def test_a_draft_the_draft_backend_cannot_run_is_refused_before_the_target_loads(tmp_path, monkeypatch, empty_cache):
    from xpuspec.devices import get_backend

    gemma = str(tiny_arch_model(tmp_path / "gemma", "gemma", seed=1))  # refused by the pinned optimum-intel
    loads = []
    torch_backend = type(get_backend("torch"))
    real_load = torch_backend.load
    monkeypatch.setattr(torch_backend, "load", lambda self, *a, **k: loads.append(a) or real_load(self, *a, **k))
    with pytest.raises(UnsupportedArchitectureError, match=r"The draft of speculative='self' \(a low-bit copy of the "
                                                          r"model, in int4_sym, on cpu, openvino backend\) cannot load: "
                                                          r"optimum-intel exports architecture 'gemma'"):
        AutoModelForCausalLM.from_pretrained(gemma, device="cpu", backend="torch", speculative="self",
                                             draft_backend="openvino")
    with pytest.raises(UnsupportedArchitectureError, match=r"The draft of speculative='layer_skip'"):
        AutoModelForCausalLM.from_pretrained(gemma, device="cpu", backend="torch", speculative="layer_skip",
                                             draft_backend="openvino")
    assert loads == []  # refused before the target loaded
    assert not (empty_cache / "layerskip").exists() or not any((empty_cache / "layerskip").iterdir())


def test_a_self_draft_in_a_format_torch_cannot_run_names_the_draft(tmp_path):
    folder = str(tiny_model(tmp_path, seed=3))
    from xpuspec import LowBitConfigError

    with pytest.raises(LowBitConfigError, match=r"The draft of speculative='self' .* torch backend\) cannot load: "
                                                r"The torch backend runs fp32, fp16 and bf16 only, not int8_asym"):
        AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="torch", speculative="self",
                                             draft_low_bit="int8_asym")


def test_a_layer_skip_draft_that_fails_leaves_nothing_in_the_cache(tmp_path, empty_cache, monkeypatch):
    import xpuspec.loading

    folder = str(tiny_model(tmp_path / "deep", seed=5, layers=6))

    def refuse(target, draft):
        raise DraftMismatchError("a draft that cannot draft for this target")

    monkeypatch.setattr(xpuspec.loading, "check_draft", refuse)
    with pytest.raises(DraftMismatchError):
        AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="torch", speculative="layer_skip")
    assert not (cache_root() / "layerskip").exists() or not any((cache_root() / "layerskip").iterdir())
    monkeypatch.undo()
    monkeypatch.setenv("XPUSPEC_CACHE", str(empty_cache))
    model = AutoModelForCausalLM.from_pretrained(folder, device="cpu", backend="torch", speculative="layer_skip")
    assert model.draft_model.backend_name == "torch" and any((empty_cache / "layerskip").iterdir())
