"""EAGLE-3 heads in the Speculators format: loading, the refusal of a mismatched head, the head's forward against the
``speculators`` package's own, the d2t mapping and the head's KV-cache rollback."""

import copy
import json
import sys
import types

import pytest
import torch

from xpuspec.errors import DraftMismatchError, ModelSourceError
from xpuspec.speculative.eagle3 import Eagle3Head, check_head, is_eagle3_head, new_head, read_head

TINY_LAYERS = 8  # the default taps (2, 4, 5) are distinct


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tiny import tiny_model

    return tiny_model(tmp_path_factory.mktemp("e3") / "target", seed=1, layers=TINY_LAYERS)


def _speculators():
    """speculators' EAGLE-3 model and config classes, or a skip.

    speculators 0.9.0 installs with ``pip install --no-deps speculators==0.9.0`` (its dependencies pin transformers
    and pull torchvision). Its EAGLE-3 modules import, through ``speculators.train.data``, two packages that only its
    training-data path uses: ``datasets`` (whose dependencies would move huggingface_hub) and ``hs_connectors``. Where
    they are absent, those names are stood in for by empty modules while speculators imports (then removed):
    the model code under test uses neither.
    """
    stubs = []
    for name in ("datasets", "hs_connectors"):
        try:
            __import__(name)
        except ImportError:
            stub = types.ModuleType(name)
            for attr in ("load_from_disk", "load_dataset", "concatenate_datasets", "Dataset", "FileTransfer",
                         "HiddenStatesTransfer", "HiddenStatesBackend"):
                setattr(stub, attr, type(attr, (), {}))
            sys.modules[name] = stub
            stubs.append(name)
    try:
        from speculators import SpeculatorsConfig, VerifierConfig
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig
        from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    except ImportError as exc:
        pytest.skip(f"speculators 0.9.0 is not importable ({exc}); pip install --no-deps speculators==0.9.0")
    finally:  # the stand-ins leave again: other code asks importlib whether these packages exist
        for name in stubs:
            sys.modules.pop(name, None)
    return (SpeculatorsConfig, VerifierConfig, Eagle3DraftModel, Eagle3SpeculatorConfig, GreedyTokenProposalConfig,
            build_vocab_mappings_from_distribution)


