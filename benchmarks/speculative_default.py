"""Which speculative mode decodes fastest here: plain, prompt_lookup, self, layer_skip and hybrid, interleaved.

    python benchmarks/speculative_default.py --low-bit int8_sym --prompts 8 --new-tokens 64 --rounds 2

Every mode's model is loaded first, then each prompt runs once per mode, in an order that rotates from prompt to
prompt, for ``--rounds`` rounds; the figures are end-to-end tokens per second (total new tokens / total wall time
of the generate calls) and the ratio against plain decoding from the same run. Each mode's greedy output is
checked against plain greedy.
"""

import argparse
import time

import torch

from xpuspec import AutoModelForCausalLM, AutoTokenizer
from xpuspec.evaluation import eval_prompts

p = argparse.ArgumentParser()
p.add_argument("--model", default="smollm2-135m-instruct")
p.add_argument("--low-bit", default="int8_sym")
p.add_argument("--modes", nargs="+", default=["plain", "prompt_lookup", "self", "layer_skip", "hybrid"])
p.add_argument("--prompts", type=int, default=8)
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--rounds", type=int, default=2)
args = p.parse_args()

tok = AutoTokenizer.from_pretrained(args.model)
models = {m: AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit=args.low_bit, device="cpu",
                                                  speculative=None if m == "plain" else m) for m in args.modes}
prompts = [tok(p, return_tensors="pt").input_ids for p in eval_prompts(args.prompts)]
for m in models.values():  # warm up: compiled copies, cost profiles
    m.generate(prompts[0], max_new_tokens=8, do_sample=False)
seconds = {m: 0.0 for m in models}
tokens = {m: 0 for m in models}
same = {m: 0 for m in models}
runs = 0
for r in range(args.rounds):
    for i, ids in enumerate(prompts):
        order = args.modes[i % len(args.modes):] + args.modes[:i % len(args.modes)]
        outs = {}
        for mode in order:
            start = time.perf_counter()
            outs[mode] = models[mode].generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
            seconds[mode] += time.perf_counter() - start
            tokens[mode] += outs[mode].shape[1] - ids.shape[1]
        for mode in order:
            same[mode] += bool(torch.equal(outs[mode], outs["plain"]))
        runs += 1
plain = tokens["plain"] / seconds["plain"]
print(f"| mode | tokens/s | vs plain | identical to plain |\n|---|---|---|---|")
for mode in args.modes:
    speed = tokens[mode] / seconds[mode]
    print(f"| {mode} | {speed:.1f} | {speed / plain:.2f}x | {same[mode]}/{runs} |")
