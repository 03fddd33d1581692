"""Plain greedy decoding speed: transformers fp32 against xpuspec fp32 / INT8 / INT4 on OpenVINO.

    python benchmarks/decode_speed.py [--model smollm2-135m-instruct] [--max-new-tokens 64] [--repeats 3]

Systems run interleaved (A B C D A B C D ...) so that drift on a shared machine hits all
alike; the table gives the median over prompts x repeats and the ratio to transformers.
"""

import argparse
import statistics
import time

import torch
import transformers

from xpuspec import AutoModelForCausalLM, AutoTokenizer, pull

PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef normalize(x):",
    "The history of the printing press",
    "Once upon a time, in a small village,",
]


def time_transformers(model, ids, max_new_tokens):
    """(TTFT s, decode tokens/s) of transformers greedy, TTFT measured as a 1-token generate."""
    t0 = time.perf_counter()
    model.generate(**ids, max_new_tokens=1, do_sample=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(**ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    total = time.perf_counter() - t0
    new = out.shape[1] - ids.input_ids.shape[1]
    return ttft, (new - 1) / max(total - ttft, 1e-9)


def time_xpuspec(model, ids, max_new_tokens):
    model.generate(**ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    stats = model.last_generate_stats
    return stats.ttft_s, stats.decode_tokens_per_s


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    path = pull(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    systems = {"transformers fp32": (transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                     time_transformers)}
    for fmt in ("fp32", "int8_asym", "int4_asym"):
        systems[f"xpuspec OpenVINO {fmt}"] = (
            AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit=fmt), time_xpuspec)
    results = {name: [] for name in systems}
    for _ in range(args.repeats):
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")
            for name, (model, timer) in systems.items():
                results[name].append(timer(model, ids, args.max_new_tokens))
    base = statistics.median(tps for _, tps in results["transformers fp32"])
    print(f"\n{args.model}, greedy, {len(PROMPTS)} prompts x {args.repeats} repeats, {args.max_new_tokens} new tokens, "
          f"torch threads {torch.get_num_threads()}\n")
    print("| system | TTFT ms (median) | decode tokens/s (median) | min-max | vs transformers |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        tps = [r[1] for r in runs]
        med = statistics.median(tps)
        print(f"| {name} | {statistics.median(r[0] for r in runs) * 1000:.0f} | {med:.1f} | "
              f"{min(tps):.1f}-{max(tps):.1f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
