"""xpuspec bench: every system on tiny models, the report and its schema, roofline arithmetic, prompt
sets, CLI errors, and the CI smoke run on SmolLM2 (shape of the report only, never a speed)."""

import json
import os
import subprocess
import sys
from copy import deepcopy
from pathlib import Path

import pytest

from tiny import tiny_model
from xpuspec.bench import prompts, report, roofline
from xpuspec.bench.harness import BenchSettings, run
from xpuspec.bench.memory import LOW_MEMORY_SHARE, BenchMemoryError, check_loaded, memory_mib
from xpuspec.bench.systems import SYSTEMS as ALL_SYSTEMS, parse_systems, unavailable

#: The systems that run here without optional packages (the llama.cpp ones need llama-cpp-python: test_llamacpp.py).
SYSTEMS = {n: c for n, c in ALL_SYSTEMS.items() if c.requires is None}

ROOT = Path(__file__).resolve().parents[1]
#: Stand-in prompts in the tiny models' 16-word vocabulary: one repetitive ("edit"-like), one not.
TINY_PROMPTS = {"code": ["w1 w2 w3 w4 w5 w6"], "edit": ["w7 w8 w9 w7 w8 w9 w7 w8"]}


def test_roofline_arithmetic_on_a_known_case():
    # 33 GB/s over SmolLM2's 133.6 MB of INT8 weights: 247 tokens/s, the figure issue 4 quotes.
    assert roofline.roofline_tokens_per_s(33e9, 133_600_000) == pytest.approx(247.0, abs=0.1)
    assert roofline.percent_of_roofline(123.5, 33e9, 133_600_000) == pytest.approx(50.0, abs=0.05)
    assert roofline.percent_of_roofline(494.0, 33e9, 133_600_000) == pytest.approx(200.0, abs=0.1)
    with pytest.raises(ValueError):
        roofline.roofline_tokens_per_s(0, 1)


