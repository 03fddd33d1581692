"""What a change of pass width costs the paged OpenVINO runner, against runs of one width.

The paged runner pads a lone row's verify passes to the widest width so far in its request
(``RunnerTraits.fixed_verify_width``), because a new input width costs the CPU plugin a re-preparation. This times
passes of one sequence (a 200-token context, each pass rolled back) in repeating width patterns: one width alone
(``[6]``), or widths that alternate (``[4, 6]``; ``[2, 4, 2, 6]`` mixes the 2-wide plain step with verify passes,
as prompt lookup's rounds do). Medians per width, in ms, after 6 warm-up passes; ``--repeats`` rounds of all
patterns.

    PYTHONPATH=.:plugins python benchmarks/width_switch_probe.py [--model smollm2-135m-instruct] [--repeats 3]
"""

import argparse
import statistics
import time

from xpuspec import AutoModelForCausalLM
from xpuspec.bench.load import load_average

PATTERNS = ([2], [4], [6], [11], [4, 6], [3, 5, 7], [2, 4, 2, 6])


def timed(runner, widths, passes: int = 60) -> dict:
    seq = runner.open_sequence()
    seq.forward(list(range(100, 300)), logits_to_keep=1)
    times = {}
    for i in range(passes):
        w = widths[i % len(widths)]
        t0 = time.perf_counter()
        seq.forward([7] * w)
        spent = time.perf_counter() - t0
        seq.rollback(w - 1)
        if i >= 6:
            times.setdefault(w, []).append(1000 * spent)
    seq.close()
    return {w: statistics.median(v) for w, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--low-bit", default="int8_asym")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    runner = AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit=args.low_bit).runner
    before = load_average()
    rows = {tuple(pattern): [] for pattern in PATTERNS}
    for _ in range(args.repeats):
        for pattern in PATTERNS:
            rows[tuple(pattern)].append(timed(runner, pattern))
    print(f"{type(runner).__name__}, {args.model} {args.low_bit}; load average {before} -> {load_average()}\n")
    print("| widths in turn | ms per pass, by width (each round) |")
    print("|---|---|")
    for pattern, runs in rows.items():
        cells = "; ".join(f"{w}: " + ", ".join(f"{run[w]:.1f}" for run in runs) for w in dict.fromkeys(pattern))
        print(f"| {list(pattern)} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
