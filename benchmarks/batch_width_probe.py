"""Whether a batched pass may feed a row 1 token where xpuspec pads it to 2: the first-token logits of each row fed
``[t]`` against the same row fed ``[t, t]``, in one paged pass over 2, 4 and 8 sequences, greedy, 24 steps each;
then plain batched ``generate`` with a u8 against an f32 KV cache, alternating in one process.

    PYTHONPATH=.:plugins python benchmarks/batch_width_probe.py [--model smollm2-135m-instruct] [--low-bit int8_asym]

Prints, per batch size, the rows whose logits differ at all, the largest difference and the argmax flips; then the
aggregate tokens/s (48 new tokens per row, median of 3) of each KV precision at batch 4 and 8.
"""

import argparse
import statistics
import time

from xpuspec import AutoModelForCausalLM, AutoTokenizer
from xpuspec.bench import prompts
from xpuspec.bench.batch import PROMPTS, batch_rows


def width_probe(model, tok, steps: int = 24) -> None:
    runner = model.runner
    texts = PROMPTS + [t for v in prompts.select(prompts.parse_prompt_spec("prose:4,code:4")).values() for t in v]
    for batch in (2, 4, 8):
        seqs = [runner.open_sequence() for _ in range(batch)]
        rows = runner.forward_batch([(s, tok(t).input_ids) for s, t in zip(seqs, texts)])
        nxt = [int(r[-1].argmax()) for r in rows]
        differ = flips = 0
        largest = 0.0
        for _ in range(steps):
            padded = runner.forward_batch([(s, [t, t]) for s, t in zip(seqs, nxt)])
            for s in seqs:
                s.rollback(2)
            single = runner.forward_batch([(s, [t]) for s, t in zip(seqs, nxt)])
            for a, b in zip(padded, single):
                d = (a[0] - b[0]).abs().max().item()
                largest, differ, flips = max(largest, d), differ + (d > 0), flips + int(a[0].argmax() != b[0].argmax())
            nxt = [int(b[0].argmax()) for b in single]
        print(f"batch {batch}: {differ} of {steps * batch} rows differ, largest |difference| {largest:.3g}, "
              f"{flips} argmax flips")
        for s in seqs:
            s.close()


def kv_precision(name: str, low_bit: str, tok) -> None:
    models = {kv: AutoModelForCausalLM.from_pretrained(name, device="cpu", load_in_low_bit=low_bit,
                                                       ov_config={"KV_CACHE_PRECISION": kv}) for kv in ("f32", "u8")}
    for batch in (4, 8):
        inputs = tok(batch_rows(batch), padding=True, return_tensors="pt")
        speeds = {kv: [] for kv in models}
        for m in models.values():  # warm-up
            m.generate(**inputs, max_new_tokens=48, min_new_tokens=48, do_sample=False)
        for _ in range(3):
            for kv, m in models.items():
                start = time.perf_counter()
                m.generate(**inputs, max_new_tokens=48, min_new_tokens=48, do_sample=False)
                speeds[kv].append(48 * batch / (time.perf_counter() - start))
        print(f"batch {batch}: " + ", ".join(f"KV {kv} {statistics.median(v):.1f} tok/s" for kv, v in speeds.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--low-bit", default="int8_asym")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token, tok.padding_side = tok.pad_token or tok.eos_token, "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit=args.low_bit)
    print(f"single_step_width {model.runner.traits.single_step_width}")
    width_probe(model, tok)
    del model
    kv_precision(args.model, args.low_bit, tok)


if __name__ == "__main__":
    main()