def test_read_bandwidth_is_the_bytes_over_the_fastest_pass(monkeypatch):
    """Deterministic: the clock is a stand-in that makes the passes take 2, 0.5 and 1 s; the bandwidth is the array's
    bytes over the fastest, and every byte was summed once per pass (the sums count them)."""
    ticks = iter([0.0, 2.0, 10.0, 10.5, 20.0, 21.0])
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(ticks))
    sums = []
    real_sum = roofline.np.sum
    monkeypatch.setattr(roofline.np, "sum", lambda part: sums.append(part.size) or real_sum(part))
    array_bytes = 4 * 2**20
    assert roofline.read_bandwidth(array_bytes=array_bytes, passes=3, threads=2) == array_bytes / 0.5
    assert sum(sums) == 4 * (array_bytes // 4) and len(sums) == 4 * 2  # the warm-up and 3 timed passes, 2 parts each


def test_prompt_spec():
    assert prompts.parse_prompt_spec("4") == {"code": 4, "prose": 4, "edit": 4}
    assert prompts.parse_prompt_spec("code,edit") == {"code": 0, "edit": 0}
    assert prompts.parse_prompt_spec("code:2,edit,3") == {"code": 2, "edit": 3}
    for bad, phrase in [("", "empty"), ("poetry", "Unknown prompt set 'poetry'"), ("code:0", "Bad count"),
                        ("code:x", "Bad count"), ("0", "Bad count")]:
        with pytest.raises(ValueError, match=phrase):
            prompts.parse_prompt_spec(bad)


def test_edit_prompts_quote_pinned_stdlib_sources():
    import colorsys
    import inspect

    edit = prompts.edit_prompts()
    assert len(edit) == len(prompts.EDIT_FUNCTIONS) >= 16
    assert inspect.getsource(colorsys.rgb_to_yiq) in edit[0]
    assert all(p.endswith("```python\n") and "def " in p for p in edit)
    assert "rename the parameter `y` to `y_in`" in edit[1]
    fingerprint = prompts.fingerprint({"edit": edit})
    if sys.version_info[:2] == (3, 11):  # the pinned hashes are CPython 3.11's
        assert fingerprint["edit_sources_changed"] == []
    assert fingerprint["sets"]["edit"]["count"] == len(edit)
    assert prompts.select({"edit": 3})["edit"] == [edit[0], edit[6], edit[12]]


def test_system_names_are_checked():
    assert "hf-assisted" not in parse_systems(None, has_draft=False)
    assert parse_systems(None, has_draft=True, has_head=True) == [n for n in ALL_SYSTEMS if unavailable(n) is None]
    assert "xpuspec-spec:eagle3" not in parse_systems(None, has_draft=True)
    with pytest.raises(ValueError, match="xpuspec-spec:eagle3 needs an EAGLE-3 head: add --head FOLDER"):
        parse_systems("xpuspec,xpuspec-spec:eagle3", has_draft=True)
    from xpuspec.bench.batch import parse_batch_systems

    assert "xpuspec-eagle3" not in parse_batch_systems(None) and "xpuspec-eagle3" in parse_batch_systems(None, True)
    with pytest.raises(ValueError, match="xpuspec-eagle3 needs an EAGLE-3 head"):
        parse_batch_systems("xpuspec-plain,xpuspec-eagle3")
    with pytest.raises(ValueError, match="Unknown system 'vllm'; valid systems: hf, hf-assisted"):
        parse_systems("hf,vllm", has_draft=False)
    with pytest.raises(ValueError, match="need a draft model"):
        parse_systems("xpuspec-spec:draft", has_draft=False)
    with pytest.raises(ValueError, match="listed twice"):
        parse_systems("hf,hf", has_draft=False)
    with pytest.raises(ValueError, match="--baseline genai is not among"):
        BenchSettings(systems=["hf"], baseline="genai").check()
    with pytest.raises(ValueError, match="--draft-vocab-size must be >= 0"):
        BenchSettings(systems=["hf"], draft_vocab_size=-5).check()
    with pytest.raises(ValueError, match="--draft-context-length must be >= 0"):
        BenchSettings(systems=["hf"], draft_context_length=-1).check()
    for bad, phrase in ((dict(low_bit="int3"), "--low-bit takes one of int4_sym"),
                        (dict(draft_low_bit="int3"), "--draft-low-bit takes one of"),
                        (dict(num_assistant_tokens=0), "--num-assistant-tokens must be at least 1"),
                        (dict(bandwidth=-5e9), "--bandwidth must be a positive number of GB/s, not -5"),
                        (dict(bandwidth=0.0), "--bandwidth must be a positive")):
        with pytest.raises(ValueError, match=phrase):
            BenchSettings(systems=["hf"], **bad).check()


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """Every system on a tiny target (4 layers, so layer-skip has middle layers) with a tiny draft and a random
    EAGLE-3 head: 2 prompts x 2 repeats, 8 tokens, in its own cache."""
    from transformers import AutoConfig

    from xpuspec.speculative.eagle3 import new_head

    root = tmp_path_factory.mktemp("bench")
    target, draft = tiny_model(root / "target", seed=1, layers=4), tiny_model(root / "draft", seed=2)
    head = new_head(AutoConfig.from_pretrained(target), root / "head", layer_ids=[1, 2, 3])
    old = os.environ.get("XPUSPEC_CACHE")
    os.environ["XPUSPEC_CACHE"] = str(root / "cache")
    try:
        settings = BenchSettings(model=str(target), draft=str(draft), systems=list(SYSTEMS), max_new_tokens=8,
                                 repeats=2, num_assistant_tokens=3, draft_vocab_size=8, draft_context_length=3,
                                 bandwidth=10e9, head=str(head))
        yield run(settings, progress=False, log_dir=root / "logs", prompts=TINY_PROMPTS)
    finally:
        if old is None:
            os.environ.pop("XPUSPEC_CACHE")
        else:
            os.environ["XPUSPEC_CACHE"] = old


def test_every_system_runs_on_tiny_models(tiny_report):
    report.validate(tiny_report)
    samples = tiny_report["samples"]
    assert len(samples) == len(SYSTEMS) * 2 * 2
    assert all(s["new_tokens"] == 8 for s in samples)
    # the call's clock: its first token, then its last, then its return (ttft + decode <= total)
    assert all(0 <= s["ttft_s"] and 0 <= s["decode_s"] and s["ttft_s"] + s["decode_s"] <= s["total_s"] for s in samples)
    total = tiny_report["machine"]["memory_mib"]
    assert total > 0 and all(0 < s["memory_available_mib"] <= total for s in samples)
    with open("/proc/loadavg") as f:  # the kernel's own figures, read after the run
        now = [float(x) for x in f.read().split()[:3]]
    assert all(len(s["load_average"]) == 3 and min(s["load_average"]) >= 0 for s in samples)
    assert tiny_report["load_average"]["end"] == pytest.approx(now, abs=1.0)
    assert f"load average {tiny_report['load_average']['start'][0]:.2f} at the start" in report.markdown(tiny_report)
    setup = tiny_report["setup"]
    for name, info in tiny_report["systems"].items():
        assert info["peak_rss_bytes"] > info["idle_rss_bytes"] > 0, name
        if info["family"] == "ir":  # every OpenVINO system ran the same IR
            ir_bytes = os.path.getsize(os.path.join(setup["ir"], "openvino_model.bin"))
            if name == "xpuspec-pp2":  # both stages hold the tied embedding
                assert info["weight_bytes"] > ir_bytes, name
            else:
                assert info["weight_bytes"] == ir_bytes, name
            assert info["settings"].get("ir") == setup["ir"], name
    assert tiny_report["systems"]["genai-spec"]["settings"]["draft_ir"] == setup["draft_ir"]
    assert tiny_report["systems"]["xpuspec-spec:draft"]["settings"]["draft_ir"] == setup["draft_ir"]
    for name in ("xpuspec-spec:self", "xpuspec-spec:hybrid", "xpuspec-spec:draft", "xpuspec-overlap:draft"):
        assert tiny_report["systems"][name]["settings"]["draft_head_tokens"] == 8, name  # --draft-vocab-size 8 of 16
        assert tiny_report["systems"][name]["settings"]["speculative"]["draft_context_length"] == 3, name
    summary = tiny_report["summary"]
    for name in SYSTEMS:
        figures = summary[name]["all"]
        assert figures["calls"] == 4 and set(summary[name]) == {"all", "code", "edit", "rss_mib"}
        assert figures["audit"]["VIOLATION"] == 0, (name, figures["audit"])
        assert (figures["acceptance_rate"] is not None) == (name in ("genai-spec", "genai-eagle3") or name.startswith(
            ("xpuspec-spec", "xpuspec-overlap"))), name
        assert (figures["idle_fraction"] is not None) == name.startswith("xpuspec"), name
    # the reference systems and lossless speculation reproduce plain greedy output exactly
    for name in ("hf", "xpuspec", "xpuspec-spec:self", "xpuspec-spec:lookup", "xpuspec-spec:draft",
                 "xpuspec-overlap:self", "xpuspec-overlap:draft", "xpuspec-pp2"):
        assert summary[name]["all"]["audit"]["identical"] == 2, name
    assert summary["genai"]["all"]["ratio_to_baseline"] == 1.0
    assert summary["xpuspec"]["all"]["mean_accepted_length"] == 1.0
    assert all(summary[name]["all"]["mean_accepted_length"] >= 1.0 for name in SYSTEMS)


def test_report_table_compare_and_plot(tiny_report, tmp_path):
    table = report.markdown(tiny_report)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for name in SYSTEMS:
        tables = 3 if name.startswith("xpuspec") else 2  # main, per-set, and idle-fraction table
        assert sum(line.startswith(f"| {name} |") for line in rows) == tables
    assert "| system | code | edit |" in table and "vs genai" in table
    faster = deepcopy(tiny_report)
    stat = faster["summary"]["xpuspec"]["all"]["decode_tokens_per_s"]
    stat["median"] *= 2
    (tmp_path / "b.json").write_text(json.dumps(faster))
    lines = report.compare(tiny_report, report.load(tmp_path / "b.json")).splitlines()
    assert next(line for line in lines if line.startswith("| xpuspec |")).split(" | ")[3] == "2.00x"
    other = deepcopy(tiny_report)
    other["settings"]["max_new_tokens"] = 64
    assert "settings differ: max_new_tokens 8 vs 64" in report.compare(tiny_report, other)
    png = report.plot(tiny_report, tmp_path / "bench.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calls_that_began_short_of_memory_are_named_and_loading_stops_there(tiny_report):
    assert "Short of memory" not in report.markdown(tiny_report)
    short = deepcopy(tiny_report)
    total = short["machine"]["memory_mib"]
    short["samples"][3]["memory_available_mib"] = LOW_MEMORY_SHARE * total * 0.9
    sample = short["samples"][3]
    line = next(line for line in report.markdown(short).splitlines() if "Short of memory" in line)
    assert f"1 of {len(short['samples'])} timed calls" in line
    assert f"{sample['system']} ({sample['set']} prompt {sample['prompt']})" in line
    available, machine = memory_mib()
    assert machine == pytest.approx(total, abs=1) and 0 < available <= machine
    check_loaded(["a", "b"], (LOW_MEMORY_SHARE * 1.1 * machine, machine))  # enough
    check_loaded(["a", "b"], None)  # unknown: no check
    with pytest.raises(BenchMemoryError, match=r"2 systems loaded side by side \(a, b\).*--interleave repeat"):
        check_loaded(["a", "b"], (LOW_MEMORY_SHARE * 0.9 * machine, machine))


def test_schema_rejects_a_broken_report(tiny_report, tmp_path):
    broken = deepcopy(tiny_report)
    broken["samples"][0]["audit"]["status"] = "fine"
    with pytest.raises(ValueError, match="samples/0/audit/status"):
        report.validate(broken)
    del broken["summary"]
    with pytest.raises(ValueError, match="summary"):
        report.validate(broken)
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        report.load(tmp_path / "x.json")


def test_the_schema_takes_every_system_family(tiny_report):
    """A report of any system validates, also of one this machine cannot run (the llama.cpp systems' GGUF)."""
    families = {cls.family for cls in ALL_SYSTEMS.values()}
    assert "gguf" in families
    for family in families:
        report_ = deepcopy(tiny_report)
        for record in report_["systems"].values():
            record["family"] = family
        report.validate(report_)


def test_chat_prompts_are_user_turns_in_the_chat_template(tokenizer):
    """``--chat``: every system is given the prompt as the server would render a chat (the template's user turn and
    generation prompt, no second BOS); without it, the raw text. A model without a chat template is refused."""
    from xpuspec.bench.prompts import token_ids

    text = "Summarize the following news report in two sentences."
    assert token_ids(tokenizer, text) == tokenizer(text).input_ids
    chat = token_ids(tokenizer, text, chat=True)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    assert tokenizer.decode(chat) == rendered and rendered.startswith("<|im_start|>") and text in rendered
    assert rendered.endswith("<|im_start|>assistant\n")

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="--chat: the model's tokenizer has no chat template"):
        token_ids(NoTemplate(), text, chat=True)


def test_ttft_covers_the_prefill(ov_int8, tokenizer):
    """The bench's clock of a call (its streamer) against the engine's own of the same call: the first token
    arrives after the call began, after the target's prefill forward (``prefill_s``, timed inside the engine) and
    no later than the engine's own first token; every token comes through the streamer, one step at a time."""
    from xpuspec.bench.systems import Arrivals, _hf_streamer

    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    arrivals = Arrivals()
    out = ov_int8.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           streamer=_hf_streamer(arrivals))
    stats = ov_int8.last_generate_stats
    sample = arrivals.sample(out[0, ids.shape[1]:].tolist())
    assert len(sample.tokens) == sum(arrivals.sizes) == 12 and sample.steps == len(arrivals.sizes)
    assert 0 < stats.prefill_s <= sample.ttft_s, (stats.prefill_s, sample.ttft_s)
    assert stats.prefill_s <= stats.ttft_s
    assert sample.ttft_s + sample.decode_s <= sample.total_s


