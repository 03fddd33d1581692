"""Resident memory (RSS) of each speculative mode, and what OpenVINO shares between compiled models.

    python benchmarks/speculative_memory.py --low-bit int8_sym            # one fresh process per mode
    python benchmarks/speculative_memory.py --low-bit int8_sym --sharing  # OpenVINO: compile twice vs infer requests

Per mode, in a fresh process: RSS after the imports, after ``from_pretrained`` and after 3 greedy requests of 48
tokens; ``model.draft_memory_bytes`` is what the load attributes to speculation. ``--sharing`` compiles the
target's paged IR once and creates a second infer request, then compiles it a second time, with RSS after each.
"""

import argparse
import json
import subprocess
import sys


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_mode(model_name, low_bit, mode):
    import gc

    from xpuspec import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_name)
    ids = tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", return_tensors="pt").input_ids
    gc.collect()
    base = rss_mib()
    model = AutoModelForCausalLM.from_pretrained(model_name, device="cpu", load_in_low_bit=low_bit,
                                                 speculative=None if mode == "plain" else mode)
    loaded = rss_mib()
    for _ in range(3):
        model.generate(ids, max_new_tokens=48, do_sample=False)
    used = rss_mib()
    extra = model.draft_memory_bytes
    return dict(mode=mode, imports_mib=base, load_mib=loaded - base, after_requests_mib=used - base,
                draft_memory_mib=None if extra is None else extra / 2**20,
                weights_mib=model.runner.weight_bytes / 2**20,
                draft_weights_mib=model.draft_model.runner.weight_bytes / 2**20 if model.draft_model else 0.0)


def sharing(model_name, low_bit):
    import openvino as ov

    from xpuspec import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_name, device="cpu", load_in_low_bit=low_bit)
    runner = model.runner
    core, graph, config = runner._core, runner._model, runner.configs[0]
    rows, prev = [], rss_mib()

    def note(what):
        nonlocal prev
        now = rss_mib()
        rows.append((what, now - prev))
        prev = now

    first = core.compile_model(graph, "CPU", config)
    note("compile the model (a second compiled model beside the runner's)")
    req = first.create_infer_request()
    note("an infer request of it")
    req2 = first.create_infer_request()
    note("a second infer request of the same compiled model")
    again = core.compile_model(graph, "CPU", config)
    note("compile the same ov.Model once more")
    req3 = again.create_infer_request()
    note("an infer request of that")
    return dict(weights_mib=runner.weight_bytes / 2**20, steps=rows, openvino=ov.__version__)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--low-bit", default="int8_sym")
    p.add_argument("--modes", nargs="+", default=["plain", "prompt_lookup", "self", "layer_skip"])
    p.add_argument("--sharing", action="store_true")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_mode(args.model, args.low_bit, args.one)))
        sys.exit(0)
    if args.sharing:
        found = sharing(args.model, args.low_bit)
        print(f"weights {found['weights_mib']:.1f} MiB, OpenVINO {found['openvino']}")
        for what, mib in found["steps"]:
            print(f"| {what} | {mib:+.1f} MiB |")
        sys.exit(0)
    print("| mode | RSS after load | after 3 requests | draft_memory_bytes | draft weights |\n|---|---|---|---|---|")
    for mode in args.modes:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--low-bit", args.low_bit, "--one", mode],
                             capture_output=True, text=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"| {mode} | failed: {out.stderr.strip().splitlines()[-1:]} |")
            continue
        r = json.loads(line[7:])
        extra = "-" if r["draft_memory_mib"] is None else f"{r['draft_memory_mib']:+.0f} MiB"
        print(f"| {mode} | {r['load_mib']:+.0f} MiB | {r['after_requests_mib']:+.0f} MiB | {extra} | "
              f"{r['draft_weights_mib']:.0f} MiB |")