def _speculators_head(target, folder, layers=1, **flags):
    """A random head made and saved by speculators' own code for ``target``; returns (model, folder)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    SpecConfig, Verifier, Model, Config, Greedy, mappings = _speculators()
    verifier = AutoConfig.from_pretrained(target)
    layer = copy.deepcopy(verifier)
    layer.num_hidden_layers = layers
    layer._attn_implementation = "eager"
    d2t, t2d = mappings({i: 100 - i for i in range(3, 16)}, 8, verifier.vocab_size)
    config = Config(transformer_layer_config=layer, draft_vocab_size=8,
                    speculators_config=SpecConfig(algorithm="eagle3", proposal_methods=[Greedy(speculative_tokens=3)],
                                                  default_proposal_method="greedy",
                                                  verifier=Verifier.from_pretrained(str(target))), **flags)
    torch.manual_seed(0)
    model = Model(config)
    model.load_vocab_mappings(t2d, d2t)
    weights = load_file(str(target / "model.safetensors"))
    with torch.no_grad():  # what load_verifier_weights does (it needs loguru); then a random head and norms
        model.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
        model.lm_head.weight.normal_()
        model.verifier_lm_head.weight.normal_()
        model.verifier_norm.weight.fill_(1)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model.eval(), folder


@pytest.mark.parametrize("layers,flags", [(1, {"norm_before_residual": True}), (2, {}),
                                          (1, {"fc_norm": True, "norm_output": True})])
@torch.no_grad()
def test_logits_equal_speculators_forward(tiny_target, tmp_path, layers, flags):
    """A head saved by speculators loads, and its draft logits equal speculators' forward within 1e-4: every
    position's first step, and chains of 3 steps (speculators' test-time-training steps, teacher-forced), through
    both the training forward and the drafting path (:meth:`Eagle3Head.draft`, its own attention and cache)."""
    model, folder = _speculators_head(tiny_target, tmp_path / "head", layers, **flags)
    assert is_eagle3_head(folder)
    spec = read_head(folder)
    assert spec.speculative_tokens == 3 and spec.draft_vocab_size == 8 and spec.layer_ids is None
    taps = check_head(spec, 32, 16, TINY_LAYERS)
    assert taps == (2, 4, 5)
    head = Eagle3Head.load(spec, taps)
    n = 7
    torch.manual_seed(1)
    hidden, tokens = torch.randn(1, n, 3 * 32), torch.randint(0, 16, (1, n))
    steps = []
    hook = model.lm_head.register_forward_hook(lambda mod, i, out: steps.append(out.detach()[0]))
    with torch.no_grad():
        model(hidden, tokens, torch.zeros(1, n, dtype=torch.long), ttt_steps=3)
    hook.remove()
    logits, _ = head(tokens[0].tolist(), head.project(hidden[0]), head.new_cache())
    assert (logits - steps[0]).abs().max() < 1e-4
    for t in range(n - 2):  # a chain from position t: steps 1, 2 are fed the next tokens
        cache = head.new_cache()
        logits, out = head(tokens[0, :t + 1].tolist(), head.project(hidden[0, :t + 1]), cache)
        assert (logits[-1] - steps[0][t]).abs().max() < 1e-4
        for k in (1, 2):
            logits, out = head([int(tokens[0, t + k])], out[-1:], cache)
            assert (logits[-1] - steps[k][t]).abs().max() < 1e-4, (t, k)
        cache = head.new_draft_cache()
        logits, out = head.draft(tokens[0, :t + 1].tolist(), head.project(hidden[0, :t + 1]), cache)
        assert logits.shape == (1, 8) and (logits[0] - steps[0][t]).abs().max() < 1e-4
        for k in (1, 2):
            logits, out = head.draft([int(tokens[0, t + k])], out, cache)
            assert (logits[0] - steps[k][t]).abs().max() < 1e-4, (t, k)


def test_d2t_maps_draft_ids_to_target_ids(tiny_target, tmp_path):
    from transformers import AutoConfig

    folder = new_head(AutoConfig.from_pretrained(tiny_target), tmp_path / "head", draft_ids=[3, 5, 9, 15])
    spec = read_head(folder)
    head = Eagle3Head.load(spec, check_head(spec, 32, 16, TINY_LAYERS))
    assert head.d2t.tolist() == [3, 4, 7, 12]  # offsets: target id = draft id + d2t[draft id]
    full = head.to_target(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), 16)
    assert full[0, [3, 5, 9, 15]].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert torch.isinf(full).sum() == 12 and int(full.argmax()) == 15


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_a_head_is_built_for_a_target_whose_config_lists_every_layers_type(tmp_path, model_type):
    """Qwen2/Qwen3 configs carry ``layer_types``, one entry per layer of the target; transformers refuses a one-layer
    config with 8 of them (train-draft for Qwen2.5-Coder-1.5B failed there). The head's config keeps one, and a head
    written with the target's whole list (by an earlier xpuspec) still reads. A Qwen2 head drafts (its rotary
    tables were built 2H / heads wide where the config names no head_dim, and its first step failed)."""
    from transformers import AutoConfig

    dims = dict(head_dim=8) if model_type == "qwen3" else {}  # Qwen2 configs name no head_dim: hidden / heads
    target = AutoConfig.for_model(model_type, vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                  num_attention_heads=4, num_key_value_heads=2, **dims)
    assert len(target.layer_types) == 8
    folder = new_head(target, tmp_path / "head", seed=0)
    written = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
    assert written["num_hidden_layers"] == 1 and len(written["layer_types"]) == 1
    spec = read_head(folder)
    head = Eagle3Head.load(spec, check_head(spec, 32, 16, 8))
    with torch.no_grad():  # the rotary tables fit the heads (a 2H-wide head_dim did not, for Qwen2)
        taps = head.project(torch.randn(3, 96))
        logits, _ = head([3, 4, 5], taps, head.new_cache())
        drafted, _ = head.draft([3, 4, 5], taps, head.new_draft_cache())  # Qwen3's q/k norms included
    assert logits.shape == (3, 16) and torch.isfinite(logits).all()
    assert (drafted[0] - logits[-1]).abs().max() < 1e-5
    raw = json.loads((folder / "config.json").read_text())
    raw["transformer_layer_config"]["layer_types"] = target.layer_types
    (folder / "config.json").write_text(json.dumps(raw))
    assert read_head(folder).layer_config.num_hidden_layers == 1


def test_mismatched_head_is_refused_naming_each_mismatch(tiny_target, tmp_path):
    from transformers import AutoConfig

    folder = new_head(AutoConfig.from_pretrained(tiny_target), tmp_path / "head")
    spec = read_head(folder)
    with pytest.raises(DraftMismatchError, match=r"hidden size 32 \(target: 64\).*vocabulary of 16 tokens "
                                                 r"\(target: 20\)"):
        check_head(spec, 64, 20, TINY_LAYERS)
    with pytest.raises(DraftMismatchError, match=r"tapped layers \[2, 2, 2\]"):
        check_head(spec, 32, 16, 5)  # the default taps of 5 layers are (2, 2, 2)
    explicit = new_head(AutoConfig.from_pretrained(tiny_target), tmp_path / "explicit", layer_ids=[1, 4, 7])
    with pytest.raises(DraftMismatchError, match=r"tapped layers \[1, 4, 7\] \(the target has 6 layers"):
        check_head(read_head(explicit), 32, 16, 6)
    assert check_head(read_head(explicit), 32, 16, TINY_LAYERS) == (1, 4, 7)


def test_not_a_head_is_refused(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        read_head(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert not is_eagle3_head(tmp_path)
    with pytest.raises(ModelSourceError, match="not an EAGLE-3 head"):
        read_head(tmp_path)


@torch.no_grad()
def test_rollback_gives_the_same_logits(tiny_target, tmp_path):
    """Entries dropped by rollback and computed again give the logits they gave the first time; other entries
    fed in their place give others (the cache really holds them)."""
    from transformers import AutoConfig

    folder = new_head(AutoConfig.from_pretrained(tiny_target), tmp_path / "head", seed=3)
    spec = read_head(folder)
    head = Eagle3Head.load(spec, check_head(spec, 32, 16, TINY_LAYERS))
    torch.manual_seed(2)
    taps = torch.randn(6, 96)
    cache = head.new_cache()
    first, _ = head([4, 5, 6, 7, 8, 9], head.project(taps), cache)
    cache.rollback(3)
    assert cache.length == 3
    again, _ = head([7, 8, 9], head.project(taps[3:]), cache)
    assert torch.allclose(first[3:], again, atol=1e-5)
    cache.rollback(3)
    other, _ = head([10, 11, 12], head.project(taps[3:]), cache)
    assert not torch.allclose(first[4:], other[1:], atol=1e-3)
    with pytest.raises(ValueError):
        cache.rollback(7)
    draft_cache = head.new_draft_cache()  # the drafting path's cache: a rollback moves its length only
    for token in [4, 5, 6, 7, 8, 9]:
        head.draft([token], head.project(taps[token - 4:token - 3]), draft_cache)
    draft_cache.rollback(3)
    again, _ = head.draft([7, 8, 9], head.project(taps[3:]), draft_cache)
    assert torch.allclose(first[-1:], again, atol=1e-5)
    draft_cache.rollback(3)
    other, _ = head.draft([10, 11, 12], head.project(taps[3:]), draft_cache)
    assert not torch.allclose(first[-1:], other, atol=1e-3)
    with pytest.raises(ValueError):
        draft_cache.rollback(7)


def test_a_draft_cache_grows_keeping_its_entries_and_rolls_back_without_copying():
    from xpuspec.speculative.eagle3 import DraftCache

    cache, written = DraftCache(), []
    for n in (200, 100, 300):  # past the first buffer (256 entries), then past the doubled one
        keys = torch.randn(1, 2, n, 4)
        seen_k, seen_v = cache.put(0, keys, -keys)
        cache.length += n
        written.append(keys)
        assert torch.equal(seen_k, torch.cat(written, 2)) and torch.equal(seen_v, -seen_k)
    buffer = cache.keys[0]
    cache.rollback(250)
    assert cache.length == 350 and cache.keys[0] is buffer
    seen_k, _ = cache.put(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert seen_k.shape[2] == 351 and torch.equal(seen_k[:, :, :350], torch.cat(written, 2)[:, :, :350])


@torch.no_grad()
def test_an_int8_head_computes_what_its_float_weights_do(tiny_target, tmp_path):
    """A head drafts in int8 by default (``draft_low_bit='int8_sym'``): every Linear then holds int8 weights, and
    its logits on the same entries stay within 8 bits' rounding of the float head's (max error under 3% of the
    logits' range; a head whose weights were not converted would be exact, one converted wrongly far off).
    ``'fp32'`` keeps the float weights; a format a head has not is refused."""
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear
    from transformers import AutoConfig

    from xpuspec.errors import SpeculativeConfigError

    folder = new_head(AutoConfig.from_pretrained(tiny_target), tmp_path / "head", seed=4)
    spec = read_head(folder)
    taps = check_head(spec, 32, 16, TINY_LAYERS)
    float_head = Eagle3Head.load(spec, taps)
    assert float_head.quantized("fp32") is float_head and float_head.format == "fp32"
    int8_head = Eagle3Head.load(spec, taps).quantized("int8_sym")
    linears = [m for m in int8_head.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    assert len(linears) == 9 and all(isinstance(m, Int8Linear) for m in linears), linears  # fc, 7 in the layer, lm_head
    torch.manual_seed(2)
    tokens, hidden = [4, 5, 6, 7, 8, 9], torch.randn(6, 96)
    want, _ = float_head(tokens, float_head.project(hidden), float_head.new_cache())
    got, _ = int8_head(tokens, int8_head.project(hidden), int8_head.new_cache())
    error = float((got - want).abs().max() / (want.max() - want.min()))
    assert 0 < error < 0.03, error
    with pytest.raises(SpeculativeConfigError, match="drafts in 'int8_sym', 'fp32', not 'int4_sym'"):
        Eagle3Head.load(spec, taps).quantized("int4_sym")


def _eagle3_model(target, head, backend="torch", **config):
    from xpuspec import AutoModelForCausalLM, SpeculativeConfig

    spec = SpeculativeConfig(mode="eagle3", draft=str(head), cost_model=False, num_assistant_tokens=3,
                             num_assistant_tokens_schedule="constant", **config)
    return AutoModelForCausalLM.from_pretrained(str(target), device="cpu", backend=backend, speculative=spec)


@pytest.mark.parametrize("lookup", [None, 4])
def test_greedy_identity_and_taps_of_accepted_positions(tiny_target, tmp_path, lookup, monkeypatch):
    """Through generate on a tiny torch target: the output is the plain greedy output, the head drafted every
    round, and the taps the drafter holds for every position before the last are the target's own hidden states
    of the output (those of accepted tokens, not of rejected drafts). With ``prompt_lookup_num_tokens`` (lookup
    where an n-gram matches, else the head) both drafted, and the head still holds the taps of every position,
    those of the lookup rounds' passes included."""
    import transformers
    from transformers import AutoConfig

    from xpuspec import AutoModelForCausalLM
    from xpuspec.speculative.drafters import PromptLookupDrafter
    from xpuspec.speculative.eagle3_drafter import Eagle3Drafter

    head = new_head(AutoConfig.from_pretrained(tiny_target), tmp_path / "head", draft_ids=[2, 3, 5, 7, 8, 9, 11, 13])
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_target), device="cpu", backend="torch")
    model = _eagle3_model(tiny_target, head, **({"prompt_lookup_num_tokens": lookup} if lookup else {}))
    assert model.eagle3_head is not None and model.runner.tap_ids == (2, 4, 5)
    seen, drafted = {}, {"lookup": 0, "head": 0}
    ends, looks, proposes = Eagle3Drafter.end, PromptLookupDrafter.propose, Eagle3Drafter.propose

    def keep(self):
        seen["taps"], seen["filled"] = self.taps[:self.filled].clone(), self.filled
        ends(self)

    def count(name, propose):
        def counted(self, widths):
            draft = propose(self, widths)
            drafted[name] += len(draft.tokens)
            return draft
        return counted

    monkeypatch.setattr(PromptLookupDrafter, "propose", count("lookup", looks))
    monkeypatch.setattr(Eagle3Drafter, "propose", count("head", proposes))
    Eagle3Drafter.end = keep
    try:
        for prompt in ([1, 4, 5, 6, 4, 5], [1, 9, 3, 12, 7], [1, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5]):
            ids = torch.tensor([prompt])
            want = plain.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
            got = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
            assert got.tolist() == want.tolist()
            stats = model.last_generate_stats
            assert lookup or stats.drafted_tokens >= 3 * 4, stats  # the head drafted in every round (cost model off)
            reference = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_target)).eval()
            with torch.no_grad():
                hidden = reference(got, output_hidden_states=True).hidden_states
            taps = torch.cat([hidden[i][0] for i in (2, 4, 5)], dim=-1)
            n = got.shape[1] - 1  # the last token was never fed to the target
            assert seen["filled"] >= n
            assert torch.allclose(seen["taps"][:n], taps[:n], atol=1e-4)
    finally:
        Eagle3Drafter.end = ends
    assert drafted["head"] > 0 and (drafted["lookup"] > 0) == bool(lookup), drafted