def test_arrivals_on_a_stand_in_clock(monkeypatch):
    """Arrivals' arithmetic, exactly: start at 1 s, 1 token at 1.25 s, 2 at 1.5 s, the return at 2 s."""
    from xpuspec.bench import systems

    ticks = iter([1.0, 1.25, 1.5, 2.0])
    monkeypatch.setattr(systems.time, "perf_counter", lambda: next(ticks))
    arrivals = systems.Arrivals()
    arrivals.add(1)
    arrivals.add(0)  # an empty step is no arrival
    arrivals.add(2)
    sample = arrivals.sample([7, 8, 9])
    assert (sample.ttft_s, sample.decode_s, sample.total_s, sample.steps, sample.first_step_tokens) == (
        0.25, 0.25, 1.0, 2, 1)


def _cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "xpuspec", "bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_cli_errors_are_one_line():
    for args, phrase in [(["--systems", "hf,vllm"], "valid systems: hf, hf-assisted"),
                         (["--systems", "hf-assisted"], "need a draft model"),
                         (["--prompts", "poetry"], "Unknown prompt set 'poetry'"),
                         (["--batch-size", "1,0"], "give positive integers separated by commas"),
                         (["--batch-size", "4", "--systems", "genai"], "the systems are xpuspec-plain"),
                         (["--batch-size", "4", "--plot", "x.png"], "do not apply with --batch-size"),
                         (["--batch-size", "4", "--chat"], "do not apply with --batch-size"),
                         (["--batch-size", "4", "--rounds", "0"], "--rounds 0: give 1 or more"),
                         (["--batch-size", "4", "--batch-prompts", "code:abc"], "Bad count in --batch-prompts item"),
                         (["--batch-prompts", "heldout:4"], "add --batch-size"),
                         (["--head", "/nonexistent/head"], "--head /nonexistent/head: ")]:
        done = _cli(*args)
        assert done.returncode == 2 and phrase in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_batch_size_runs_the_batched_bench(smollm2_path, tmp_path):
    """``xpuspec bench --batch-size``: each named system decodes every row of each batch; figures per batch size.
    The rows here are two prose prompts of the bench's sets (``--batch-prompts``), the third row the first again."""
    from xpuspec.bench.batch import batch_rows
    from xpuspec.bench.prompts import select

    assert batch_rows(3, "prose:2") == (select({"prose": 2})["prose"] * 2)[:3]
    out = tmp_path / "batch.json"
    done = _cli("--batch-size", "1,3", "--systems", "xpuspec-lookup", "--max-new-tokens", "6", "--repeats", "1",
                "--batch-prompts", "prose:2", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["system"] for r in results] == ["xpuspec-lookup"]
    assert set(results[0]["by_batch"]) == {"1", "3"} and len(results[0]["rounds"]) == 1
    for size, figures in results[0]["by_batch"].items():  # counts, not speeds: every row made its 6 tokens
        assert figures["new_tokens"] == 6 * int(size) and 0 <= figures["accepted"] <= figures["drafted"], figures
    assert sum(line.startswith("| xpuspec-lookup |") for line in done.stdout.splitlines()) == 2
    assert results[0]["ov_config"] == {"ENABLE_CPU_PINNING": False}  # as the single-request bench
    (load,) = results[0]["load_average"]
    assert len(load["start"]) == len(load["end"]) == 3
    assert 'OpenVINO properties of every system: {"ENABLE_CPU_PINNING": false}' in done.stdout


