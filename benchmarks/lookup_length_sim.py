"""Which prompt-lookup rule would pay most, replayed on the target's own greedy outputs (teacher forcing), with the
target's measured pass costs: a tool to choose a rule before building it, on sets it was not tuned on.

    PYTHONPATH=.:plugins python benchmarks/lookup_length_sim.py [--model smollm2-135m-instruct] [--prompts 12]

For each set (code, prose, edit, heldout) it decodes ``--prompts`` prompts plainly (chat template, ``--new`` tokens),
then replays every output: at each round a rule drafts from the context (prompt and output so far), the drafts are
accepted up to the first that differs from the output, and the round costs the target's measured pass of its width
(:func:`xpuspec.speculative.profile.measure_profile`; a round is at least ``single_step_width`` wide, as the
runner pads it). It prints predicted tokens per second of passes and tokens per pass for each rule. Rules:

- ``guess``: plain steps, each with the runner's free 1-token guess (n-gram 3..1, earliest match);
- ``k=K``: up to K drafts from the earliest match of the longest n-gram (3..1), as openvino_genai and
  transformers draft;
- ``by match``: the draft length set by the matched n-gram's size (3: 4, 2: 2, 1: 1).

The Python work per round and the prefill are not in the figures: compare rules with each other, not with a bench.
"""

import argparse
import json
from typing import Callable, Dict, List, Sequence, Tuple

NGRAMS = (3, 2, 1)
RULES: Dict[str, Callable[[int], int]] = {
    "guess": lambda n: 1,
    "k=3": lambda n: 3,
    "k=5": lambda n: 5,
    "by match": lambda n: {3: 4, 2: 2, 1: 1}.get(n, 0),
}


def lookup(context: Sequence[int], longest: int) -> Tuple[List[int], int]:
    """Up to ``longest`` tokens after the earliest earlier occurrence of the context's last n tokens, for the largest
    n of :data:`NGRAMS` that occurs; and that n (0: none)."""
    for n in NGRAMS:
        if len(context) <= n:
            continue
        key = list(context[-n:])
        for i in range(len(context) - n):
            if list(context[i:i + n]) == key:
                return list(context[i + n:i + n + longest]), n
    return [], 0


def replay(rows: Sequence[Tuple[List[int], List[int]]], rule: Callable[[int], int], pass_s: Callable[[int], float],
           min_width: int) -> Tuple[float, float]:
    """Predicted (tokens per second of passes, tokens per pass) of ``rule`` over ``rows`` of (prompt, output)."""
    tokens = passes = 0
    seconds = 0.0
    for prompt, output in rows:
        context, t = list(prompt), 0
        while t < len(output):
            drafts, n = lookup(context, 8)
            drafts = drafts[:rule(n)]
            kept = 0
            while kept < len(drafts) and t + kept < len(output) and drafts[kept] == output[t + kept]:
                kept += 1
            step = min(kept + 1, len(output) - t)
            context += output[t:t + step]
            t += step
            tokens, passes, seconds = tokens + step, passes + 1, seconds + pass_s(max(min_width, len(drafts) + 1))
    return tokens / seconds, tokens / passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=12, help="prompts per set")
    parser.add_argument("--new", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--sets", default="code,prose,edit,heldout")
    parser.add_argument("--json", help="write the outputs and figures here")
    args = parser.parse_args()

    from xpuspec import AutoModelForCausalLM, AutoTokenizer
    from xpuspec.bench.prompts import full_set
    from xpuspec.speculative.profile import measure_profile

    model = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit="int8_asym")
    tok = AutoTokenizer.from_pretrained(args.model)
    outputs = {}
    for name in args.sets.split(","):
        rows = []
        for prompt in full_set(name)[:args.prompts]:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            out = model.generate(ids, max_new_tokens=args.new, do_sample=False)
            rows.append((ids[0].tolist(), out[0, ids.shape[1]:].tolist()))
        outputs[name] = rows
    runner = model.runner
    runner.forward(outputs[next(iter(outputs))][0][0])
    profile = measure_profile(runner, 0, widest=9)
    runner.reset()
    width = runner.traits.single_step_width
    figures = {name: {rule: replay(rows, fn, profile.pass_s, width) for rule, fn in RULES.items()}
               for name, rows in outputs.items()}
    print(f"pass ms by width: {', '.join(f'{w}: {1000 * profile.pass_s(w):.1f}' for w in range(1, 10))}; "
          f"1-token steps run {width} wide")
    print("| set | " + " | ".join(RULES) + " |")
    print("|---|" + "---|" * len(RULES))
    for name, by_rule in figures.items():
        print(f"| {name} | " + " | ".join(f"{tps:.1f} tok/s, {tpp:.2f}/pass" for tps, tpp in by_rule.values()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"outputs": outputs, "figures": figures, "pass_s": profile.seconds}, f)


if __name__ == "__main__":
    main()
