"""``xpuspec serve`` under two stresses: a huge prompt arriving beside running streams, and SIGTERM mid-stream.

    python benchmarks/serve_stress.py [--model smollm2-135m-instruct] [--low-bit int8_asym] [--prompt-mb 10]
        [--drain-timeout 2] [-- SERVER ARGS...]

Starts ``xpuspec serve`` as a child process (``--max-batch 4 --drain-timeout D`` and the server arguments after
``--``), then, with the real ``openai`` client:

1. **A huge prompt.** Two streams of 160 greedy tokens run alone (their gaps between events without it); then two
   such streams again, and 1.5 s after they start a completions request with a prompt of ``--prompt-mb`` MB of text
   arrives (its answer: a 413, or a 400, depending on the server's bounds), and
   a ``/health`` probe goes out every 50 ms. Prints the streams' longest and median gap between events over the
   whole run, the huge request's status and seconds, and the slowest ``/health`` answer.
2. **SIGTERM.** Five streams asking for 4000 tokens start (past ``--max-batch 4``, the fifth waits in the queue);
   SIGTERM goes to the server 2 s later. Prints the seconds from the signal to the process's exit, what each client
   got last (an error event and ``[DONE]``, or a connection error), and whether the server's log holds a traceback.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import Child, free_port  # noqa: E402

PROMPT = "Once upon a time, in a small village,"


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def stream_gaps(client, model, n, out, key):
    """A greedy stream of ``n`` tokens; its event times go to ``out[key]``."""
    times = [time.perf_counter()]
    for _ in client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0, stream=True):
        times.append(time.perf_counter())
    out[key] = times


def raw_stream(url, model, n, out, key):
    """A raw SSE stream (httpx): its last two events, or the transport error that ended it."""
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=600,
                          json={"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0,
                                "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        out[key] = lines[-2:]
    except httpx.TransportError as exc:
        out[key] = [f"transport error: {type(exc).__name__}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--low-bit", default="int8_asym")
    p.add_argument("--prompt-mb", type=float, default=10)
    p.add_argument("--drain-timeout", type=float, default=2)
    p.add_argument("server_args", nargs="*")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "xpuspec", "serve", args.model, "--port", str(port), "--low-bit", args.low_bit,
           "--max-batch", "4", "--drain-timeout", str(args.drain_timeout), *args.server_args]
    proc = Child(cmd, port, "/health", log).proc
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    client.completions.create(model=args.model, prompt=PROMPT, max_tokens=4, temperature=0)  # warm-up
    print(f"server: {' '.join(cmd[2:])}\nload average before: {load()}", flush=True)

    # 0. the same two streams alone: the gaps that load and batching give anyway
    out = {}
    streams = [threading.Thread(target=stream_gaps, args=(client, args.model, 160, out, k)) for k in ("a", "b")]
    for t in streams:
        t.start()
    for t in streams:
        t.join()
    gaps = [b - a for k in ("a", "b") for a, b in zip(out[k][1:], out[k][2:])]
    print(f"two streams alone: gaps between events: longest {max(gaps):.3f} s, median {statistics.median(gaps):.3f} s;"
          f" load average {load()}", flush=True)

    # 1. the huge prompt beside two streams
    out, done = {}, threading.Event()
    streams = [threading.Thread(target=stream_gaps, args=(client, args.model, 160, out, k)) for k in ("a", "b")]
    for t in streams:
        t.start()
    time.sleep(1.5)
    huge = "hello world, 12345. " * int(args.prompt_mb * 1e6 / 20)

    def send_huge():
        t0 = time.perf_counter()
        try:
            client.completions.create(model=args.model, prompt=huge, max_tokens=4)
            out["huge"] = ("200", time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - the status is the figure
            out["huge"] = (f"{getattr(exc, 'status_code', type(exc).__name__)}", time.perf_counter() - t0)
        done.set()

    health = []
    sender = threading.Thread(target=send_huge)
    sender.start()
    while not done.is_set() or any(t.is_alive() for t in streams):
        t0 = time.perf_counter()
        httpx.get(url + "/health", timeout=60)
        health.append(time.perf_counter() - t0)
        time.sleep(0.05)
    sender.join()
    for t in streams:
        t.join()
    gaps = [b - a for k in ("a", "b") for a, b in zip(out[k][1:], out[k][2:])]  # after each stream's first event
    print(f"huge prompt ({len(huge) / 1e6:.1f} MB): answer {out['huge'][0]} after {out['huge'][1]:.2f} s; other "
          f"streams' gaps between events: longest {max(gaps):.3f} s, median {statistics.median(gaps):.3f} s; "
          f"slowest /health {max(health):.3f} s of {len(health)}; load average {load()}", flush=True)

    # 2. SIGTERM mid-stream
    ends = {}
    threads = [threading.Thread(target=raw_stream, args=(url, args.model, 4000, ends, k)) for k in range(5)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    time.sleep(2)
    h = httpx.get(url + "/health", timeout=30).json()
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=600)
    exit_s = time.perf_counter() - t0
    for t in threads:
        t.join(timeout=60)
    log.flush()
    text = open(log.name).read()
    print(f"SIGTERM with {h['running']} running and {h['waiting']} waiting, --drain-timeout {args.drain_timeout:g}: "
          f"exit {code} after {exit_s:.2f} s; load average {load()}")
    for k in sorted(ends):
        last = ends[k]
        error = next((json.loads(line[6:])["error"].get("code") for line in last if line.startswith("data: {")
                      and '"error"' in line), None)
        print(f"  client {k}: last event {last[-1][:40]!r}, error event: {error}")
    print(f"  tracebacks in the server's log: {text.count('Traceback')} ({log.name})")
    os.unlink(log.name) if "Traceback" not in text else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
