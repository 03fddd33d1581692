"""Would prompt lookup be faster if a lone request's plain steps ran at its verify width?

The paged runner pads a lone row's verify passes to the widest so far (``RunnerTraits.fixed_verify_width``), while
rounds without a draft run the 2-wide plain step, and a pass whose width changes costs more
(``benchmarks/width_switch_probe.py``). This pads those plain steps to the request's verify width too (a patch of
``Engine._parts`` in this process only) and times prompt lookup both ways, alternating, on the bench's held-out
prompts through the chat template; every output is checked against plain greedy.

    PYTHONPATH=.:plugins python benchmarks/pad_plain_steps_probe.py [--rounds 4] [--prompts heldout:6,code:6,prose:6]
"""

import argparse
import statistics

import torch

from xpuspec import AutoModelForCausalLM, AutoTokenizer, SpeculativeConfig
from xpuspec import engine
from xpuspec.bench.load import load_average
from xpuspec.bench.prompts import parse_prompt_spec, select, token_ids

AS_IS = engine.Engine._parts


def padded(self, jobs, drafts, guessed):
    """``Engine._parts``, with a lone row's plain (guess) step padded to its request's verify width."""
    parts = AS_IS(self, jobs, drafts, guessed)
    if len(jobs) == 1 and jobs[0].req.pad_to and guessed[0]:
        seq, tokens = parts[0]
        parts = [(seq, tokens + [tokens[-1]] * max(0, jobs[0].req.pad_to - len(tokens)))]
    return parts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", default="heldout:6,code:6,prose:6")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit="int8_asym",
                                                 speculative=SpeculativeConfig(mode="prompt_lookup"))
    plain = AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit="int8_asym")
    ids = [torch.tensor([token_ids(tok, text, chat=True)])
           for texts in select(parse_prompt_spec(args.prompts)).values() for text in texts]
    new = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    want = [plain.generate(i, **new).tolist() for i in ids]
    before = load_average()
    speeds = {"as is": [], "plain steps padded": []}
    for r in range(args.rounds):
        order = list(speeds) if r % 2 == 0 else list(speeds)[::-1]
        for name in order:
            engine.Engine._parts = padded if name == "plain steps padded" else AS_IS
            tokens = seconds = same = 0
            for i, w in zip(ids, want):
                same += model.generate(i, **new).tolist() == w
                stats = model.last_generate_stats
                tokens, seconds = tokens + stats.new_tokens - 1, seconds + stats.decode_s
            speeds[name].append(tokens / seconds)
            print(f"round {r} {name}: {tokens / seconds:.1f} decode tokens/s, {same} / {len(ids)} identical")
    engine.Engine._parts = AS_IS
    print("median decode tokens/s: " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in speeds.items())
          + f"; load average {before} -> {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
