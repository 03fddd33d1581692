"""Batched generate on the OpenVINO paged runner (xpuspec.engine): every row equals the same prompt decoded alone
(greedy, every speculative mode, left and right padding), rows leave at EOS and join mid-run, one row's rollback
leaves the others' logits as fresh forwards give them, sampling follows the target's distribution per row, bad
input is refused, and concurrent threads become rows of one batch."""

import threading
import time

import pytest
import torch

from xpuspec import AutoModelForCausalLM, KVBudgetError, SpeculativeConfig
from xpuspec.errors import InvalidInputError

from conftest import MODEL

#: Eight prompts of different lengths (code and prose).
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n\ndef normalize(x):\n    \"\"\"Scale x to unit norm.\"\"\"",
    "Once upon a time, in a small village,",
    "Hi",
    "List three colours: red, green,",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "Water boils at",
]
NEW = 20


@pytest.fixture(scope="module")
def spec_model(smollm2_path):
    """int8 SmolLM2 with an int4 self-draft and prompt lookup (hybrid), cost model off: every round drafts."""
    spec = SpeculativeConfig(mode="hybrid", num_assistant_tokens=3, num_assistant_tokens_schedule="constant",
                             cost_model=False)
    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym", speculative=spec)


@pytest.fixture(scope="module")
def tok(tokenizer):
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def _modes(model, ov_int8):
    """mode -> (model, generate kwargs)."""
    return {
        "plain": (model, dict(speculative=False)),
        "prompt_lookup": (ov_int8, dict(prompt_lookup_num_tokens=3)),  # with the cost model (batch goodput)
        "hybrid": (model, {}),
        "draft": (model, dict(assistant_model=model.draft_model)),
    }


def _alone(model, tok, prompt, **kwargs):
    ids = tok(prompt, return_tensors="pt").input_ids
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def alone(spec_model, ov_int8, tok):
    """Each prompt decoded alone (batch 1, the decode loop), per mode."""
    return {mode: [_alone(m, tok, p, **kw) for p in PROMPTS] for mode, (m, kw) in _modes(spec_model, ov_int8).items()}


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", ["plain", "prompt_lookup", "hybrid", "draft"])
def test_batched_greedy_equals_each_prompt_alone(spec_model, ov_int8, tok, alone, mode, side):
    model, kwargs = _modes(spec_model, ov_int8)[mode]
    tok.padding_side = side
    batch = tok(PROMPTS, padding=True, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id, **kwargs)
    width = batch.input_ids.shape[1]
    assert out.shape == (len(PROMPTS), width + max(len(a) for a in alone[mode]))
    assert torch.equal(out[:, :width], batch.input_ids)
    for i, expected in enumerate(alone[mode]):
        assert out[i, width:width + len(expected)].tolist() == expected, (mode, side, PROMPTS[i])
    stats = model.last_generate_stats
    assert len(stats.rows) == len(PROMPTS)
    assert [r.new_tokens for r in stats.rows] == [len(a) for a in alone[mode]]
    assert stats.new_tokens == sum(len(a) for a in alone[mode])
    if mode in ("hybrid", "draft"):  # the cost model is off: rows drafted, and verification kept the output
        assert stats.drafted_tokens > 0 and all(r.drafted_tokens > 0 for r in stats.rows)
    tok.padding_side = "left"


