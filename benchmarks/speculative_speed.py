"""Speculative against plain greedy decoding on the same target weights, side by side.

    python benchmarks/speculative_speed.py [--model smollm2-135m-instruct] [--draft NAME] \\
        [--drafters self,layer-skip,lookup,hybrid] [--low-bit int8_asym] [--max-new-tokens 64] [--repeats 2] [--k 4]

Drafters: the INT4 self-draft, the layer-skip self-draft (calibrated, same format as the target),
prompt lookup, hybrid (lookup, else the INT4 self-draft), and with --draft a separate draft model
(INT4). Each runs with the cost model (the default) and without it ("raw"). Systems are
interleaved per prompt; the table gives the median decode tokens/s over prompts x repeats
(split by code and prose), acceptance rate, mean accepted length tau, and the ratio to plain.
"""

import argparse
import statistics

from xpuspec import AutoModelForCausalLM, AutoTokenizer, SpeculativeConfig
from xpuspec.speculative.layerskip import layer_skip_model

CODE = ["def fibonacci(n):", "import numpy as np\n\ndef normalize(x):",
        'def has_close_elements(numbers, threshold):\n    """Check if any two numbers are closer than threshold."""\n',
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"]
PROSE = ["The capital of France is", "Once upon a time, in a small village,",
         "The history of the printing press begins", "Photosynthesis is the process by which plants"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="a separate draft model (loaded as int4_sym)")
    parser.add_argument("--drafters", default="self,layer-skip,lookup,hybrid",
                        help="comma-separated subset of self, layer-skip, lookup, hybrid")
    parser.add_argument("--low-bit", default="int8_asym")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()

    chosen = args.drafters.split(",") if args.drafters else []
    unknown = set(chosen) - {"self", "layer-skip", "lookup", "hybrid"}
    if unknown:
        parser.error(f"unknown drafters {sorted(unknown)}; choose from self, layer-skip, lookup, hybrid")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    uses_self = "self" in chosen or "hybrid" in chosen
    target = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit=args.low_bit,
                                                  speculative=SpeculativeConfig(mode="self") if uses_self else None)
    drafts = {"self int4": target.draft_model} if "self" in chosen else {}
    if "layer-skip" in chosen:
        drafts[f"layer-skip {args.low_bit}"] = AutoModelForCausalLM.from_pretrained(
            layer_skip_model(target.source), device="cpu", load_in_low_bit=args.low_bit)
    if args.draft:
        drafts[f"{args.draft} int4"] = AutoModelForCausalLM.from_pretrained(args.draft, device="cpu",
                                                                             load_in_low_bit="int4_sym")
    systems = {"plain": dict(speculative=False)}
    for cost in (True, False):
        tag = "" if cost else " raw"
        for name, draft in drafts.items():
            systems[f"{name}{tag}"] = dict(assistant_model=draft, cost=cost)
        if "lookup" in chosen:
            systems[f"prompt lookup{tag}"] = dict(prompt_lookup_num_tokens=args.k, cost=cost)
        if "hybrid" in chosen:
            systems[f"hybrid{tag}"] = dict(assistant_model=target.draft_model, prompt_lookup_num_tokens=args.k,
                                           cost=cost)
    rows = {name: {"code": [], "prose": []} for name in systems}
    for _ in range(args.repeats):
        for kind, prompts in (("code", CODE), ("prose", PROSE)):
            for prompt in prompts:
                ids = tokenizer(prompt, return_tensors="pt")
                for name, kwargs in systems.items():
                    kwargs = dict(kwargs)
                    cost = kwargs.pop("cost", True)
                    target.speculative_config = SpeculativeConfig(mode="prompt_lookup", num_assistant_tokens=args.k,
                                                                  cost_model=cost)
                    target.generate(**ids, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                                    do_sample=False, **kwargs)
                    rows[name][kind].append(target.last_generate_stats)
    base = {kind: statistics.median(s.decode_tokens_per_s for s in rows["plain"][kind]) for kind in ("code", "prose")}
    print(f"\ntarget {args.model} {args.low_bit}, greedy, {args.max_new_tokens} new tokens, k={args.k}, "
          f"{args.repeats} repeats x {len(CODE)} code + {len(PROSE)} prose prompts\n")
    print("| system | code tok/s | vs plain | prose tok/s | vs plain | acceptance | tau |")
    print("|---|---|---|---|---|---|---|")
    for name, by_kind in rows.items():
        cells = []
        for kind in ("code", "prose"):
            tps = statistics.median(s.decode_tokens_per_s for s in by_kind[kind])
            cells += [f"{tps:.1f}", f"{tps / base[kind]:.2f}x"]
        every = by_kind["code"] + by_kind["prose"]
        drafted = sum(s.drafted_tokens for s in every)
        accepted = sum(s.accepted_tokens for s in every)
        tau = statistics.mean(s.mean_accepted_length for s in every)
        print(f"| {name} | {' | '.join(cells)} | {accepted / drafted if drafted else 0:.0%} | {tau:.2f} |")


if __name__ == "__main__":
    main()
