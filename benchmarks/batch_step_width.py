"""Why the engine's batched plain steps carried 2 tokens per row, and what that costs.

Since split steps (``runner.traits.split_steps``, ``benchmarks/results/engine.md``) ``forward_batch`` feeds every token
as a 1-token subsequence, so on such a runner the rows below compute alike at every width; the figures of the
section before split steps came from the code of that time.

    PYTHONPATH=.:plugins python benchmarks/batch_step_width.py

On a CPU whose 1-token pass computes other logits than a wider one (the runner's ``single_step_width`` is then 2),
a request alone runs its plain steps 2 wide. Whether a row of a batched pass with 1 token per row computes as that
2-wide pass is what decides whether batched rows may step 1 token wide and stay identical to the request alone. For
2, 4 and 8 rows of the batch bench's prompts (SmolLM2 int8_asym): the largest logit difference of each row's first
position between a batched pass of 1 token per row, a batched pass of 2 tokens per row and the row's 2-wide pass
alone; then the medians of 15 batched passes of each width at 4 and 8 rows (the lower of two tries).
"""

import statistics
import time

from xpuspec import AutoModelForCausalLM, AutoTokenizer
from xpuspec.bench.batch import batch_rows


def opened(runner, tok, rows):
    """``rows`` sequences, each prefilled with a batch-bench prompt but its last token; with those prompts."""
    seqs, prompts = [runner.open_sequence() for _ in range(rows)], [tok(p).input_ids for p in batch_rows(rows)]
    for seq, prompt in zip(seqs, prompts):
        seq.forward(prompt[:-1])
    return seqs, prompts


def passed(runner, seqs, prompts, width):
    """One batched pass of ``width`` copies of each row's last token, rolled back; per row ``[width, vocab]``."""
    rows = runner.forward_batch([(seq, [prompt[-1]] * width) for seq, prompt in zip(seqs, prompts)])
    for seq in seqs:
        seq.rollback(width)
    return rows


def main() -> None:
    model = AutoModelForCausalLM.from_pretrained("smollm2-135m-instruct", device="cpu", load_in_low_bit="int8_asym")
    tok = AutoTokenizer.from_pretrained("smollm2-135m-instruct")
    runner = model.runner
    print("single_step_width", runner.traits.single_step_width)
    for rows in (2, 4, 8):
        seqs, prompts = opened(runner, tok, rows)
        ones, twos = passed(runner, seqs, prompts, 1), passed(runner, seqs, prompts, 2)
        alone = []
        for seq, prompt in zip(seqs, prompts):
            alone.append(seq.forward([prompt[-1]] * 2))
            seq.rollback(2)

        def diff(a, b):
            return max(float((x[0] - y[0]).abs().max()) for x, y in zip(a, b))

        print(f"rows {rows}: 1-token rows against 2-token rows (batched) {diff(ones, twos):.3g}; 2-token rows batched "
              f"against 2 wide alone {diff(twos, alone):.3g}; 1-token rows batched against 2 wide alone "
              f"{diff(ones, alone):.3g}")
        for seq in seqs:
            seq.close()
    for rows in (4, 8):
        seqs, prompts = opened(runner, tok, rows)
        best = {}
        for width in (1, 2, 1, 2):
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                passed(runner, seqs, prompts, width)
                times.append(time.perf_counter() - t0)
            best[width] = min(best.get(width, float("inf")), statistics.median(times))
        print(f"rows {rows}: a pass of 1 token per row {1000 * best[1]:.1f} ms, of 2 tokens per row "
              f"{1000 * best[2]:.1f} ms ({best[2] / best[1]:.2f}x)")
        for seq in seqs:
            seq.close()


if __name__ == "__main__":
    main()