def test_a_row_that_ends_early_is_padded_and_the_others_go_on(ov_int8, tok, alone):
    plain = alone["plain"]
    eos = next(t for t in plain[0][2:] if all(t not in row for row in plain[1:4]))  # the first row ends early
    assert plain[0].index(eos) < NEW - 4
    batch = tok(PROMPTS[:4], padding=True, return_tensors="pt")
    out = ov_int8.generate(**batch, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=7,
                           return_dict_in_generate=True, output_scores=True)
    width = batch.input_ids.shape[1]
    first = plain[0].index(eos) + 1
    assert out.sequences[0, width:].tolist() == plain[0][:first] + [7] * (NEW - first)
    for i in (1, 2, 3):
        assert out.sequences[i, width:].tolist() == plain[i]
    assert len(out.scores) == NEW and out.scores[0].shape == (4, ov_int8.runner.vocab_size)
    assert [int(s[1].argmax()) for s in out.scores] == plain[1]  # per-row scores
    assert int(out.scores[-1][0].argmax()) == 7  # past its end, a row scores its padding
    assert [r.new_tokens for r in ov_int8.last_generate_stats.rows] == [first, NEW, NEW, NEW]


def test_the_batch_drafts_less_as_it_fills():
    """Goodput over the whole step: a pass costs the same up to 8 tokens, then grows with its width (compute-bound).
    One row drafts deep; sixteen rows, whose plain pass already fills the flat part, draft far less each."""
    from xpuspec.speculative.batch import RowChoice, batch_draft_lengths
    from xpuspec.speculative.profile import CostProfile

    profile = CostProfile({1: 1.0, 2: 1.0, 8: 1.0, 16: 2.0, 64: 8.0}, 100)
    row = RowChoice([0.8] * 6, 0.0, 6, 2, 1.0)
    alone = batch_draft_lengths([row], profile)
    full = batch_draft_lengths([row] * 16, profile)
    assert alone[0] == 6
    assert max(full) == 1  # only the slot of the padded 2-token step, which costs nothing more
    wide = RowChoice([0.8] * 6, 0.0, 6, 1, 1.0)  # a target whose 1-token pass is not padded
    assert batch_draft_lengths([wide] * 16, profile) == [0] * 16 and batch_draft_lengths([wide], profile) == [6]
    costly = RowChoice([0.8] * 6, 0.5, 6, 2, 1.0)  # a draft model's step costs half a pass
    assert sum(batch_draft_lengths([costly] * 4, profile)) < sum(batch_draft_lengths([row] * 4, profile))


def _request(model, prompt):
    import copy

    from xpuspec.decode import new_request

    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample = NEW, False
    return new_request(prompt, config)


def test_a_sequence_joins_mid_run(ov_int8, tok, alone):
    from xpuspec.engine import Engine, Job

    engine = Engine(ov_int8.runner)
    jobs = [Job(None) for _ in range(3)]
    for job, prompt in zip(jobs, PROMPTS[:3]):
        job.req = _request(ov_int8, tok(prompt).input_ids)
    engine.submit(jobs[0])
    engine.submit(jobs[1])
    for _ in range(5):
        engine.step()
    assert jobs[0].req.produced >= 6 and len(engine.live) == 2
    engine.submit(jobs[2])  # joins between steps
    in_use = ov_int8.runner.blocks_in_use
    while not engine.idle:
        engine.step()
    for job, expected in zip(jobs, alone["plain"][:3]):
        assert job.error is None and job.result[0] == expected
    assert ov_int8.runner.blocks_in_use < in_use  # the rows that left gave their blocks back