def test_a_head_drafts_the_chain_it_was_trained_for_unless_told(tiny_target, tmp_path, monkeypatch):
    """The head's ``speculative_tokens`` (2 here; the default for other drafters is 4) is the chain length asked
    for, as vLLM reads it; ``num_assistant_tokens`` overrides it."""
    from transformers import AutoConfig

    from xpuspec import AutoModelForCausalLM, SpeculativeConfig
    from xpuspec.speculative.config import DEFAULT_ASSISTANT_TOKENS
    from xpuspec.speculative.eagle3_drafter import Eagle3Drafter

    head = new_head(AutoConfig.from_pretrained(tiny_target), tmp_path / "head", speculative_tokens=2)
    asked, propose = [], Eagle3Drafter.propose
    monkeypatch.setattr(Eagle3Drafter, "propose", lambda self, widths: asked.append(widths.model) or propose(self, widths))
    for given, want in ((None, 2), (3, 3)):
        spec = SpeculativeConfig(mode="eagle3", draft=str(head), cost_model=False, num_assistant_tokens=given,
                                 num_assistant_tokens_schedule="constant")
        model = AutoModelForCausalLM.from_pretrained(str(tiny_target), device="cpu", backend="torch", speculative=spec)
        asked.clear()
        model.generate(torch.tensor([[1, 4, 5, 6]]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert asked and max(asked) == want != DEFAULT_ASSISTANT_TOKENS, asked


def _exact_pair_distribution(target, ids, temperature, top_p, min_new_tokens):
    """The exact distribution of the 2nd and 3rd tokens that plain sampling gives after ``ids`` (``[1, T]``), as
    ``[vocab * vocab]`` probabilities of (2nd, 3rd): transformers' model and its own processors (EOS held back by
    ``min_new_tokens``, temperature, then top-p), summed over every first token."""
    from transformers import AutoModelForCausalLM as HFModel
    from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                        TemperatureLogitsWarper, TopPLogitsWarper)

    model = HFModel.from_pretrained(target, dtype=torch.float32).eval()
    vocab, prompt_len = model.config.vocab_size, ids.shape[1]
    warp = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(prompt_len, min_new_tokens, model.config.eos_token_id),
                                TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])

    def next_probs(contexts):  # [N, T] -> [N, vocab]
        with torch.no_grad():
            logits = model(contexts).logits[:, -1].float()
        return torch.softmax(warp(contexts, logits), dim=-1)

    first = next_probs(ids)[0]  # [vocab]
    every = torch.arange(vocab)[:, None]  # each token, as a column
    second = next_probs(torch.cat([ids.repeat(vocab, 1), every], dim=1))  # [t1, a]
    pairs = torch.cat([ids.repeat(vocab * vocab, 1), every.repeat_interleave(vocab, 0), every.repeat(vocab, 1)], dim=1)
    third = next_probs(pairs).view(vocab, vocab, vocab)  # [t1, a, b]
    return (first[:, None, None] * second[:, :, None] * third).sum(0).flatten()


