"""What mixing a new request's prefill into the batch's decode pass would save (chunked prefill, as vLLM and SGLang
schedule it), measured on the paged runner before building it.

    PYTHONPATH=.:plugins python benchmarks/prefill_mix_probe.py [--model smollm2-135m-instruct] [--rows 4]

Four live sequences of 120 tokens each take a 2-token decode step (the engine's plain step on a CPU whose 1-token
pass computes differently). For prompts of P tokens it times, as medians of 12: the prompt's prefill alone (last
logits only), the decode step alone, and one pass holding both (the prompt's last logits and every decode row's).
What mixing saves per admitted request is ``prefill + decode - mixed``.
"""

import argparse
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompts", default="40,120,300", help="prompt lengths P")
    args = parser.parse_args()

    from xpuspec import AutoModelForCausalLM

    runner = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit="int8_asym").runner
    rng = random.Random(0)

    def tokens(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    live = []
    for _ in range(args.rows):
        seq = runner.open_sequence()
        seq.forward(tokens(120), logits_to_keep=1)
        live.append(seq)

    def median_ms(fn, n=12):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    def decode():
        runner.forward_batch([(s, tokens(2)) for s in live])
        for s in live:
            s.rollback(2)

    print("| prompt tokens | prefill alone ms | decode step ms | sum ms | mixed pass ms | saved ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for p in (int(x) for x in args.prompts.split(",")):
        def alone():
            seq = runner.open_sequence()
            seq.forward(tokens(p), logits_to_keep=1)
            seq.close()

        def mixed():  # the prompt first, so that the last 1 + 2 * rows logits are its last and the decode rows'
            seq = runner.open_sequence()
            runner._infer([(seq, tokens(p))] + [(s, tokens(2)) for s in live], 1 + 2 * len(live), step=False)
            seq.close()
            for s in live:
                s.rollback(2)

        a, d, m = median_ms(alone), median_ms(decode), median_ms(mixed)
        print(f"| {p} | {a:.1f} | {d:.1f} | {a + d:.1f} | {m:.1f} | {a + d - m:.1f} |")


if __name__ == "__main__":
    main()