def test_a_long_prompt_is_prefilled_in_chunks_its_time_budget_buys(ov_int8, tok, monkeypatch):
    """A 300-token prompt joins a decoding row: its first chunk is ``prefill_chunk`` tokens, each later one what
    the budget buys at the rate measured on the chunks before (on a stand-in clock on which a prefill pass costs
    1 ms a token, 0.05 s buy 50 tokens), and both rows give the outputs they give alone."""
    import types

    import xpuspec.engine as engine_module
    from xpuspec.engine import Engine, Job

    now = [0.0]
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    prompt = tok(" ".join(PROMPTS * 6)).input_ids[:300]
    short = tok(PROMPTS[0]).input_ids
    want = {}
    for name, ids in (("long", prompt), ("short", short)):
        engine = Engine(ov_int8.runner)
        job = Job(None)
        job.req = _request(ov_int8, ids)
        engine.submit(job)
        while not engine.idle:
            engine.step()
        want[name] = job.result[0]
    passes = []
    sequence_type = type(ov_int8.runner.open_sequence())
    forward = sequence_type.forward

    def timed_forward(self, tokens, *args, **kwargs):
        if len(tokens) > 2:  # not the decoding row's 1-token steps, which run 2 wide here
            passes.append(len(tokens))
            now[0] += 0.001 * len(tokens)
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(sequence_type, "forward", timed_forward)
    engine = Engine(ov_int8.runner, prefill_budget_s=0.05, prefill_chunk=64)
    first, second = Job(None), Job(None)
    first.req, second.req = _request(ov_int8, short), _request(ov_int8, prompt)
    engine.submit(first)
    engine.step()
    engine.step()
    assert first.req.produced >= 2
    passes.clear()
    engine.submit(second)
    while not engine.idle:
        engine.step()
    assert passes == [64, 50, 50, 50, 50, 36], passes  # 300 tokens, the last chunk what is left
    assert first.error is None and second.error is None, (first.error, second.error)
    assert first.result[0] == want["short"] and second.result[0] == want["long"]


def test_one_rows_rollback_leaves_the_others_as_fresh_forwards_give_them(ov_int8, tok):
    runner = ov_int8.runner
    pa, pb = tok(PROMPTS[0]).input_ids, tok(PROMPTS[2]).input_ids
    x, y = [pa[-1], 11, 12, 13, 14], [pb[-1], 21]
    a, b = runner.open_sequence(), runner.open_sequence()
    a.forward(pa, logits_to_keep=1)
    b.forward(pb, logits_to_keep=1)
    runner.forward_batch([(a, x), (b, y)])
    a.rollback(3)  # a rejects three drafts; b keeps everything
    ra, rb = runner.forward_batch([(a, [15, 16]), (b, [22, 23, 24])])
    fa, fb = runner.open_sequence(), runner.open_sequence()  # the same passes, each sequence alone
    fa.forward(pa, logits_to_keep=1)
    fa.forward_steps(x)
    fa.rollback(3)
    fb.forward(pb, logits_to_keep=1)
    fb.forward_steps(y)
    assert torch.equal(fa.forward_steps([15, 16]), ra) and torch.equal(fb.forward_steps([22, 23, 24]), rb)
    ga, gb = runner.open_sequence(), runner.open_sequence()  # fresh: the kept history only, no rolled-back drafts
    ga.forward(pa, logits_to_keep=1)
    ga.forward_steps(x[:2])
    gb.forward(pb, logits_to_keep=1)
    gb.forward_steps(y)
    assert torch.equal(ga.forward_steps([15, 16]), ra) and torch.equal(gb.forward_steps([22, 23, 24]), rb)
    for seq in (a, b, fa, fb, ga, gb):
        seq.close()


@pytest.mark.parametrize("bad, message", [
    (dict(input_ids=[[1, 2, 3], [4, 5]]), "ragged"),
    (dict(input_ids=[torch.tensor([1, 2, 3]), torch.tensor([4, 5])]), "ragged"),
    (dict(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=torch.tensor([[1, 0, 1], [1, 1, 1]])), "hole"),
    (dict(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 0]])),
     "left and others on the right"),
    (dict(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=torch.tensor([[0, 0, 0], [1, 1, 1]])),
     "all zeros"),
    (dict(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=torch.tensor([[1, 1], [1, 1]])), "shape"),
    (dict(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=torch.tensor([[2, 1, 1], [1, 1, 1]])), "0"),
])
def test_bad_batches_are_refused(ov_int8, bad, message):
    with pytest.raises(InvalidInputError, match=message):
        ov_int8.generate(**bad, max_new_tokens=2)


