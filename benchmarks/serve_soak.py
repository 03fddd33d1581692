"""Memory of ``xpuspec serve`` under repeated soaks: the server's RSS after each soak of the same requests.

    python benchmarks/serve_soak.py [--model smollm2-135m-instruct] [--low-bit int8_asym] [--soaks 3]
        [--requests 300] [--concurrency 8] [--max-tokens 4] [--tracemalloc DIR] [-- SERVER ARGS...]

Starts ``xpuspec serve`` as a child process (by default as tests/test_serve.py's server: hybrid speculation with a
draft model, continuous batching of 4), warms it up with one request of every mode, then runs ``--soaks`` soaks of
the same ``--requests`` requests from ``--concurrency`` ``openai``-client threads (tests/test_serve.py's soak mix:
completions and chat, streamed and not, plain, prompt lookup, hybrid and a draft length of 2, 1-4 tokens each) and
prints the server's RSS (``/proc/PID/status`` VmRSS) before the first soak and after each, with the growth per soak.

``--tracemalloc DIR`` traces the server's Python allocations with ``tracemalloc`` (25 frames) from the end of the
warm-up and writes a snapshot of them to ``DIR/soak-N.snapshot`` after each soak (the child acts on SIGUSR1), then
prints the 15 biggest growths between the first and the last snapshot by source line: what the Python heap keeps
from soak to soak. Memory outside Python's allocator (OpenVINO, the C library's arenas) shows in RSS only.
"""

import argparse
import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import Child, free_port  # noqa: E402

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef normalize(x):"]
MODES = [{"speculative": False}, {"prompt_lookup_num_tokens": 4}, {}, {"num_assistant_tokens": 2}]

#: The child under tracemalloc: its first SIGUSR1 starts tracing (after the warm-up: tracing the imports and the model
#: load would take many minutes), each later one dumps a snapshot into $XPUSPEC_SNAPSHOT_DIR; then it serves.
TRACED = """
import os, signal, tracemalloc, gc
count = [0]
def on_usr1(signum, frame):
    if not tracemalloc.is_tracing():
        tracemalloc.start(25)
        return
    gc.collect()
    count[0] += 1
    tracemalloc.take_snapshot().dump(os.path.join(os.environ["XPUSPEC_SNAPSHOT_DIR"], f"soak-{count[0]}.snapshot"))
signal.signal(signal.SIGUSR1, on_usr1)
from xpuspec.cli import main
raise SystemExit(main())
"""



def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def one(client, model: str, i: int, max_tokens: int = 4) -> None:
    """Request ``i`` of a soak (tests/test_serve.py's mix, with 1 to ``max_tokens`` tokens)."""
    mode, n, stream, chat = MODES[i % 4], 1 + i % max_tokens, bool(i % 2), i % 10 == 0
    args = dict(model=model, max_tokens=n, temperature=0, extra_body=dict(mode) or None)
    api = client.chat.completions if chat else client.completions
    if chat:
        args["messages"] = [{"role": "user", "content": PROMPTS[i % 3]}]
    else:
        args["prompt"] = PROMPTS[i % 3]
    if stream:
        for _ in api.create(stream=True, stream_options={"include_usage": True}, **args):
            pass
    else:
        api.create(**args)


def wait_idle(url: str) -> None:
    while (h := httpx.get(url + "/health", timeout=30).json())["running"] or h["waiting"]:
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--low-bit", default="int8_asym")
    p.add_argument("--soaks", type=int, default=3)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4, help="request i asks for 1 + i %% N tokens (default 4)")
    p.add_argument("--tracemalloc", default=None, metavar="DIR")
    p.add_argument("server_args", nargs="*", help="after --: the server's arguments (default: the test server's)")
    args = p.parse_args()
    server_args = args.server_args or ["--speculative", "hybrid", "--draft", args.model, "--draft-low-bit",
                                       args.low_bit, "--max-batch", "4", "--max-queue", "12",
                                       "--draft-release-after", "0"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ["-m", "xpuspec", "--log-level", "WARNING", "serve", args.model, "--port", str(port), "--low-bit",
             args.low_bit, *server_args]
    env = dict(os.environ)
    if args.tracemalloc:
        Path(args.tracemalloc).mkdir(parents=True, exist_ok=True)
        env["XPUSPEC_SNAPSHOT_DIR"] = args.tracemalloc
        cmd = [sys.executable, "-c", TRACED, *serve[2:]]
    else:
        cmd = [sys.executable, *serve]
    child = Child(cmd, port, "/health", None, env=env)
    proc = child.proc
    try:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for i in range(12):  # every mode once: what the first requests build is not growth
            one(client, args.model, i)
        wait_idle(url)
        if args.tracemalloc:
            proc.send_signal(signal.SIGUSR1)  # start tracing
            time.sleep(1)
        rss = [rss_mib(proc.pid)]
        print(f"load average {open('/proc/loadavg').read().split()[:3]}; RSS after warm-up {rss[0]:.0f} MiB",
              flush=True)
        for soak in range(1, args.soaks + 1):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda i: one(client, args.model, i, args.max_tokens), range(args.requests)))
            wait_idle(url)
            rss.append(rss_mib(proc.pid))
            if args.tracemalloc:
                proc.send_signal(signal.SIGUSR1)
                time.sleep(5)
            print(f"soak {soak}: {args.requests} requests at concurrency {args.concurrency} in "
                  f"{time.perf_counter() - t0:.0f} s; RSS {rss[-2]:.0f} -> {rss[-1]:.0f} MiB "
                  f"({rss[-1] - rss[-2]:+.0f}); load average {open('/proc/loadavg').read().split()[:3]}", flush=True)
        if args.tracemalloc and args.soaks >= 2:
            import tracemalloc

            first = tracemalloc.Snapshot.load(os.path.join(args.tracemalloc, "soak-1.snapshot"))
            last = tracemalloc.Snapshot.load(os.path.join(args.tracemalloc, f"soak-{args.soaks}.snapshot"))
            print(f"Python heap: {sum(s.size for s in first.statistics('filename')) / 2**20:.1f} -> "
                  f"{sum(s.size for s in last.statistics('filename')) / 2**20:.1f} MiB (traced)")
            for stat in last.compare_to(first, "lineno")[:15]:
                print(stat)
    finally:
        child.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
