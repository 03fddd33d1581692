"""How well an EAGLE-3 head drafts for its target on the bench's held-out prompt sets, at a fixed chain length.

For each set (``heldout``: news reports, ``code``: HumanEval, ``prose``: Python's documentation topics; none of them
in ``benchmarks/eagle3_corpus.py``'s training corpus) it generates greedily with the head drafting ``--k`` tokens
every round (constant schedule, cost model off) and plainly, and prints:
- whether every output equals the plain greedy output;
- the mean accepted length: new tokens after the first per target pass (the bonus token included, as vLLM counts);
- the acceptance per draft position (the rounds that accepted a draft there over those that judged one);
- where a round's time goes: drafting (the head) against verifying (the target), per round;
each for every head format of ``--head-formats`` (the head's drafting weights, ``SpeculativeConfig.draft_low_bit``),
the formats run one after the other within each set.

Usage::

    PYTHONPATH=.:plugins python benchmarks/eagle3_acceptance.py --head DIR [--model smollm2-135m-instruct]
        [--sets heldout:8,code:8,prose:8] [--k 4] [--max-new-tokens 64] [--head-formats int8_sym,fp32] [--chat]
"""

import argparse
import json
import time

import torch

from xpuspec import AutoModelForCausalLM, AutoTokenizer, SpeculativeConfig
from xpuspec.speculative.eagle3 import HEAD_FORMATS
from xpuspec.bench.load import load_average
from xpuspec.bench.prompts import parse_prompt_spec, select, token_ids
from xpuspec.generation import batch_stats


def measure(model, plain, tokenizer, prompts, new_tokens: int, chat: bool = False) -> dict:
    same, runs = 0, []
    for text in prompts:
        ids = torch.tensor([token_ids(tokenizer, text, chat)])
        want = plain.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        got = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        same += got.tolist() == want.tolist()
        runs.append(model.last_generate_stats)
    counts = batch_stats(runs).acceptance_counts  # summed per position over the prompts
    rounds = sum(s.target_forwards - 1 for s in runs)  # the target's passes after prefill
    return {"prompts": len(prompts), "identical": same,
            "mean_accepted_length": sum(s.new_tokens - 1 for s in runs) / rounds,
            "acceptance_per_position": [a / j if j else 0.0 for a, j in zip(counts.accepted, counts.judged)],
            "draft_ms_per_round": 1000 * sum(s.draft_s for s in runs) / rounds,
            "verify_ms_per_round": 1000 * sum(s.verify_s for s in runs) / rounds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--low-bit", default="int8_asym")
    parser.add_argument("--sets", default="heldout:8,code:8,prose:8")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--chat", action="store_true", help="each prompt as a user turn in the chat template")
    parser.add_argument("--json", default=None)
    parser.add_argument("--head-formats", default=",".join(HEAD_FORMATS),
                        help=f"the head's drafting formats to measure, comma-separated (of {', '.join(HEAD_FORMATS)})")
    args = parser.parse_args(argv)
    start_load = load_average()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    formats = args.head_formats.split(",")
    models = {}
    for fmt in formats:
        spec = SpeculativeConfig(mode="eagle3", draft=args.head, num_assistant_tokens=args.k, draft_low_bit=fmt,
                                 num_assistant_tokens_schedule="constant", cost_model=False)
        models[fmt] = AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit=args.low_bit, speculative=spec)
    plain = AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit=args.low_bit)
    results = {}
    for name, prompts in select(parse_prompt_spec(args.sets)).items():
        for fmt, model in models.items():
            began = time.perf_counter()
            results[f"{name} {fmt}"] = measure(model, plain, tokenizer, prompts, args.max_new_tokens, args.chat)
            results[f"{name} {fmt}"]["wall_s"] = time.perf_counter() - began
    print(f"head {args.head}, target {args.model} {args.low_bit}, k={args.k} (constant), {args.max_new_tokens} new "
          f"tokens{', chat template' if args.chat else ''}, torch threads {torch.get_num_threads()}, "
          f"load average {start_load} -> {load_average()}\n")
    print("| set, head format | prompts | identical | mean accepted length | acceptance per position | "
          "draft ms / round | verify ms / round |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['prompts']} | {r['identical']} | {r['mean_accepted_length']:.2f} | "
              f"{', '.join(f'{a:.2f}' for a in r['acceptance_per_position'])} | {r['draft_ms_per_round']:.1f} | "
              f"{r['verify_ms_per_round']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