def test_beams_and_streamers_refuse_a_batch(ov_int8, tok):
    from transformers import TextStreamer

    batch = tok(PROMPTS[:2], padding=True, return_tensors="pt")
    with pytest.raises(NotImplementedError, match="num_beams"):
        ov_int8.generate(**batch, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="batch size 1"):
        ov_int8.generate(**batch, max_new_tokens=2, streamer=TextStreamer(tok))


def test_a_batch_past_the_kv_budget_is_refused_and_the_model_goes_on(ov_int8, tok, alone):
    runner = ov_int8.runner
    batch = tok(PROMPTS[:2], padding=True, return_tensors="pt")
    runner.set_kv_budget(runner.block_bytes)  # one block (32 tokens): a row of 40 new tokens can never fit
    try:
        with pytest.raises(KVBudgetError, match="KV budget is 1 blocks") as caught:
            ov_int8.generate(**batch, max_new_tokens=2 * NEW, do_sample=False)
        assert "set_kv_budget" in str(caught.value)
        out = ov_int8.generate(**batch, max_new_tokens=NEW, do_sample=False)  # one row fits: the other waits for it
        assert [out[i, batch.input_ids.shape[1]:].tolist() for i in range(2)] == alone["plain"][:2]
    finally:
        runner.set_kv_budget(None)
    out = ov_int8.generate(**batch, max_new_tokens=NEW, do_sample=False)
    assert out[0, batch.input_ids.shape[1]:].tolist() == alone["plain"][0]


def test_a_runner_of_one_sequence_runs_a_batch_row_after_row(tiny_pair):
    """The torch backend verifies one sequence per pass: its engine has one row, and a batch's rows run through it
    one after another, each with its output alone."""
    target, _ = tiny_pair
    rows = [[1, 3, 4], [1, 5, 6]]
    out = target.generate(torch.tensor(rows), max_new_tokens=4, do_sample=False)
    for i, row in enumerate(rows):
        alone = target.generate(torch.tensor([row]), max_new_tokens=4, do_sample=False)
        assert out[i].tolist() == alone[0].tolist()
    assert target._engine_loop().engine.widest == 1


def test_concurrent_threads_become_rows_of_one_batch(ov_int8, tok, alone):
    """The model's lock is held (as model(...) holds it) while four threads call generate: they queue as rows,
    and once the lock is free the engine's thread steps all four in one batch, each with its output alone."""
    out, errors = {}, []

    def work(i):
        try:
            ids = tok(PROMPTS[i], return_tensors="pt").input_ids
            out[i] = ov_int8.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    batcher = ov_int8._engine_loop()
    widest = batcher.engine.widest
    batcher.engine.widest = 0
    with ov_int8._lock:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(batcher.pending) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(batcher.pending) == 4
    for t in threads:
        t.join()
    assert not errors, errors
    assert [out[i] for i in range(4)] == alone["plain"][:4]
    assert batcher.engine.widest == 4
    batcher.engine.widest = max(widest, 4)


# -- sampling: per-row distributions at batch 4, on tiny models (their exact distributions are computable) ----------
@pytest.fixture(scope="module")
def tiny_ov_pair(tmp_path_factory):
    from tiny import tiny_model

    root = tmp_path_factory.mktemp("tiny_ov")
    spec = SpeculativeConfig(mode="draft", draft=str(tiny_model(root / "draft", seed=2)), num_assistant_tokens=2,
                             num_assistant_tokens_schedule="constant", cost_model=False, draft_vocab_size=0)
    return AutoModelForCausalLM.from_pretrained(tiny_model(root / "target", seed=1), device="cpu",
                                                backend="openvino", speculative=spec)


def _exact_marginals(runner, prompt, vocab):
    """P(t2) and P(t3) of the target at temperature 1 after ``prompt``."""
    def probs(ids):
        runner.reset()
        return torch.softmax(runner.forward(ids, logits_to_keep=1)[0, :vocab].double(), dim=-1)

    p1 = probs(prompt)
    p2, p3 = torch.zeros(vocab, dtype=torch.double), torch.zeros(vocab, dtype=torch.double)
    for a in range(vocab):
        q2 = probs(prompt + [a])
        p2 += p1[a] * q2
        for b in range(vocab):
            p3 += p1[a] * q2[b] * probs(prompt + [a, b])
    runner.reset()
    return p2, p3


