"""Multi-turn chat through ``xpuspec serve`` with the prefix cache on and off (``--no-prefix-cache``), with the real
``openai`` client: each turn resends the whole conversation, as chat clients do.

    python benchmarks/prefix_cache_bench.py [--model smollm2-135m-instruct] [--low-bit int8_asym] [--turns 6]
        [--sessions 3] [--max-tokens 32] [--speculative prompt_lookup] [--json FILE]

Each session's system message is a document (the docstring of a Python standard-library module: ordinary technical
prose that nothing in xpuspec was tuned on) and each turn asks one question about it. Four servers run one after the
other, each on a free loopback port and warmed up by one request: plain and speculative (``--speculative``), each
with the cache on and off. For every turn it reports:

- TTFT: from sending the streamed request to its first text chunk (the median over sessions);
- ``usage.prompt_tokens_details.cached_tokens`` over ``usage.prompt_tokens`` (the reuse);
- and, once per turn, the TTFT of a request whose prompt is only that turn's question (no document, no history):
  the floor a cache that reused everything could reach.

It prints a table and the targets of issue 39: turns 2-6 at least 3x faster to the first token than without the
cache, at most 1.2x the TTFT of the question alone, and reuse with speculation at least 90% of reuse without.
"""

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import Child, free_port  # noqa: E402

#: Standard-library modules whose docstrings are the sessions' documents.
DOCUMENTS = ("argparse", "json", "logging", "subprocess", "threading", "unittest")
QUESTIONS = ("What is this module for?", "Name one function it provides.", "How do I use it in a script?",
             "What can go wrong when using it?", "Give a short example.", "Summarize our conversation.")


def document(name: str, words: int = 220) -> str:
    text = " ".join(inspect.getdoc(__import__(name)).split())
    return "Answer questions about this documentation.\n\n" + " ".join(text.split()[:words])


def start(args, speculative: bool, cache: bool, log) -> Child:
    port = free_port()
    cmd = [sys.executable, "-m", "xpuspec", "--log-level", "WARNING", "serve", args.model, "--port", str(port),
           "--low-bit", args.low_bit]
    cmd += ["--speculative", args.speculative] if speculative else []
    cmd += [] if cache else ["--no-prefix-cache"]
    return Child(cmd, port, "/health", log)


def ask(client: OpenAI, model: str, messages, max_tokens: int):
    """(TTFT seconds, reply text, prompt tokens, cached tokens, TPOT seconds) of one streamed greedy chat request."""
    sent = time.perf_counter()
    first = last = None
    text, usage = [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                last = time.perf_counter()
                first = first or last
                text.append(choice.delta.content)
    details = usage.prompt_tokens_details
    tpot = (last - first) / (usage.completion_tokens - 1) if first and usage.completion_tokens > 1 else None
    return (first or time.perf_counter()) - sent, "".join(text), usage.prompt_tokens, \
        (details.cached_tokens if details else 0), tpot


def run_server(args, speculative: bool, cache: bool, log) -> dict:
    child = start(args, speculative, cache, log)
    client = OpenAI(base_url=f"http://127.0.0.1:{child.port}/v1", api_key="none", max_retries=0, timeout=600)
    try:
        ask(client, args.model, [{"role": "user", "content": "Hello"}], 4)  # warm-up
        turns = [[] for _ in range(args.turns)]
        alone = [[] for _ in range(args.turns)]
        replies = []
        for s in range(args.sessions):
            messages = [{"role": "system", "content": document(DOCUMENTS[s % len(DOCUMENTS)])}]
            for t in range(args.turns):
                question = QUESTIONS[t % len(QUESTIONS)]
                messages.append({"role": "user", "content": question})
                ttft, reply, prompt, cached, tpot = ask(client, args.model, messages, args.max_tokens)
                turns[t].append({"ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached, "tpot_s": tpot})
                replies.append(reply)
                messages.append({"role": "assistant", "content": reply})
                alone[t].append(ask(client, args.model, [{"role": "user", "content": question}], args.max_tokens)[0])
        return {"turns": turns, "alone": alone, "replies": replies}
    finally:
        child.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--low-bit", default="int8_asym")
    p.add_argument("--speculative", default="prompt_lookup")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    load = os.getloadavg()
    results = {}
    with open(os.devnull, "w") as log:
        for speculative in (False, True):
            for cache in (True, False):
                name = f"{'spec' if speculative else 'plain'}-{'cache' if cache else 'nocache'}"
                results[name] = run_server(args, speculative, cache, log)
                print(f"{name}: done", file=sys.stderr)
    med = statistics.median
    print(f"# {args.model} {args.low_bit}, {args.sessions} sessions x {args.turns} turns, {args.max_tokens} new tokens "
          f"a turn; load average before {load[0]:.2f} {load[1]:.2f}, after {os.getloadavg()[0]:.2f}")
    for mode in ("plain", "spec"):
        on, off = results[f"{mode}-cache"], results[f"{mode}-nocache"]
        print(f"\n## {mode}{' (' + args.speculative + ')' if mode == 'spec' else ''}\n")
        print("| turn | prompt tokens | cached | TTFT cache on (ms) | TTFT off (ms) | off / on | question alone (ms) "
              "| on / alone |")
        print("|---|---|---|---|---|---|---|---|")
        for t in range(args.turns):
            a, b = on["turns"][t], off["turns"][t]
            t_on, t_off = med(x["ttft_s"] for x in a), med(x["ttft_s"] for x in b)
            t_alone = med(on["alone"][t])
            print(f"| {t + 1} | {med(x['prompt_tokens'] for x in a):.0f} | {med(x['cached_tokens'] for x in a):.0f} "
                  f"| {t_on * 1000:.0f} | {t_off * 1000:.0f} | {t_off / t_on:.2f}x | {t_alone * 1000:.0f} "
                  f"| {t_on / t_alone:.2f}x |")
        same = on["replies"] == off["replies"]
        tpots = [med(x["tpot_s"] for turn in r["turns"] for x in turn if x["tpot_s"]) for r in (on, off)]
        print(f"\nreplies identical with the cache on and off: {same}; TPOT median {tpots[0] * 1000:.1f} ms on, "
              f"{tpots[1] * 1000:.1f} ms off")
    reuse = {}
    for mode in ("plain", "spec"):
        rows = [x for turn in results[f"{mode}-cache"]["turns"] for x in turn]
        reuse[mode] = sum(x["cached_tokens"] for x in rows) / sum(x["prompt_tokens"] for x in rows)
    print(f"\nreuse (cached / prompt tokens, all turns): plain {reuse['plain']:.1%}, speculative {reuse['spec']:.1%} "
          f"({reuse['spec'] / reuse['plain']:.0%} of plain)")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"args": vars(args), "load_before": load, "results": results, "reuse": reuse}, f, indent=1)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
