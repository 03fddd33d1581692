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
from xpuspec.speculative.audit import IDENTICAL, classify, top2_margins

from conftest import MODEL, PROMPTS
from test_speculative_greedy import PROMPTS_8

#: The format table: every format, and INT4 at its default group size, 32 and channel-wise (-1).
FORMAT_TABLE = [("fp32", None), ("fp16", None), ("int8_sym", None), ("int8_asym", None)] + [
    (fmt, group) for fmt in ("int4_sym", "int4_asym") for group in (None, 32, -1)]
#: Drafters the matrix runs (a separate draft model is covered by the Qwen pair's tests).
DRAFTERS = ("prompt_lookup", "suffix", "self", "hybrid", "suffix_hybrid", "layer_skip")
#: The subset of (format, drafter) the default run covers: every format with prompt lookup (no draft model, the
#: target's numerics alone; test_prompt_lookup_output_is_plain_output), the other drafters on the CLI's and the
#: API's usual formats (test_speculative_output_is_plain_output).
OTHER_CELLS = [(f, d) for f in (("int8_asym", None), ("int4_asym", None)) for d in DRAFTERS[1:]]
NEW_TOKENS = 48

_loaded = {}  # the last target loaded: (model, format, group, mode) -> model; one at a time keeps memory low
#: The plain greedy run of (model, format, group, prompt): (new tokens, top-2 margins). Plain decoding of a format
#: is one function whatever drafter the model was loaded with (the same IR, compiled alike; its 1-token-pass
#: verdict is cached per IR), so each format's 8 plain runs are made once and every drafter is compared with them.
_plain = {}


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
    _plain.clear()


#: Module-scoped parameters: pytest groups the tests of one format together (the one-token check, then prompt
#: lookup's audit), so each format's target is loaded and compiled once for both.
by_format = pytest.mark.parametrize("fmt,group", FORMAT_TABLE, ids=[f"{f}-{g}" for f, g in FORMAT_TABLE],
                                    scope="module")


@by_format
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
    """xpuspec.speculative.audit.audit on each prompt, with the plain run of the format made once (``_plain``)."""
    target = _target(model, fmt, group, drafter)
    extra = dict(prompt_lookup_num_tokens=4) if drafter == "prompt_lookup" else {}
    drafted, bad = 0, []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids
        n = ids.shape[-1]
        if (model, fmt, group, p) not in _plain:
            out = target.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, speculative=False,
                                  return_dict_in_generate=True, output_scores=True)
            _plain[model, fmt, group, p] = out.sequences[0, n:].tolist(), top2_margins(out.scores)
        plain, margins = _plain[model, fmt, group, p]
        spec = target.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, **extra)[0, n:].tolist()
        drafted += target.last_generate_stats.drafted_tokens
        status, first, margin = classify(plain, margins, spec)
        if status != IDENTICAL:
            bad.append((p[:30], status, first, margin))
    assert drafted > 20  # speculation really ran
    assert not bad, bad


@by_format
def test_prompt_lookup_output_is_plain_output(smollm2_path, tokenizer, fmt, group):
    _audit_cell(MODEL, tokenizer, fmt, group, "prompt_lookup", PROMPTS_8)


@pytest.mark.parametrize("cell", OTHER_CELLS, ids=[f"{f}-{g}-{d}" for (f, g), d in OTHER_CELLS])
def test_speculative_output_is_plain_output(smollm2_path, tokenizer, cell):
    (fmt, group), drafter = cell
    if drafter == "layer_skip":  # the target drafting for itself without its calibrated layers, in its own format
        target = _target(MODEL, fmt, group, drafter)
        kept = target.draft_model.config.num_hidden_layers
        assert 0 < kept < target.config.num_hidden_layers and target.draft_model.low_bit.format == fmt
    _audit_cell(MODEL, tokenizer, fmt, group, drafter, PROMPTS_8)


MATRIX = [(m, f, d) for m in (MODEL, "qwen2.5-coder-0.5b-instruct") for f in FORMAT_TABLE for d in DRAFTERS]


@pytest.mark.matrix
@pytest.mark.parametrize("cell", MATRIX, ids=[f"{m[:6]}-{f}-{g}-{d}" for m, (f, g), d in MATRIX])
def test_speculative_output_is_plain_output_everywhere(smollm2_path, cell):
    from xpuspec import AutoTokenizer

    model, (fmt, group), drafter = cell
    _audit_cell(model, AutoTokenizer.from_pretrained(model), fmt, group, drafter, PROMPTS_8)
