"""Where the server's throughput goes against in-process batching: the same prompts, model and batch size, side by
side in one run.

    PYTHONPATH=.:plugins python benchmarks/serve_gap.py [--model smollm2-135m-instruct] [--low-bit int8_asym]
        [--batch 4] [--max-tokens 32] [--rounds 4] [--json FILE]

Three ways of decoding the batch bench's prompts (:data:`xpuspec.bench.batch.PROMPTS`, ``--batch`` rows) greedily,
``--max-tokens`` new tokens each, in turn for ``--rounds`` rounds (the order reversed every other round):

- ``in-process``: ``model.generate`` on the padded batch of ``--batch`` prompts (``min_new_tokens`` holds EOS back),
  as ``xpuspec bench --batch-size`` times it;
- ``server-closed``: ``xpuspec serve --max-batch B`` with the same ``--batch`` prompts sent at once by as many
  ``openai``-client threads, streamed; the next batch is sent when all have ended (what ``generate`` does, through
  HTTP, server-sent events and detokenizing);
- ``server-open``: the same server kept at ``--batch`` requests in flight (a thread sends its next request as its
  last one ends), ``2 * --batch`` requests per round.

Both server ways are ``benchmarks/serve_bench.py``'s ``drive``, with ``--batch`` client threads.

Per way: completion tokens over wall seconds (tokens/s), and the CPU seconds of the server process and of this
process (the client threads, or the in-process model) over the round, from ``/proc``: on 2 cores what the client
burns is taken from the server. Server requests ask for ``min_tokens`` = ``--max-tokens`` (vLLM's field), so that
every way makes the same tokens; the completion tokens are counted from ``usage``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_bench import drive, free_port  # noqa: E402

from xpuspec.bench.batch import batch_rows  # noqa: E402
from xpuspec.bench.load import load_average  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--low-bit", default="int8_asym")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args()

    from xpuspec import AutoModelForCausalLM, AutoTokenizer

    prompts = batch_rows(args.batch)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "xpuspec", "--log-level", "WARNING", "serve", args.model,
                               "--port", str(port), "--low-bit", args.low_bit, "--max-batch", str(args.batch),
                               "--max-queue", str(4 * args.batch)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(900):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        model = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit=args.low_bit)
        tok = AutoTokenizer.from_pretrained(args.model)
        tok.pad_token, tok.padding_side = tok.pad_token or tok.eos_token, "left"
        batch = tok(prompts, padding=True, return_tensors="pt")
        new = args.max_tokens

        def in_process() -> int:
            model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            return sum(s.new_tokens for s in (model.last_generate_stats.rows or [model.last_generate_stats]))

        def served(requests: int) -> int:  # drive's threads, one per prompt of the batch
            samples, _ = drive(port, args.model, prompts, len(prompts), requests, new, min_tokens=new)
            return sum(sample.tokens for sample in samples)

        ways = {"in-process": in_process,
                "server-closed": lambda: served(len(prompts)),
                "server-open": lambda: served(2 * len(prompts))}
        for way in ways.values():  # warm-up: each way once
            way()
        runs = {name: [] for name in ways}
        before = load_average()
        for r in range(args.rounds):
            for name, way in (list(ways.items())[::-1] if r % 2 else ways.items()):
                me, srv, t0 = cpu_s(os.getpid()), cpu_s(server.pid), time.perf_counter()
                tokens = way()
                wall = time.perf_counter() - t0
                runs[name].append(dict(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                                       server_cpu_s=cpu_s(server.pid) - srv,
                                       this_process_cpu_s=cpu_s(os.getpid()) - me))
                print(f"round {r} {name}: {tokens / wall:.1f} tokens/s", file=sys.stderr)
        after = load_average()
    finally:
        server.terminate()
        server.wait(timeout=60)
    base = statistics.median(x["tokens_per_s"] for x in runs["in-process"])
    print(f"batch {args.batch}, {args.max_tokens} new tokens, {args.rounds} rounds; load average {before} -> {after}\n")
    print("| way | tokens/s (median; min-max) | / in-process | tokens per round | CPU s per round: server / "
          "this process | CPU s per 100 tokens |")
    print("|---|---|---|---|---|---|")
    for name, xs in runs.items():
        speed = statistics.median(x["tokens_per_s"] for x in xs)
        tokens = statistics.median(x["tokens"] for x in xs)
        srv = statistics.median(x["server_cpu_s"] for x in xs)
        me = statistics.median(x["this_process_cpu_s"] for x in xs)
        print(f"| {name} | {speed:.1f} ({min(x['tokens_per_s'] for x in xs):.1f}-"
              f"{max(x['tokens_per_s'] for x in xs):.1f}) | {speed / base:.2f}x | {tokens:.0f} | {srv:.2f} / {me:.2f} "
              f"| {100 * (srv + me) / tokens:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "load_average": [before, after],
                                               "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
