"""Load test of OpenAI-compatible servers: ``xpuspec serve`` plain and speculative (and ``llama_cpp.server`` on the
same GGUF where llama-cpp-python is installed), at several concurrencies, with the real ``openai`` client.

``llama_cpp.server`` runs plain (``llama-cpp``) and with its prompt-lookup draft at its default length
(``llama-cpp-lookup``), with as many threads as cores; it serves one request at a time, and queues the others
(``--interrupt_requests False``; its default cuts a running stream short when another request arrives). It sends no
``usage`` when streaming, so its completion tokens are counted as its text chunks (a token each).

    python benchmarks/serve_bench.py [--model smollm2-135m-instruct] [--low-bit int8_asym]
        [--speculative prompt_lookup] [--concurrency 1,4,16] [--requests 16] [--max-tokens 32]
        [--systems xpuspec-plain,xpuspec-spec,llama-cpp,llama-cpp-lookup] [--rounds 1] [--json FILE]

Each system is started as a child process on a free loopback port and warmed up by one request; then, at each
concurrency, each system in turn (all stay loaded, so drift in the machine's load hits them alike) is driven by that
many client threads sending streamed greedy completions (``temperature=0``,
``stream_options.include_usage``) over the bench prompt sets (code, prose, edit; the same prompts in the same
order for every system) until ``--requests`` requests have finished; ``--rounds N`` repeats that N times, the
systems' order reversed every other round. Per concurrency it reports:

- aggregate tokens/s: completion tokens of a round's requests over the wall time from its first send to its last
  reply (the median round, and the lowest and highest);
- TTFT: from sending a request to its first text chunk; TPOT: from the first chunk to the last, over the
  completion tokens after the first (p50 / p90 / p99 over requests);
- acceptance: accepted over drafted tokens and the mean acceptance length, from each response's
  ``usage.speculative_decoding``.
"""

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import httpx
from openai import OpenAI

START_TIMEOUT_S = 900
#: The llama_cpp.server systems: plain, and with its prompt-lookup draft.
LLAMACPP = ("llama-cpp", "llama-cpp-lookup")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Sample:
    ttft_s: float
    tpot_s: Optional[float]  # None for a 1-token reply
    tokens: int
    drafted: int
    accepted: int
    drafts: int


class Child:
    """A server child process (``env``: its environment, default this one's); returns from __init__ once it
    answers ``health_path``."""

    def __init__(self, cmd: List[str], port: int, health_path: str, log, env: Optional[dict] = None):
        self.port = port
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {self.proc.returncode} while starting")
            try:
                if httpx.get(f"http://127.0.0.1:{port}{health_path}", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{' '.join(cmd)} did not answer {health_path} in {START_TIMEOUT_S} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(system: str, args, log) -> Child:
    port = free_port()
    if system in LLAMACPP:
        gguf = args.gguf or str(Path.home() / ".cache" / "xpuspec" / "gguf" / f"{args.model}.gguf")
        threads = str(os.cpu_count() or 1)  # llama-cpp-python's default is half the cores
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", args.model,
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads", threads,
               "--n_threads_batch", threads, "--interrupt_requests", "False"]
        if system == "llama-cpp-lookup":  # its prompt lookup, at its own default length
            cmd += ["--draft_model", "prompt-lookup-decoding"]
        return Child(cmd, port, "/v1/models", log)
    cmd = [sys.executable, "-m", "xpuspec", "--log-level", "WARNING", "serve", args.model, "--port", str(port),
           "--low-bit", args.low_bit, "--max-queue", str(max(args.concurrency) + 4)]
    if system == "xpuspec-spec":
        cmd += ["--speculative", args.speculative]
    return Child(cmd, port, "/health", log)


def one_request(client: OpenAI, model: str, prompt: str, max_tokens: int, min_tokens: int = 0) -> Sample:
    """One streamed greedy completion (``min_tokens``: vLLM's field, sent where above 0) and its figures."""
    sent = time.perf_counter()
    first = last = None
    usage, chunks = None, 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"min_tokens": min_tokens} if min_tokens else None):
        if chunk.usage is not None:
            usage = chunk.usage
        if any(c.text for c in chunk.choices):
            last = time.perf_counter()
            first = first or last
            chunks += 1
    # llama_cpp.server sends no usage when streaming; it streams a token per chunk
    tokens = usage.completion_tokens if usage is not None else chunks
    spec = (usage.model_extra or {}).get("speculative_decoding") if usage is not None else None
    spec = spec or {}
    first = first or time.perf_counter()
    return Sample(ttft_s=first - sent, tpot_s=(last - first) / (tokens - 1) if last and tokens > 1 else None,
                  tokens=tokens, drafted=spec.get("num_draft_tokens", 0),
                  accepted=spec.get("num_accepted_draft_tokens", 0), drafts=spec.get("num_drafts", 0))


