"""OpenVINO CPU thread pinning under competing loads: the same model compiled with ``ENABLE_CPU_PINNING`` on and off,
decoding side by side in one process, first on an idle machine, then beside other work on the cores.

    PYTHONPATH=.:plugins python benchmarks/cpu_pinning.py [--model smollm2-135m-instruct] [--rounds 3]

Loads: ``idle``; ``pinned-spin``: a busy loop pinned to the first core (as ``xpuspec bench --competing-load 1``,
and as a job under ``taskset`` or a cpuset does); ``spin``: an unpinned busy loop; ``openvino``: another process
decoding with openvino_genai in a loop (its default pins its threads too). Each load runs ``--rounds`` rounds; each
round times every setting once on each workload (batch 1 greedy, and a batch of 4), in an order that alternates, and
checks the tokens are the same under both settings. Prints a Markdown table of median tokens/s (min-max).
"""

import argparse
import statistics
import subprocess
import sys
import time

SPIN = "while True:\n    pass\n"
PINNED_SPIN = "import os\nos.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\nwhile True:\n    pass\n"
GENAI_LOOP = ("import sys, openvino_genai as og\n"
              "pipe = og.LLMPipeline(sys.argv[1], 'CPU', KV_CACHE_PRECISION='f32', INFERENCE_PRECISION_HINT='f32')\n"
              "while True:\n"
              "    pipe.generate('Write a story about a lighthouse keeper.', max_new_tokens=64)\n")
PROMPTS = ["Write a Python function that parses a CSV file and returns the rows as dictionaries.",
           "Explain in three sentences why the sky is blue.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Summarize the plot of a novel about a sailor who is lost at sea for a year."]
SETTINGS = {"pinning on (OpenVINO's default)": {"ENABLE_CPU_PINNING": True},
            "pinning off": {"ENABLE_CPU_PINNING": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=32, help="new tokens per row")
    parser.add_argument("--loads", default="idle,pinned-spin,spin,openvino")
    args = parser.parse_args()

    from xpuspec import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token, tok.padding_side = tok.pad_token or tok.eos_token, "left"
    models = {name: AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit="int8_asym",
                                                         ov_config=cfg) for name, cfg in SETTINGS.items()}
    workloads = {"batch 1": tok(PROMPTS[:1], return_tensors="pt"),
                 "batch 4": tok(PROMPTS, padding=True, return_tensors="pt")}
    ir = next(iter(models.values())).runner.folder

    def run(model, batch):
        start = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
        return batch["input_ids"].shape[0] * args.new / (time.perf_counter() - start), out

    for model in models.values():  # warm-up
        for batch in workloads.values():
            run(model, batch)
    rows = []
    for load in args.loads.split(","):
        script = {"idle": None, "pinned-spin": PINNED_SPIN, "spin": SPIN, "openvino": GENAI_LOOP}[load]
        proc = None if script is None else subprocess.Popen([sys.executable, "-c", script, str(ir)],
                                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(8 if load == "openvino" else 1)  # the other process loads and starts
        speeds = {(w, s): [] for w in workloads for s in models}
        for r in range(args.rounds):
            for w, batch in workloads.items():
                outs = []
                for s in (list(models) if r % 2 == 0 else list(models)[::-1]):
                    speed, out = run(models[s], batch)
                    speeds[(w, s)].append(speed)
                    outs.append(out)
                if not all((o == outs[0]).all() for o in outs):
                    sys.exit(f"{load}, {w}: the two settings returned different tokens")
        if proc is not None:
            proc.kill()
            proc.wait()
        for (w, s), values in speeds.items():
            rows.append((load, w, s, statistics.median(values), min(values), max(values)))
            print(rows[-1], file=sys.stderr, flush=True)
    print("| load | workload | setting | tokens/s (median) | min-max |")
    print("|---|---|---|---:|---|")
    for load, w, s, med, lo, hi in rows:
        print(f"| {load} | {w} | {s} | {med:.1f} | {lo:.1f}-{hi:.1f} |")


if __name__ == "__main__":
    main()
