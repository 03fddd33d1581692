"""Pipeline against one process, side by side in one torchrun job (the ratio is what a noisy machine can give); CPU, gloo.

    XPUSPEC_DIST_TIMEOUT=600 torchrun --nproc-per-node 2 benchmarks/torchrun_pipeline.py [MODEL] [NEW_TOKENS] [REPEATS]

Prints, on rank 0: the communication round trip of one decode step (the in-step check, the hidden
states ``[1, 1, hidden]`` to the next rank, the logits ``[1, vocab]`` broadcast back), then for each
repeat the decode tokens/s of the N-rank pipeline (one thread per rank, torchrun's default) and of
the whole model in rank 0 alone with N threads and with 1 thread, while the other ranks wait in a
barrier. Greedy, one prompt.
"""

import sys
import time

import torch
import torch.distributed as dist

from xpuspec import AutoModelForCausalLM, AutoTokenizer
from xpuspec.distributed import torchrun_world

PROMPT = "def fibonacci(n):"


def round_trip_ms(runner, steps: int = 300) -> float:
    """Milliseconds of the communication of one 1-token pipeline step, without the layers' compute."""
    rank, last = runner.world.rank, runner.world.world_size - 1
    hidden = torch.zeros(1, 1, runner.model.config.hidden_size)
    logits = torch.zeros(1, runner.vocab_size)
    check = torch.zeros(6, dtype=torch.long)
    for i in range(steps + 20):
        if i == 20:
            dist.barrier()
            start = time.perf_counter()
        dist.all_reduce(check, op=dist.ReduceOp.MAX)
        if rank > 0:
            dist.recv(hidden, src=rank - 1)
        if rank < last:
            dist.send(hidden, dst=rank + 1)
        dist.broadcast(logits, src=last)
    return (time.perf_counter() - start) / steps * 1e3


def tokens_per_s(model, ids, new_tokens: int) -> float:
    model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return model.last_generate_stats.new_tokens / model.last_generate_stats.decode_s


def main(model_name="smollm2-135m-instruct", new_tokens="64", repeats="3"):
    model = AutoModelForCausalLM.from_pretrained(model_name, backend="torch", load_in_low_bit="fp32",
                                                 pipeline_parallel_stages=torchrun_world().world_size)
    world = model.runner.world
    ids = AutoTokenizer.from_pretrained(model_name)(PROMPT, return_tensors="pt").input_ids
    single = AutoModelForCausalLM.from_pretrained(model_name, backend="torch", load_in_low_bit="fp32",
                                                  device="cpu") if world.rank == 0 else None
    rtt = round_trip_ms(model.runner)
    if world.rank == 0:
        print(f"stages {model.runner.device_map}\nround trip per 1-token step: {rtt:.3f} ms")
    for r in range(int(repeats)):
        pipeline = tokens_per_s(model, ids, int(new_tokens))
        if world.rank == 0:
            alone = {}
            for threads in (world.world_size, 1):
                torch.set_num_threads(threads)
                alone[threads] = tokens_per_s(single, ids, int(new_tokens))
            torch.set_num_threads(1)
            print(f"repeat {r}: pipeline {world.world_size} ranks x 1 thread {pipeline:.1f} tokens/s; one process "
                  f"{world.world_size} threads {alone[world.world_size]:.1f} tokens/s, 1 thread {alone[1]:.1f} tokens/s "
                  f"(pipeline / one process {world.world_size} threads: {pipeline / alone[world.world_size]:.2f})",
                  flush=True)
        dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