def _sampled(model, prompt, calls):
    """Counts of t2 and t3 per row over ``calls`` batches of four rows of ``prompt``."""
    vocab = model.config.vocab_size
    counts = torch.zeros(4, 2, vocab, dtype=torch.double)
    ids = torch.tensor([prompt] * 4)
    for _ in range(calls):
        out = model.generate(ids, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             eos_token_id=None, pad_token_id=0)
        for row in range(4):
            t2, t3 = out[row, len(prompt) + 1:len(prompt) + 3].tolist()
            counts[row, 0, t2] += 1
            counts[row, 1, t3] += 1
    return counts / calls


def _tv(p, q):
    return 0.5 * float((p - q).abs().sum())


def test_rejection_sampling_per_row_follows_the_target_at_batch_4(tiny_ov_pair, monkeypatch):
    """1000 rows: sampling noise puts TV near 0.05; a rule that accepts every draft follows the draft instead."""
    import xpuspec.decode as decode

    torch.manual_seed(0)
    prompt = [1, 5, 9]
    vocab = tiny_ov_pair.config.vocab_size
    p2, p3 = _exact_marginals(tiny_ov_pair.runner, prompt, vocab)
    seen = _sampled(tiny_ov_pair, prompt, 250)
    assert tiny_ov_pair.last_generate_stats.drafted_tokens > 0
    assert _tv(seen[:, 0].mean(0), p2) < 0.08 and _tv(seen[:, 1].mean(0), p3) < 0.08
    assert max(_tv(seen[row, 0], p2) for row in range(4)) < 0.15

    def accept_everything(drafts, draft_probs, target_probs, generator=None):
        return len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1))

    monkeypatch.setattr(decode, "rejection_sample", accept_everything)
    broken = _sampled(tiny_ov_pair, prompt, 100)
    assert _tv(broken[:, 0].mean(0), p2) > 0.2


def test_a_draft_cost_estimated_under_another_load_is_measured_again(tmp_path):
    """The draft step a batch's goodput weighs comes from earlier requests. Where it says drafting cannot pay (here
    forced a million times too dear, as a load that has since gone could make it), each new request still drafts
    once with the model, measures the step itself, and the estimate kept for later requests is the measured one."""
    from tiny import tiny_model

    spec = SpeculativeConfig(mode="draft", draft=str(tiny_model(tmp_path / "draft", seed=2)), num_assistant_tokens=2,
                             draft_vocab_size=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "target", seed=1), device="cpu",
                                                 backend="openvino", speculative=spec)
    ids = torch.tensor([[1, 5, 9], [2, 6, 10]])
    model.generate(ids, max_new_tokens=8, do_sample=False)
    policies = [p for book in model._policies._by_draft.values() for p in book.values()]
    assert policies and all(p.draft_ratio is not None for p in policies)
    for p in policies:  # only the estimate is stale: no request stopped the model
        p.draft_ratio, p.failures, p.cannot_pay = 1e6, 0, 0
    model.generate(ids, max_new_tokens=8, do_sample=False)
    assert model.last_generate_stats.drafted_tokens > 0
    assert all(p.draft_ratio < 1e3 for p in policies)


def test_the_batch_profile_is_measured_once(tmp_path):
    """The first speculative row's sequence has no KV blocks for the widest batch widths, so the sweep measures
    widths 1-16 on it; later rows do not sweep again (each did, a second of setup per request in the server)."""
    from tiny import tiny_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "target", seed=1), device="cpu",
                                                 backend="openvino")
    ids = torch.tensor([[1, 5, 9, 1, 5], [2, 6, 10, 2, 6]])
    setup = []
    for _ in range(3):
        model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
        setup.append(model.last_generate_stats.setup_s)
    assert setup[0] > 0 and setup[1] == setup[2] == 0, setup