def test_sampling_with_a_head_follows_the_targets_distribution(tiny_target, tmp_path, one_thread):
    """Rejection sampling with the head's probabilities: the 2nd and 3rd sampled tokens (the first drafted round)
    have the joint distribution plain sampling has, computed exactly with transformers (TV over the 16 x 16 pairs,
    N=1500; plain and speculative sampling each gave 0.023-0.030 over two seeds), and the head's drafts are
    accepted in some rounds (the acceptance branch runs, not only the rejection one)."""
    from test_verify import tv
    from tiny import WORDS
    from transformers import AutoConfig

    head = new_head(AutoConfig.from_pretrained(tiny_target), tmp_path / "head", seed=5)
    model = _eagle3_model(tiny_target, head)
    ids = torch.tensor([[1, 5, 6]])
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=True, temperature=0.8, top_p=0.95)
    torch.manual_seed(0)
    counts, accepted = torch.zeros(len(WORDS) ** 2), 0
    for _ in range(1500):
        a, b = model.generate(input_ids=ids, **kwargs)[0, 4:6].tolist()
        counts[a * len(WORDS) + b] += 1
        accepted += model.last_generate_stats.accepted_tokens
    assert accepted > 50
    exact = _exact_pair_distribution(tiny_target, ids, 0.8, 0.95, 4)
    assert tv(exact, counts) < 0.08


