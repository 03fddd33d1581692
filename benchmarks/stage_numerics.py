"""Whole model against pipeline stages on OpenVINO, under each choice of numerics (issue 42): decode speed side by
side in one process, perplexity, and whether the stages' greedy text is the whole model's.

    PYTHONPATH=.:plugins python benchmarks/stage_numerics.py [--format int8_asym] [--rounds 3] [--new 64]

Settings, each loaded whole (``cpu``) and split over two CPU devices (``cpu,cpux``, the CPU plugin registered twice):

- ``paged, dynamic quantization`` (xpuspec's default): paged attention everywhere, OpenVINO's default
  ``DYNAMIC_QUANTIZATION_GROUP_SIZE``, 1-token passes 2 wide where they compute otherwise;
- ``paged, no dynamic quantization``: the same with ``DYNAMIC_QUANTIZATION_GROUP_SIZE=0`` ("both turn it off");
- ``stateful stages, no dynamic quantization`` (the stages before issue 42; split only): the stateful SDPA model.

Each round times every setting once (greedy, ``--new`` tokens on each prompt, the order rotating by round), and
prints median tokens/s (min-max) with ``/proc/loadavg``, and per prompt the first new token where the greedy text
parts from its own whole model's (the stateful stages: against the paged whole model without dynamic quantization)
and from the default whole model's; then sliding-window perplexity on the evaluation corpus
(:mod:`xpuspec.perplexity`); then how far passes of 1, 2 and 8 tokens part through each split
(``xpuspec_openvino.numerics.probe``), also through the stateful stages with dynamic quantization on.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XPUSPEC_CPU_ALIASES", "cpux")
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef normalize(x):",
           "Once upon a time, in a small village,"]
DQ_OFF = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}


def main() -> None:
    import openvino as ov
    import torch

    from xpuspec import AutoModelForCausalLM, AutoTokenizer
    from xpuspec.devices import cpu_flags
    from xpuspec.perplexity import eval_texts, perplexity
    from xpuspec_openvino.numerics import dynamic_quantization

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--format", default="int8_asym")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    args = parser.parse_args()

    flags = [f for f in cpu_flags().split() if f.startswith(("avx512_vnni", "amx", "avx_vnni", "avx2"))]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, openvino {ov.__version__}, flags {flags}, "
          f"dynamic quantization on by default: {dynamic_quantization(ov.Core(), 'CPU')}")
    tok = AutoTokenizer.from_pretrained(args.model)
    settings = {
        "paged, dynamic quantization (default)": {},
        "paged, no dynamic quantization": DQ_OFF,
    }
    models = {}
    for name, config in settings.items():
        for devices in ("cpu", "cpu,cpux"):
            models[name, devices] = AutoModelForCausalLM.from_pretrained(args.model, device=devices,
                                                                         load_in_low_bit=args.format, ov_config=config)
    models["stateful stages, no dynamic quantization (before)", "cpu,cpux"] = AutoModelForCausalLM.from_pretrained(
        args.model, device="cpu,cpux", load_in_low_bit=args.format, ov_config={"ATTENTION_BACKEND": "SDPA"})
    ids = [tok(p, return_tensors="pt").input_ids for p in PROMPTS]
    texts = {key: [m.generate(i, max_new_tokens=args.new, do_sample=False)[0, i.shape[1]:].tolist() for i in ids]
             for key, m in models.items()}  # also warms every model up

    speeds = {key: [] for key in models}
    keys = list(models)
    load_before = open("/proc/loadavg").read().split()[:3]
    for r in range(args.rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            start = time.perf_counter()
            for i in ids:
                models[key].generate(i, max_new_tokens=args.new, do_sample=False)
            speeds[key].append(len(ids) * args.new / (time.perf_counter() - start))
    load_after = open("/proc/loadavg").read().split()[:3]
    print(f"\nload average before {' '.join(load_before)}, after {' '.join(load_after)}\n")
    print("| setting | devices | decode tokens/s, median (min-max) | 1-token passes run | greedy text against its "
          "own whole model | against the default whole model |")
    print("|---|---|---|---|---|---|")

    def parted(key, whole_key) -> str:
        firsts = [next((j for j, (a, b) in enumerate(zip(t, w)) if a != b), None)
                  for t, w in zip(texts[key], texts[whole_key])]
        return "identical" if all(p is None for p in firsts) else "parts at token " + ", ".join(
            "-" if p is None else str(p) for p in firsts)

    for key in keys:
        s = speeds[key]
        own = (key[0], "cpu") if (key[0], "cpu") in models else (keys[2][0], "cpu")  # the stateful split: DQ off
        print(f"| {key[0]} | {key[1]} | {statistics.median(s):.1f} ({min(s):.1f}-{max(s):.1f}) | "
              f"{models[key].runner.traits.single_step_width} wide | {parted(key, own)} | "
              f"{parted(key, keys[0])} |")

    print("\n| setting | devices | perplexity, code | perplexity, prose |")
    print("|---|---|---|---|")
    corpus = eval_texts(tok, None, args.ppl_tokens)
    for key in keys:
        with torch.no_grad():
            values = [perplexity(models[key], text, context=512, stride=256) for text in corpus.values()]
        print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{v:.4f}" for v in values) + " |")

    # why the stages left the stateful model: its passes of different widths must compute alike for any padding to help
    from xpuspec_openvino import numerics

    models["stateful stages, dynamic quantization (padding alone)", "cpu,cpux"] = AutoModelForCausalLM.from_pretrained(
        args.model, device="cpu,cpux", load_in_low_bit=args.format,
        ov_config={"ATTENTION_BACKEND": "SDPA", "DYNAMIC_QUANTIZATION_GROUP_SIZE": ov.Core().get_property(
            "CPU", "DYNAMIC_QUANTIZATION_GROUP_SIZE")})
    print("\n| setting | devices | largest logit difference, 1-token against 2-token passes | 2-token against "
          f"{numerics.WIDEST_COMPARED}-token passes |")
    print("|---|---|---|---|")
    for key, model in models.items():
        if key[1] == "cpu":
            continue
        r = model.runner
        found = numerics.probe(lambda t: r.forward(t, exact=False), r.rollback, r.reset,
                               numerics.probe_tokens(r.folder, r.vocab_size))
        print(f"| {key[0]} | {key[1]} | {found.one_vs_two:.3g} | {found.two_vs_wide:.3g} |")


if __name__ == "__main__":
    sys.exit(main())
