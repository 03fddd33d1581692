"""What EAGLE-3 drafting costs: the target's pass with the three tapped layers as extra outputs against the same pass
without them, and one step of a head (torch, float32) against a target pass.

Two copies of the target are loaded (one with taps); their passes are timed interleaved (A, B, A, B ...) at each
width after the same context, so that the machine's load falls on both alike; the median of ``--repeats`` passes.

    PYTHONPATH=.:plugins python benchmarks/eagle3_cost.py --model smollm2-135m-instruct --low-bit int8_asym

Prints a markdown table; ratios are the figures to quote (the machine is shared).
"""

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch


def _median_pass(runner, context, width, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(list(range(1000, 1000 + width)))
        times.append(time.perf_counter() - t0)
        runner.rollback(width)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--low-bit", default="int8_asym")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--widths", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args()

    from transformers import AutoConfig

    from xpuspec import AutoModelForCausalLM, pull
    from xpuspec.speculative.eagle3 import Eagle3Head, check_head, default_layer_ids, new_head, read_head

    path = pull(args.model)
    config = AutoConfig.from_pretrained(path)
    taps = default_layer_ids(config.num_hidden_layers)
    plain = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit=args.low_bit).runner
    tapped = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit=args.low_bit).runner
    tapped.set_taps(taps)
    context = list(range(100, 100 + args.context))
    for runner in (plain, tapped):
        runner.reset()
        runner.forward(context, logits_to_keep=1)
    print(f"{args.model} {args.low_bit}, CPU {platform.processor() or platform.machine()}, context {args.context}, "
          f"taps {list(taps)}, median of {args.repeats}; load average before: {open('/proc/loadavg').read().split()[:3]}")
    print("\n| width | pass ms | pass with taps ms | ratio |\n|---:|---:|---:|---:|")
    base = {}
    for width in [int(w) for w in args.widths.split(",")]:
        a, b = [], []
        for _ in range(3):  # interleaved blocks
            a.append(_median_pass(plain, context, width, args.repeats // 3 or 1))
            b.append(_median_pass(tapped, context, width, args.repeats // 3 or 1))
        a, b = statistics.median(a), statistics.median(b)
        base[width] = a
        print(f"| {width} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.3f} |")

    with tempfile.TemporaryDirectory() as tmp:
        head_dir = new_head(config, os.path.join(tmp, "head"), draft_ids=range(min(args.draft_vocab, config.vocab_size)))
        spec = read_head(head_dir)
        head = Eagle3Head.load(spec, check_head(spec, config.hidden_size, config.vocab_size, config.num_hidden_layers))
    torch.set_num_threads(args.torch_threads)  # the decode loop runs torch on one thread beside OpenVINO
    threads = torch.get_num_threads()
    print(f"\nHead (1 decoder layer, draft vocabulary {spec.draft_vocab_size}), torch float32, {threads} threads, "
          f"cache of {args.context} entries:\n\n| head pass | ms | / target 1-token pass |\n|---|---:|---:|")
    hidden = torch.randn(args.context, len(taps) * config.hidden_size)
    for label, n in (("chain step (1 entry)", 1), ("catch-up of 4 accepted entries", 4)):
        times = []
        for _ in range(args.repeats):
            cache = head.new_cache()
            head(context, head.project(hidden), cache)
            t0 = time.perf_counter()
            if n == 1:
                head([5], torch.randn(1, config.hidden_size), cache)
            else:
                head([5] * n, head.project(torch.randn(n, hidden.shape[1])), cache)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        print(f"| {label} | {t * 1e3:.2f} | {t / base[min(base)]:.2f} |")
    x = torch.randn(1, config.hidden_size)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with torch.inference_mode():
            head.lm_head(x)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    print(f"| of which lm_head alone ({spec.draft_vocab_size} x {config.hidden_size} fp32) | {t * 1e3:.2f} | "
          f"{t / base[min(base)]:.2f} |")
    print(f"\nload average after: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