def test_eagle3_mode_needs_a_head_and_refuses_draft_options(tiny_target, tmp_path):
    from xpuspec import SpeculativeConfig
    from xpuspec.errors import SpeculativeConfigError
    from xpuspec.speculative.config import resolve_speculative

    with pytest.raises(SpeculativeConfigError, match="needs draft="):
        SpeculativeConfig(mode="eagle3")
    with pytest.raises(SpeculativeConfigError, match="'int4_sym' is not a format of the head"):
        SpeculativeConfig(mode="eagle3", draft="x", draft_low_bit="int4_sym")
    with pytest.raises(SpeculativeConfigError, match="drop draft_device="):
        SpeculativeConfig(mode="eagle3", draft="x", draft_device="gpu")
    with pytest.raises(SpeculativeConfigError, match="names its folder"):
        resolve_speculative("eagle3")
    from transformers import AutoConfig

    head = new_head(AutoConfig.from_pretrained(tiny_target), tmp_path / "head")
    assert resolve_speculative(str(head)).mode == "eagle3"


def test_mismatched_head_fails_before_the_target_loads(tiny_target, tmp_path, monkeypatch):
    """from_pretrained refuses a head made for another model before the backend loads the target."""
    from tiny import tiny_model
    from transformers import AutoConfig

    import xpuspec_torch

    other = tiny_model(tmp_path / "other", seed=3, layers=4)
    head = new_head(AutoConfig.from_pretrained(other), tmp_path / "head", layer_ids=[1, 2, 3])
    wide = AutoConfig.from_pretrained(tiny_target)
    wide.hidden_size = 64
    wide_head = new_head(wide, tmp_path / "wide")
    loads = []
    monkeypatch.setattr(xpuspec_torch.TorchBackend, "load", lambda *a, **k: loads.append(a) or 1 / 0, raising=False)
    with pytest.raises(DraftMismatchError, match=r"hidden size 64 \(target: 32\)"):
        _eagle3_model(tiny_target, wide_head)
    assert check_head(read_head(head), 32, 16, TINY_LAYERS) == (1, 2, 3)  # fits 8 layers too; a 2-layer target:
    two = tiny_model(tmp_path / "two", seed=4, layers=2)
    with pytest.raises(DraftMismatchError, match=r"tapped layers \[1, 2, 3\] \(the target has 2 layers"):
        _eagle3_model(two, head)
    assert not loads


