"""What one ``train-draft`` step of an EAGLE-3 head costs, in float32 and in bfloat16 autocast, by sequence length.

    PYTHONPATH=.:plugins python benchmarks/eagle3_train_step.py [--model smollm2-135m-instruct] [--threads 2]
        [--lengths 140,280,560,1120]

A randomly initialised head of the target's shape (draft vocabulary 8192), random taps and teacher distributions: one
step is the 3 test-time-training steps' forward, the soft cross-entropy, backward, gradient clipping and AdamW, as
:func:`xpuspec.speculative.eagle3_train.train_head` runs it on one sequence. Medians of 5 steps after one warm-up,
float32 and bfloat16 alternated twice (the lower median of each kept). bfloat16 pays only on CPUs with bfloat16
products (AVX512-BF16 or AMX); elsewhere torch emulates it.
"""

import argparse
import statistics
import tempfile
import time

import torch
import transformers

from xpuspec.sources import resolve_source
from xpuspec.speculative import eagle3_train as training
from xpuspec.speculative.eagle3 import Eagle3Head, check_head, default_layer_ids, new_head, read_head


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="140,280,560,1120")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = transformers.AutoConfig.from_pretrained(resolve_source(args.model).path)
    layers = config.num_hidden_layers
    folder = new_head(config, tempfile.mkdtemp() + "/head", draft_ids=list(range(8192)),
                      layer_ids=default_layer_ids(layers))
    spec = read_head(folder)
    head = Eagle3Head.load(spec, check_head(spec, config.hidden_size, config.vocab_size, layers))
    head.embed.weight.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-4)
    native = training._precision(None, lambda *_: None)
    print(f"{args.model}, torch threads {args.threads}, bfloat16 products: {native}")
    print("| sequence tokens | float32 ms | bfloat16 autocast ms | float32 / bfloat16 |\n|---:|---:|---:|---:|")
    for n in map(int, args.lengths.split(",")):
        torch.manual_seed(0)
        batch = training._Batch(torch.randint(0, 8000, (1, n)), torch.randn(1, n, 3 * config.hidden_size),
                                torch.softmax(torch.randn(1, n, 32), -1), torch.randint(0, 8192, (1, n, 32)), [n])

        def step(bf16: bool) -> float:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = training._loss(training._head_steps(head, batch.tokens, batch.taps, 3), batch)
            optim.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            return time.perf_counter() - t0

        best = {}
        for bf16 in (False, True, False, True):
            step(bf16)
            best[bf16] = min(best.get(bf16, float("inf")), statistics.median(step(bf16) for _ in range(5)))
        print(f"| {n} | {1000 * best[False]:.0f} | {1000 * best[True]:.0f} | {best[False] / best[True]:.2f}x |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
