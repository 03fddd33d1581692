"""Resident memory (RSS) of each speculative mode, and what OpenVINO shares between compiled models.

    python benchmarks/speculative_memory.py --low-bit int8_sym            # one fresh process per mode
    python benchmarks/speculative_memory.py --low-bit int8_sym --sharing  # OpenVINO: compile twice vs infer requests

Per mode, in a fresh process: RSS after the imports, after ``from_pretrained`` and after 3 greedy requests of 48
tokens; ``model.draft_memory_bytes`` is what the load attributes to speculation. ``--sharing`` times and measures, on
the paged runner, 1-token steps alternating with 4-token passes on one infer request, on a second infer request of
the same compiled model, and on a second compiled model (:func:`sharing`).
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
    """On the paged runner: RSS and the time of 20 alternations of a step pass (the steps' width) with a 4-token
    pass, where the steps run on (a) the wide infer request itself, (b) a second infer request of the same compiled
    model, (c) a second compiled model of the same ov.Model (what expect_mixed_widths makes). Each after warm-up."""
    import time

    import openvino as ov

    from xpuspec import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_name, device="cpu", load_in_low_bit=low_bit)
    runner = model.runner
    width = runner.traits.single_step_width
    runner.reset()
    runner.forward(list(range(100, 132)))

    def alternate(rounds=20):
        start = time.perf_counter()
        for _ in range(rounds):
            runner._pass([7] * width, 1, step=True)
            runner._length -= width
            runner._pass([7] * 4, 1)
            runner._length -= 4
        return (time.perf_counter() - start) / rounds

    def share_cache(request):
        for port in runner._cache_inputs:
            request.set_tensor(port.any_name, runner._wide.get_tensor(port.any_name))
        return request

    rows = []
    alternate(3)
    before = rss_mib()
    rows.append(("steps on the wide infer request itself", 0.0, alternate()))
    second = share_cache(runner._wide.get_compiled_model().create_infer_request())
    runner._step = second
    alternate(3)
    rows.append(("a second infer request of the same compiled model", rss_mib() - before, alternate()))
    runner._step = runner._wide
    del second
    before = rss_mib()
    runner.expect_mixed_widths()
    alternate(3)
    rows.append(("a second compiled model of the same ov.Model", rss_mib() - before, alternate()))
    return dict(weights_mib=runner.weight_bytes / 2**20, steps=rows, openvino=ov.__version__, width=width)


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
        print(f"weights {found['weights_mib']:.1f} MiB, step width {found['width']}, OpenVINO {found['openvino']}")
        print("| the steps run on | RSS added | ms per (step + 4-token pass) |\n|---|---|---|")
        for what, mib, seconds in found["steps"]:
            print(f"| {what} | {mib:+.1f} MiB | {1000 * seconds:.1f} |")
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