@pytest.fixture(scope="module")
def smollm2_head(smollm2_path, tmp_path_factory):
    """A random head for SmolLM2 (default taps 2, 15, 27; an 8000-token draft vocabulary), written as speculators
    writes one, with the target's embeddings."""
    from transformers import AutoConfig

    from xpuspec.speculative.eagle3 import target_embeddings

    return new_head(AutoConfig.from_pretrained(smollm2_path), tmp_path_factory.mktemp("smol") / "head",
                    draft_ids=range(8000), embeddings=target_embeddings(smollm2_path))


def test_smollm2_openvino_greedy_identity_alone_and_in_a_batch(smollm2_head, ov_int8, tokenizer):
    """SmolLM2 int8 on OpenVINO with a random head drafting every round (the taps come from the verify pass's
    extra outputs): alone and as rows of a batch, the output is the plain greedy output."""
    from xpuspec import AutoModelForCausalLM, SpeculativeConfig

    spec = SpeculativeConfig(mode="eagle3", draft=str(smollm2_head), cost_model=False, num_assistant_tokens=3,
                             num_assistant_tokens_schedule="constant")
    model = AutoModelForCausalLM.from_pretrained("smollm2-135m-instruct", device="cpu", load_in_low_bit="int8_asym",
                                                 speculative=spec)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, there was a"]
    for text in prompts[:2]:
        ids = tokenizer(text, return_tensors="pt").input_ids
        want = ov_int8.generate(ids, max_new_tokens=20, do_sample=False)
        got = model.generate(ids, max_new_tokens=20, do_sample=False)
        assert got.tolist() == want.tolist(), text
        assert model.last_generate_stats.drafted_tokens >= 3 * 5
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    want = ov_int8.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    got = model.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert got.tolist() == want.tolist()
    assert model.last_generate_stats.drafted_tokens > 0


