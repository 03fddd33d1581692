"""Batched throughput: xpuspec's engine beside openvino_genai's continuous batching, on the same IR and prompts.

    xpuspec bench --batch-size 1,4,8 [--model smollm2-135m-instruct] [--draft M] [--max-new-tokens 48]
    python -m xpuspec.bench.batch --batch-size 1,4,8 ...            (the same)

Systems (each in a process of its own, so that its peak RSS is its own): ``xpuspec-plain``, ``xpuspec-lookup``
(prompt lookup, cost model on), ``xpuspec-draft`` (the ``--draft`` model, else the target's ``--draft-low-bit``
self-draft), ``xpuspec-hybrid`` (that draft and prompt lookup), ``genai-cb`` (``openvino_genai.LLMPipeline`` with a
``SchedulerConfig``), ``genai-cb-lookup`` (``prompt_lookup=True``), ``genai-cb-draft`` (``draft_model=`` the same
draft's IR). The target IR is ``--low-bit`` (default int8_asym). Every call generates exactly ``--max-new-tokens``
per prompt (EOS suppressed by ``min_new_tokens``); the rows are :data:`PROMPTS`, or ``--batch-prompts`` sets'
prompts (``heldout:8``: the news reports no default was tuned on). Each batch size is timed ``--repeats`` times
after one warm-up, and the sequence of systems runs ``--rounds`` times in turn; figures are medians: aggregate
tokens/s (all rows' new
tokens over the call's wall time), per-request tokens/s (a row's new tokens over its own time), TTFT, and the
process's peak RSS. Both tools run with the single-request bench's CPU pinning setting (:data:`OV_PROPERTIES`:
``ENABLE_CPU_PINNING`` off, xpuspec's default; openvino_genai pins by default), recorded in each system's result,
with the machine's load averages before and after each of its runs.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import List, Optional

from .load import load_average
from .systems import ov_properties

#: OpenVINO properties both tools get: the single-request bench's CPU pinning (:func:`.systems.ov_properties`).
OV_PROPERTIES = {"ENABLE_CPU_PINNING": ov_properties(None)["ENABLE_CPU_PINNING"]}
SYSTEMS = ("xpuspec-plain", "xpuspec-lookup", "xpuspec-draft", "xpuspec-hybrid", "xpuspec-eagle3", "genai-cb",
           "genai-cb-lookup", "genai-cb-draft")
PROMPTS = [
    "def quicksort(items):\n    \"\"\"Sort a list of numbers and return the sorted list.\"\"\"\n",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "import json\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "Explain in simple words why the sky is blue.",
    "class LinkedList:\n    def __init__(self):\n        self.head = None\n\n    def append(self, value):\n",
    "List five tips for writing clear technical documentation.",
    "def parse_date(text):\n    \"\"\"Parse an ISO date string like 1999-12-31 into a (year, month, day) tuple.\"\"\"\n",
    "Summarize the plot of Romeo and Juliet in three sentences.",
]


def batch_rows(batch: int, spec: Optional[str] = None) -> List[str]:
    """``batch`` rows: :data:`PROMPTS`, or with ``spec`` (``--batch-prompts``, as ``--prompts``: ``"heldout:8"``) the
    bench's prompt sets' prompts, repeated in order.

    Raises:
        ValueError: a bad ``spec`` (an unknown set, a count below 1).
    """
    from .prompts import parse_prompt_spec, select

    if spec is None:
        pool = PROMPTS
    else:
        try:
            counts = parse_prompt_spec(spec)
        except ValueError as exc:  # its messages name --prompts, whose spelling this option shares
            raise ValueError(str(exc).replace("--prompts", "--batch-prompts")) from exc
        pool = [t for texts in select(counts).values() for t in texts]
    return [pool[i % len(pool)] for i in range(batch)]


def _xpuspec(system: str, args: argparse.Namespace, sizes: List[int]) -> dict:
    from xpuspec import AutoModelForCausalLM, AutoTokenizer, SpeculativeConfig

    new, repeats = args.max_new_tokens, args.repeats
    spec = None
    if system in ("xpuspec-draft", "xpuspec-hybrid"):
        mode = "hybrid" if system == "xpuspec-hybrid" else "draft" if args.draft else "self"
        spec = SpeculativeConfig(mode=mode, draft=args.draft, draft_low_bit=args.draft_low_bit)
    elif system == "xpuspec-eagle3":
        spec = SpeculativeConfig(mode="eagle3", draft=args.head)
    model = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit=args.low_bit,
                                                 speculative=spec, ov_config=dict(OV_PROPERTIES))
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token, tok.padding_side = tok.pad_token or tok.eos_token, "left"
    kwargs = dict(prompt_lookup_num_tokens=3) if system == "xpuspec-lookup" else {}
    out = {}
    for b in sizes:
        batch = tok(batch_rows(b, args.batch_prompts), padding=True, return_tensors="pt")
        runs = []
        for r in range(1 + repeats):
            t0 = time.perf_counter()
            model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
            wall = time.perf_counter() - t0
            stats = model.last_generate_stats
            rows = stats.rows or [stats]
            if r:
                runs.append(dict(aggregate=sum(s.new_tokens for s in rows) / wall,
                                 per_request=statistics.mean(s.new_tokens / (s.ttft_s + s.decode_s) for s in rows),
                                 ttft_ms=1000 * statistics.mean(s.ttft_s for s in rows),
                                 new_tokens=sum(s.new_tokens for s in rows),
                                 drafted=sum(s.drafted_tokens for s in rows),
                                 accepted=sum(s.accepted_tokens for s in rows)))
        out[b] = _median(runs)
    return out


def _genai(system: str, args: argparse.Namespace, sizes: List[int]) -> dict:
    import openvino_genai as og

    from xpuspec import AutoModelForCausalLM

    new, repeats = args.max_new_tokens, args.repeats
    target = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit=args.low_bit)
    folder = str(target.runner.folder)  # the IR xpuspec runs
    extra = {}
    if system == "genai-cb-draft":  # the IR xpuspec-draft drafts with
        draft = AutoModelForCausalLM.from_pretrained(args.draft or args.model, device="cpu",
                                                     load_in_low_bit=args.draft_low_bit)
        extra["draft_model"] = og.draft_model(str(draft.runner.folder), "CPU", **OV_PROPERTIES)
        del draft
    if system == "genai-cb-lookup":
        extra["prompt_lookup"] = True
    del target
    scheduler = og.SchedulerConfig()
    scheduler.cache_size = 1  # GiB of KV cache
    scheduler.max_num_batched_tokens = 2048
    pipe = og.LLMPipeline(folder, "CPU", scheduler_config=scheduler, **extra, **OV_PROPERTIES)
    config = og.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = new
    if system == "genai-cb-lookup":
        config.num_assistant_tokens, config.max_ngram_size = 3, 3
    if system == "genai-cb-draft":
        config.num_assistant_tokens = 4
    out = {}
    for b in sizes:
        runs = []
        for r in range(1 + repeats):
            t0 = time.perf_counter()
            res = pipe.generate(batch_rows(b, args.batch_prompts), config)
            wall = time.perf_counter() - t0
            if r:
                metrics = res.perf_metrics
                runs.append(dict(aggregate=b * new / wall, per_request=new / wall,
                                 ttft_ms=float(metrics.get_ttft().mean)))
        out[b] = _median(runs)
    return out


def _median(runs: List[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _child(args) -> None:
    sizes = parse_sizes(args.batch_size)
    run = _xpuspec if args.system.startswith("xpuspec") else _genai
    figures = run(args.system, args, sizes)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"system": args.system, "peak_rss_mib": rss, "by_batch": figures}))


BATCH_PROMPTS_HELP = ("the rows: prompts of the bench's sets, as --prompts (heldout:8 for text xpuspec was not tuned "
                      "on), repeated to each batch size; default: the batched bench's 8 short prompts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The batched bench's options (``python -m xpuspec.bench.batch``; ``xpuspec bench --batch-size`` shares them)."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="draft model (default: the target's --draft-low-bit self-draft)")
    parser.add_argument("--low-bit", default="int8_asym", help="target IR weight format (default int8_asym)")
    parser.add_argument("--draft-low-bit", default="int4_sym", help="draft IR weight format (default int4_sym)")
    parser.add_argument("--head", default=None, metavar="FOLDER", help="EAGLE-3 head of xpuspec-eagle3")
    parser.add_argument("--batch-size", default="1,4,8", help="comma-separated batch sizes (default 1,4,8)")
    parser.add_argument("--batch-prompts", default=None, metavar="SETS", help=BATCH_PROMPTS_HELP)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="run the systems in turn this many times (default 1)")
    parser.add_argument("--systems", default=None, help=f"comma-separated, from: {', '.join(SYSTEMS)} (default: all)")
    parser.add_argument("--json", default=None, help="write the figures here too")


def parse_sizes(text: str) -> List[int]:
    """``"1,4,8"`` -> ``[1, 4, 8]``.

    Raises:
        ValueError: a size is not a positive integer.
    """
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-size {text!r}: give positive integers separated by commas, e.g. 1,4,8.")
    return sizes


def parse_batch_systems(text: Optional[str], has_head: bool = False) -> List[str]:
    """The systems to run: ``text`` split at commas, or all of them (``xpuspec-eagle3`` only with a head).

    Raises:
        ValueError: a name is not a batched system, or ``xpuspec-eagle3`` without ``--head``.
    """
    names = [n for n in SYSTEMS if has_head or n != "xpuspec-eagle3"] if text is None else \
        [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise ValueError(f"--systems {text!r}: with --batch-size the systems are {', '.join(SYSTEMS)}.")
    if "xpuspec-eagle3" in names and not has_head:
        raise ValueError("xpuspec-eagle3 needs an EAGLE-3 head: add --head FOLDER.")
    return names


def sweep(args: argparse.Namespace) -> List[dict]:
    """Run each system in a child process over the batch sizes, ``args.rounds`` times in turn (A B C, A B C ...,
    so that drift in the machine's load hits every system alike); one figures dict per system that ran, each
    figure the median over rounds, with every round's figures under ``"rounds"`` (a system that fails is reported
    on stderr and left out).

    Raises:
        ValueError: bad batch sizes, systems or rounds.
    """
    parse_sizes(args.batch_size)
    batch_rows(1, args.batch_prompts)  # a bad --batch-prompts is refused before any system runs
    systems = parse_batch_systems(args.systems, args.head is not None)
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: give 1 or more.")
    rounds = {system: [] for system in systems}
    for _ in range(args.rounds):
        for system in [s for s in systems if rounds[s] is not None]:
            cmd = [sys.executable, "-m", "xpuspec.bench.batch", "--system", system, "--model", args.model,
                   "--low-bit", args.low_bit, "--draft-low-bit", args.draft_low_bit,
                   "--batch-size", args.batch_size, "--max-new-tokens", str(args.max_new_tokens),
                   "--repeats", str(args.repeats)] + (["--draft", args.draft] if args.draft else []) \
                + (["--head", args.head] if args.head else []) \
                + (["--batch-prompts", args.batch_prompts] if args.batch_prompts else [])
            start = load_average()
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                print(f"{system}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                rounds[system] = None
                continue
            rounds[system].append({**json.loads(done.stdout.strip().splitlines()[-1]),
                                   "load_average": {"start": start, "end": load_average()}})
    results = []
    for system, runs in rounds.items():
        if runs:
            by_batch = {b: _median([r["by_batch"][b] for r in runs]) for b in runs[0]["by_batch"]}
            results.append({"system": system, "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
                            "by_batch": by_batch, "rounds": [r["by_batch"] for r in runs],
                            "ov_config": dict(OV_PROPERTIES), "load_average": [r["load_average"] for r in runs]})
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xpuspec.bench.batch", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--system", help=argparse.SUPPRESS)  # one system, in a child process
    args = parser.parse_args(argv)
    if args.system:
        _child(args)
        return 0
    results = sweep(args)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _load_range(result: dict) -> str:
    """The 1-minute load averages over a system's runs: lowest at a start, highest at an end."""
    starts = [r["start"][0] for r in result.get("load_average", []) if r.get("start")]
    ends = [r["end"][0] for r in result.get("load_average", []) if r.get("end")]
    return f"{min(starts):.2f}-{max(ends):.2f}" if starts and ends else "n/a"


def table(results: List[dict]) -> str:
    """A Markdown table: one line per system and batch size, with the load average over the system's runs; below
    it, the CPU pinning every system ran with."""
    lines = ["| system | batch | aggregate tok/s | per-request tok/s | TTFT ms | peak RSS MiB | load average |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        for b, f in r["by_batch"].items():
            lines.append(f"| {r['system']} | {b} | {f['aggregate']:.1f} | {f['per_request']:.1f} | "
                         f"{f['ttft_ms']:.0f} | {r['peak_rss_mib']:.0f} | {_load_range(r)} |")
    settings = sorted({json.dumps(r.get("ov_config"), sort_keys=True) for r in results})
    lines += ["", "OpenVINO properties of every system: " + ", ".join(settings)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
