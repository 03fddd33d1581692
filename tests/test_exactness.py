"""Greedy speculative output is the target's own greedy output on every weight format and with every drafter.

Whatever CPU this runs on, the OpenVINO runner measures whether its 1-token pass computes like a wider one and,
where it does not, runs 1-token passes 2 wide (plugins/xpuspec_openvino/numerics.py): every pass of a greedy
request then computes alike, and the outputs are identical, not merely equal up to ties. The tests assert that
property on each format, then the audit over the formats x drafters. The full matrix (every format x every
drafter, and the Qwen2.5-Coder 0.5B model) is marked ``matrix`` and deselected by default (``-m matrix`` runs it).
"""

import pytest
import torch

from xpuspec import AutoModelForCausalLM, SpeculativeConfig
from xpuspec.speculative.audit import IDENTICAL, audit

from conftest import MODEL, PROMPTS
from test_speculative_greedy import PROMPTS_8

#: The format table: every format, and INT4 at its default group size, 32 and channel-wise (-1).
FORMAT_TABLE = [("fp32", None), ("fp16", None), ("int8_sym", None), ("int8_asym", None)] + [
    (fmt, group) for fmt in ("int4_sym", "int4_asym") for group in (None, 32, -1)]
#: Drafters the matrix runs (a separate draft model is covered by the Qwen pair's tests).
DRAFTERS = ("prompt_lookup", "suffix", "self", "hybrid", "suffix_hybrid", "layer_skip")
#: The subset of (format, drafter) the default run covers: every format with prompt lookup (no draft model, the
#: target's numerics alone), the model drafters on the CLI's and the API's usual formats.
DEFAULT_CELLS = [(f, "prompt_lookup") for f in FORMAT_TABLE] + [
    (f, d) for f in (("int8_asym", None), ("int4_asym", None)) for d in DRAFTERS[1:]]
NEW_TOKENS = 48

_loaded = {}  # the last target loaded: (model, format, group, mode) -> model; one at a time keeps memory low


def _target(model, fmt, group, mode):
    """The target for (model, format, mode), loaded anew when another was loaded last."""
    key = (model, fmt, group, mode)
    if key not in _loaded:
        _loaded.clear()
        spec = SpeculativeConfig(mode=mode, cost_model=False, num_assistant_tokens=4)
        _loaded[key] = AutoModelForCausalLM.from_pretrained(model, device="cpu", load_in_low_bit=fmt,
                                                            group_size=group, speculative=spec)
    return _loaded[key]


@pytest.fixture(scope="module", autouse=True)
def _release_targets():
    yield
    _loaded.clear()


@pytest.mark.parametrize("fmt,group", FORMAT_TABLE, ids=[f"{f}-{g}" for f, g in FORMAT_TABLE])
def test_one_token_passes_compute_as_a_wide_pass(smollm2_path, tokenizer, fmt, group):
    """16 one-token passes give bit for bit the logits of one 16-token pass over the same tokens."""
    runner = _target(MODEL, fmt, group, "prompt_lookup").runner
    ids = tokenizer(" ".join(PROMPTS)).input_ids
    runner.reset()
    runner.forward(ids[:-16])
    wide = runner.forward(ids[-16:])
    runner.rollback(16)
    steps = torch.cat([runner.forward([t]) for t in ids[-16:]])
    runner.reset()
    assert torch.equal(wide, steps), float((wide - steps).abs().max())


def _audit_cell(model, tokenizer, fmt, group, drafter, prompts):
    target = _target(model, fmt, group, drafter)
    extra = dict(prompt_lookup_num_tokens=4) if drafter == "prompt_lookup" else {}
    results = [audit(target, tokenizer(p, return_tensors="pt").input_ids, max_new_tokens=NEW_TOKENS, **extra)
               for p in prompts]
    assert sum(r.stats.drafted_tokens for r in results) > 20  # speculation really ran
    bad = [(p[:30], r.status, r.first_difference, r.margin) for p, r in zip(prompts, results) if r.status != IDENTICAL]
    assert not bad, bad


@pytest.mark.parametrize("cell", DEFAULT_CELLS, ids=[f"{f}-{g}-{d}" for (f, g), d in DEFAULT_CELLS])
def test_speculative_output_is_plain_output(smollm2_path, tokenizer, cell):
    (fmt, group), drafter = cell
    _audit_cell(MODEL, tokenizer, fmt, group, drafter, PROMPTS_8)


MATRIX = [(m, f, d) for m in (MODEL, "qwen2.5-coder-0.5b-instruct") for f in FORMAT_TABLE for d in DRAFTERS]


@pytest.mark.matrix
@pytest.mark.parametrize("cell", MATRIX, ids=[f"{m[:6]}-{f}-{g}-{d}" for m, (f, g), d in MATRIX])
def test_speculative_output_is_plain_output_everywhere(smollm2_path, cell):
    from xpuspec import AutoTokenizer

    model, (fmt, group), drafter = cell
    _audit_cell(model, AutoTokenizer.from_pretrained(model), fmt, group, drafter, PROMPTS_8)