@pytest.fixture
def one_thread():
    """Training on one torch thread: on a shared CPU, two threads of tiny matmuls wait on each other (25x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def words_text(tmp_path_factory):
    """Three .txt files of 400 random words of the tiny tokenizer."""
    import random

    from tiny import WORDS

    rng, folder = random.Random(0), tmp_path_factory.mktemp("text")
    for i in range(3):
        (folder / f"{i}.txt").write_text(" ".join(rng.choice(WORDS[3:]) for _ in range(400)))
    return folder


def test_a_batch_of_padded_sequences_trains_each_row_as_alone(tiny_target, tmp_path, one_thread):
    """Training steps on sequences of 7 and 11 tokens padded into one batch give each row's draft logits as the row
    alone, at every position the loss reads (the padding reaches no real entry), and the batch's loss is the mean of
    the rows' per-position losses."""
    from transformers import AutoConfig

    from xpuspec.speculative.eagle3_train import _Batch, _batch, _head_steps, _loss

    config = AutoConfig.from_pretrained(tiny_target)
    spec = read_head(new_head(config, tmp_path / "head", seed=3))
    head = Eagle3Head.load(spec, check_head(spec, config.hidden_size, config.vocab_size, TINY_LAYERS))
    torch.manual_seed(0)
    lengths = [7, 11]
    seqs = [torch.randint(0, config.vocab_size, (n,)) for n in lengths]
    taps = [torch.randn(n, 3 * config.hidden_size) for n in lengths]
    top_i = [torch.randint(0, spec.draft_vocab_size, (n, 4)) for n in lengths]
    top_p = [torch.softmax(torch.randn(n, 4), -1) for n in lengths]
    batch = _batch([seq.tolist() for seq in seqs], list(zip(taps, top_p, top_i)))
    assert batch.tokens.shape == (2, 11) and batch.lengths == lengths and not batch.taps[0, 7:].any()
    together = _head_steps(head, batch.tokens, batch.taps, 3)
    losses = []
    for row, n in enumerate(lengths):
        alone = _head_steps(head, seqs[row][None], taps[row][None], 3)
        for k in range(3):
            keep = n - 1 - k
            assert keep > 0 and torch.allclose(together[k][row, :keep], alone[k][0, :keep], atol=1e-5)
        losses.append(_loss(alone, _Batch(seqs[row][None], taps[row][None], top_p[row][None], top_i[row][None], [n])))
    # the batch's mean per step weighs each row by its positions: recompute it from the rows alone
    per_step = []
    for k in range(3):
        ce = []
        for row, n in enumerate(lengths):
            logp = torch.log_softmax(together[k][row, :n - 1 - k], -1).gather(-1, top_i[row][1 + k:n])
            ce.append(-(top_p[row][1 + k:n] * logp).sum(-1))
        per_step.append(torch.cat(ce).mean())
    assert torch.allclose(_loss(together, batch), sum(per_step), atol=1e-5)
    assert not torch.allclose(_loss(together, batch), (losses[0] + losses[1]) / 2, atol=1e-3)  # weighed by positions


def test_bf16_training_is_said_and_refused_where_the_cpu_has_no_bfloat16_products(monkeypatch):
    """Without AVX512-BF16 or AMX the head trains in float32 and says so; asking for bfloat16 there is refused."""
    from xpuspec.speculative.eagle3_train import _precision

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    said = []
    with pytest.raises(ValueError, match=r"no bfloat16 products .*\(--no-bf16\)"):
        _precision(True, said.append)
    assert _precision(None, said.append) is False and said == ["training the head in float32 (this CPU has no "
                                                               "bfloat16 products)"]
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert _precision(None, said.append) is True and _precision(False, said.append) is False


def test_training_resumes_to_the_same_weights(tiny_target, words_text, tmp_path, one_thread, monkeypatch):
    """6 steps of 2 sequences in one run, and a run of 6 stopped by Ctrl-C in its 4th step then resumed from its
    checkpoint of step 2, end with the same head (an interrupted run loses nothing, the learning-rate schedule
    included); a resume with another batch size is refused; the saved folder is a Speculators head that loads."""
    from safetensors.torch import load_file

    from xpuspec.speculative import eagle3_train
    from xpuspec.speculative.eagle3_train import train_head

    args = dict(seq_len=32, lr=3e-3, draft_vocab_size=12, checkpoint_every=2, progress=False, log=lambda *_: None,
                continue_tokens=8, steps=6, batch_size=2)
    whole = train_head(str(tiny_target), [words_text], tmp_path / "whole", **args)
    batch, calls = eagle3_train._batch, []

    def cut_in_step_4(*a):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return batch(*a)

    monkeypatch.setattr(eagle3_train, "_batch", cut_in_step_4)
    with pytest.raises(KeyboardInterrupt):
        train_head(str(tiny_target), [words_text], tmp_path / "cut", **args)
    monkeypatch.setattr(eagle3_train, "_batch", batch)
    with pytest.raises(ValueError, match="batch_size 2: resume with that"):
        train_head(str(tiny_target), [words_text], tmp_path / "cut", **dict(args, batch_size=1))
    resumed = train_head(str(tiny_target), [words_text], tmp_path / "cut", **args)
    assert (whole.steps, resumed.steps, resumed.resumed_from) == (6, 6, 2)
    a, b = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], load_file(str(tmp_path / "whole" / "init" / "model.safetensors"))["fc.weight"])
    spec = read_head(tmp_path / "whole")
    assert spec.draft_vocab_size == 12 and spec.layer_ids == (2, 4, 5) and spec.speculative_tokens == 3
    Eagle3Head.load(spec, check_head(spec, 32, 16, TINY_LAYERS))