def test_a_speculative_load_measures_the_batch_widths_so_the_first_batch_does_not_sweep(tmp_path):
    """A model loaded with a speculative mode on a runner that batches sweeps the batch widths at load: the server's
    first batch of speculative requests then spends no second on a sweep (it did, inside the first timed requests)."""
    from tiny import tiny_model
    from xpuspec.speculative.batch import BATCH_SWEEP_WIDTHS

    model = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "target", seed=1), device="cpu",
                                                 backend="openvino", speculative="prompt_lookup")
    assert model._costs.profile.widest == BATCH_SWEEP_WIDTHS[-1]
    model.generate(torch.tensor([[1, 5, 9, 1, 5], [2, 6, 10, 2, 6]]), max_new_tokens=8, do_sample=False)
    assert [s.setup_s for s in model.last_generate_stats.rows] == [0, 0]


class _Events:
    """A streamer that records ``(name, "token" | "end")`` in a shared list, and sets ``started`` on its first
    token after the prompt."""

    def __init__(self, name, events):
        self.name, self.events, self.started, self.puts = name, events, threading.Event(), 0

    def put(self, value):
        self.puts += 1
        if self.puts > 1:  # the first put is the prompt
            self.events.append((self.name, "token"))
            self.started.set()

    def end(self):
        self.events.append((self.name, "end"))


@pytest.mark.parametrize("native", [False, True])
def test_a_short_request_is_not_held_behind_a_long_one(ov_int8, tok, alone, monkeypatch, native):
    """Head-of-line: a long request runs (its first token is out) when a short one arrives from another thread; the
    short one joins the engine between steps and ends first, and both give their output alone. ``native``: the
    runner steps one token at a time, so that the long request runs in openvino_genai's engine (the native phase),
    which yields to the arrival and the long row goes on in the engine."""
    from xpuspec.runner import RunnerTraits

    if native:
        monkeypatch.setattr(ov_int8.runner, "traits", RunnerTraits(fixed_verify_width=True, batches=True))
    long_ids, short_ids = tok(PROMPTS[3], return_tensors="pt").input_ids, tok(PROMPTS[1], return_tensors="pt").input_ids
    long_alone = ov_int8.generate(long_ids, max_new_tokens=160, do_sample=False, eos_token_id=None)
    short_alone = ov_int8.generate(short_ids, max_new_tokens=4, do_sample=False)
    events, out, errors = [], {}, []
    long_streamer = _Events("long", events)

    def run(name, ids, streamer, **kwargs):
        try:
            out[name] = ov_int8.generate(ids, do_sample=False, streamer=streamer, **kwargs)
            out[name + " engine"] = ov_int8.last_generate_stats.engine
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    long = threading.Thread(target=run, args=("long", long_ids, long_streamer),
                            kwargs=dict(max_new_tokens=160, eos_token_id=None))
    long.start()
    assert long_streamer.started.wait(600)
    run("short", short_ids, _Events("short", events), max_new_tokens=4)
    long.join()
    assert not errors, errors
    assert events.index(("short", "end")) < events.index(("long", "end"))
    assert ("long", "token") in events[events.index(("short", "end")):]  # the long one was still running
    assert torch.equal(out["short"], short_alone)
    if not native:
        assert torch.equal(out["long"], long_alone)
        return
    # it began natively; its rest ran in the engine, whose 1-token steps on this runner compute as the patched
    # traits say only where the CPU needs no padding: compare the tokens before the yield
    assert out["long engine"] == "native, then xpuspec"
    before = events.index(next(e for e in events if e[0] == "short"))
    assert before < 160 and torch.equal(out["long"][0, :long_ids.shape[1] + before],
                                        long_alone[0, :long_ids.shape[1] + before])