def percentiles(values: List[float]) -> Dict[str, float]:
    values = sorted(values)
    if not values:
        return {}
    pick = lambda q: values[min(len(values) - 1, round(q * (len(values) - 1)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def drive(port: int, model: str, prompts: List[str], concurrency: int, requests: int,
          max_tokens: int, min_tokens: int = 0) -> Tuple[List[Sample], float]:
    """One round: ``requests`` requests from ``concurrency`` client threads, each sending its next as its last ends
    (``requests == concurrency``: all at once). Returns their samples and the wall seconds from the first send to
    the last reply."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)
    next_index, lock = [0], threading.Lock()

    def worker() -> List[Sample]:
        out = []
        while True:
            with lock:
                i = next_index[0]
                if i >= requests:
                    return out
                next_index[0] += 1
            out.append(one_request(client, model, prompts[i % len(prompts)], max_tokens, min_tokens))

    begun = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = [s for f in [pool.submit(worker) for _ in range(concurrency)] for s in f.result()]
    return samples, time.perf_counter() - begun


def summarize(concurrency: int, rounds: List[List[Sample]], walls: List[float]) -> dict:
    """One concurrency level's figures over its rounds: tokens/s is the median round's, the percentiles and the
    acceptance pool every round's requests."""
    samples = [s for r in rounds for s in r]
    speeds = [sum(s.tokens for s in r) / wall for r, wall in zip(rounds, walls)]
    tokens, drafted, accepted = (sum(getattr(s, k) for s in samples) for k in ("tokens", "drafted", "accepted"))
    drafts = sum(s.drafts for s in samples)
    return {"concurrency": concurrency, "requests": len(rounds[0]), "completion_tokens": tokens, "wall_s": sum(walls),
            "tokens_per_s": statistics.median(speeds), "rounds_tokens_per_s": speeds,
            "ttft_s": percentiles([s.ttft_s for s in samples]),
            "tpot_s": percentiles([s.tpot_s for s in samples if s.tpot_s is not None]),
            "acceptance": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "samples": [asdict(s) for s in samples]}


def table(results: Dict[str, List[dict]]) -> str:
    lines = ["| system | concurrency | requests | tokens/s | min-max | TTFT p50 / p90 / p99 ms "
             "| TPOT p50 / p90 / p99 ms | acceptance | mean acceptance length |", "|---" * 9 + "|"]
    ms = lambda d: " / ".join(f"{d[k] * 1000:.0f}" for k in ("p50", "p90", "p99")) if d else "n/a"  # noqa: E731
    for system, rows in results.items():
        for r in rows:
            acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "n/a"
            mal = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "n/a"
            spread = f"{min(r['rounds_tokens_per_s']):.1f}-{max(r['rounds_tokens_per_s']):.1f}"
            lines.append(f"| {system} | {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:.1f} | {spread} | "
                         f"{ms(r['ttft_s'])} | {ms(r['tpot_s'])} | {acc} | {mal} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--low-bit", default="int8_asym")
    p.add_argument("--speculative", default="prompt_lookup", help="xpuspec-spec's --speculative (default prompt_lookup)")
    p.add_argument("--systems", default="xpuspec-plain,xpuspec-spec,llama-cpp,llama-cpp-lookup")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level and round")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds per concurrency level, the systems in turn (order reversed every other round)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", default="code:4,prose:4,edit:4", help="xpuspec bench's --prompts spec")
    p.add_argument("--gguf", default=None, help="llama-cpp's GGUF (default: xpuspec's cached GGUF of --model)")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--server-log", default=None, metavar="FILE", help="the servers' output (default: discarded)")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")

    from xpuspec.bench import prompts as prompt_sets

    chosen = prompt_sets.select(prompt_sets.parse_prompt_spec(args.prompts))
    texts = [t for i in range(max(len(v) for v in chosen.values())) for v in chosen.values() if i < len(v) for t in [v[i]]]
    log = open(args.server_log or "/dev/null", "a")
    results, unavailable, children = {}, {}, {}
    try:
        for system in [s.strip() for s in args.systems.split(",") if s.strip()]:
            if system in LLAMACPP and importlib.util.find_spec("llama_cpp") is None:
                unavailable[system] = "llama-cpp-python is not installed"
                continue
            children[system] = child = start(system, args, log)
            one_request(OpenAI(base_url=f"http://127.0.0.1:{child.port}/v1", api_key="none", max_retries=0,
                               timeout=900), args.model, texts[0], args.max_tokens)  # warm-up
            results[system] = []
        for c in args.concurrency:  # the systems one after another at each level, so load drift hits them alike
            rounds = {system: ([], []) for system in children}  # per system: each round's samples, wall seconds
            for r in range(args.rounds):
                for system, child in (list(children.items())[::-1] if r % 2 else children.items()):
                    samples, wall = drive(child.port, args.model, texts, c, args.requests, args.max_tokens)
                    rounds[system][0].append(samples)
                    rounds[system][1].append(wall)
                    print(f"{system} c={c} round {r}: {sum(x.tokens for x in samples) / wall:.1f} tokens/s",
                          file=sys.stderr)
            for system, (samples, walls) in rounds.items():
                results[system].append(summarize(c, samples, walls))
    finally:
        for child in children.values():
            child.stop()
    print(table(results))
    if {"xpuspec-plain", "xpuspec-spec"} <= set(results):
        for plain, spec in zip(results["xpuspec-plain"], results["xpuspec-spec"]):
            ratios = ", ".join(f"{b / a:.2f}x"
                               for a, b in zip(plain["rounds_tokens_per_s"], spec["rounds_tokens_per_s"]))
            print(f"\nxpuspec-spec / xpuspec-plain at concurrency {plain['concurrency']}: "
                  f"{spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x (medians); by round {ratios}")
    for system, why in unavailable.items():
        print(f"\n{system}: not run ({why}).")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": {k: v for k, v in vars(args).items()},
                                               "results": results, "unavailable": unavailable}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