def test_a_trained_head_is_accepted_where_a_random_one_is_not(tiny_target, words_text, tmp_path, one_thread):
    """A head trained for 150 steps on the target's own continuations of random text (self-distillation) drafts
    tokens the target accepts in generate (49% on new prompts when written; trained on the random text itself, 1%:
    the target's greedy output repeats, the text does not); a random head, which would also pass a test that only
    checks identity, is accepted below 5%. (Training starts from the target's own readout, accepted 9% untrained.)
    Fails if the head silently drafts nothing."""
    from xpuspec.speculative.eagle3_train import train_head

    report = train_head(str(tiny_target), [words_text], tmp_path / "head", steps=150, seq_len=32, lr=3e-3,
                        draft_vocab_size=16, checkpoint_every=50, progress=False, log=lambda *_: None,
                        continue_tokens=32)
    assert report.acceptance[0] > 0.4  # held out, teacher-forced
    from transformers import AutoConfig

    random_head = new_head(AutoConfig.from_pretrained(tiny_target), tmp_path / "random", seed=1)
    rates = {}
    for name, head in (("trained", tmp_path / "head"), ("random", random_head)):
        model = _eagle3_model(tiny_target, head)
        drafted = accepted = 0
        for prompt in ([1, 4, 5, 6], [1, 9, 3, 12, 7], [1, 10, 11, 3], [1, 5, 5, 8, 2]):
            model.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False)
            drafted += model.last_generate_stats.drafted_tokens
            accepted += model.last_generate_stats.accepted_tokens
        assert drafted >= 4 * 3 * 7
        rates[name] = accepted / drafted
    assert rates["trained"] > 0.25 > 0.05 > rates["random"], rates


def test_training_text_is_read_and_bad_text_refused(tmp_path):
    from xpuspec.speculative.eagle3_train import Chat, read_texts

    (tmp_path / "a.txt").write_text("hello there")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"messages": [{"role": "user", "content": "hi"}, '
                                      '{"role": "assistant", "content": "yo"}]}\n'
                                      '{"conversations": [{"from": "human", "value": "q"}, '
                                      '{"from": "gpt", "value": "a"}]}\n')
    assert read_texts([tmp_path]) == [
        "hello there", "one",
        Chat(({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"})),
        Chat(({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}))]
    with pytest.raises(ModelSourceError, match="No training text"):
        read_texts([tmp_path / "missing"])
    (tmp_path / "c.jsonl").write_text("{oops\n")
    with pytest.raises(ModelSourceError, match=r"c.jsonl:1 is not JSON"):
        read_texts([tmp_path / "c.jsonl"])
    (tmp_path / "c.jsonl").write_text('{"messages": [{"role": "robot", "content": "hi"}]}\n')
    with pytest.raises(ModelSourceError, match=r"c.jsonl:1: a chat's turns need a role"):
        read_texts([tmp_path / "c.jsonl"])


def test_chats_are_rendered_with_the_chat_template_and_answered_by_the_target(tokenizer):
    """With regeneration, a chat's trailing answer is dropped and the generation prompt ends the sequence (the
    target answers itself), kept to its last tokens; without, the whole rendered chat is text. A tokenizer without
    a chat template is refused, naming the fix."""
    from xpuspec.speculative.eagle3_train import Chat, _prompts

    chat = Chat(({"role": "user", "content": "Write a poem about rain."},
                 {"role": "assistant", "content": "Rain falls."}))
    asked = tokenizer.apply_chat_template([chat.messages[0]], add_generation_prompt=True, tokenize=False)
    (prompt,) = _prompts(tokenizer, [chat], 512, regenerate=True)
    assert tokenizer.decode(prompt) == asked and "Rain falls" not in asked
    assert _prompts(tokenizer, [chat], 5, regenerate=True) == [prompt[-5:]]
    text = "A plain text of more than eight tokens, cut into pieces."
    whole = _prompts(tokenizer, [chat, text], 512, regenerate=False)
    assert "Rain falls." in tokenizer.decode(whole[0]) and tokenizer.decode(whole[1]) == text

    class NoTemplate:
        chat_template = None

    with pytest.raises(ModelSourceError, match="no chat template"):
        _prompts(NoTemplate(), [chat], 64, regenerate=True)