@pytest.mark.slow
def test_ci_smoke_all_systems_on_smollm2(smollm2_path, tmp_path):
    """CI: 2 prompts, 8 tokens, SmolLM2, every system (SmolLM2 drafts for itself). Shape only. One system is
    loaded at a time (--interleave repeat): the 16 workers loaded together peak at 19.3 GiB, which on a 24 GiB
    machine next to the test process took this test from 205 s alone to 484 s in the suite."""
    runnable = parse_systems(None, has_draft=True)  # the default --systems with --draft and no --head
    out = tmp_path / "smoke.json"
    done = _cli(f"@{ROOT / 'benchmarks' / 'ci-smoke.args'}", "--json", str(out), "--plot", str(tmp_path / "smoke.png"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = report.load(out)
    assert [s["system"] for s in result["samples"]] == [name for name in runnable for _ in range(2)]  # per system
    assert set(result["summary"]) == set(runnable)
    table_rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    idle_rows = 1 + sum(name.startswith("xpuspec") for name in runnable)  # the idle-fraction table
    assert len(table_rows) == 2 * (len(runnable) + 1) + idle_rows
    assert (tmp_path / "smoke.png").stat().st_size > 0


def test_the_batched_peers_run_with_the_same_cpu_pinning_as_the_single_request_bench(tmp_path, monkeypatch):
    """--batch-size ran openvino_genai with its default thread pinning and xpuspec without; both now get the
    single-request bench's ENABLE_CPU_PINNING (openvino_genai's pipeline and draft model at the module boundary)."""
    from argparse import Namespace
    from types import SimpleNamespace

    import openvino_genai

    import xpuspec
    from xpuspec.bench import batch
    from xpuspec.bench.systems import ov_properties

    seen = {}

    class Pipeline:
        def __init__(self, folder, device, **kwargs):
            seen["genai"] = kwargs

        def generate(self, prompts, config):
            return SimpleNamespace(perf_metrics=SimpleNamespace(get_ttft=lambda: SimpleNamespace(mean=1.0)))

    real = xpuspec.AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):
        seen["xpuspec"] = kwargs.get("ov_config")  # the last load: _xpuspec's
        return real(*args, **kwargs)

    monkeypatch.setattr(openvino_genai, "LLMPipeline", Pipeline)
    monkeypatch.setattr(openvino_genai, "draft_model", lambda folder, device, **kwargs: seen.setdefault("draft", kwargs))
    monkeypatch.setattr(xpuspec.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path / "cache"))
    args = Namespace(model=str(tiny_model(tmp_path / "tiny", seed=1)), draft=None, low_bit="int8_asym",
                     draft_low_bit="int8_asym", max_new_tokens=2, repeats=1, batch_prompts=None)
    batch._genai("genai-cb-draft", args, [1])
    figures = batch._xpuspec("xpuspec-plain", args, [2])
    pinning = ov_properties(None)["ENABLE_CPU_PINNING"]
    assert pinning is False and figures[2]["aggregate"] > 0
    assert seen["genai"]["ENABLE_CPU_PINNING"] is seen["draft"]["ENABLE_CPU_PINNING"] is pinning
    assert seen["xpuspec"]["ENABLE_CPU_PINNING"] is pinning
    assert batch.OV_PROPERTIES == {"ENABLE_CPU_PINNING": pinning}  # what the report records
