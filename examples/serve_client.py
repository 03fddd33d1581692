"""Start ``xpuspec serve`` on a free loopback port, call it with the ``openai`` client (a completion, then a
streamed chat), print what it answered and the speculative figures, and shut it down.

    python examples/serve_client.py [MODEL] [--speculative MODE] [--max-tokens N]

Needs the ``serve`` extra (``pip install -e ".[serve]"``) and the ``openai`` package. Exits with the server's
status after SIGTERM (0 when it drained cleanly).
"""

import argparse
import signal
import socket
import subprocess
import sys
import time

import httpx
from openai import OpenAI

PROMPT = "def fibonacci(n):"
#: Seconds the server may take to load its model and answer /health.
START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, port: int, speculative: str) -> subprocess.Popen:
    """``python -m xpuspec serve`` as a child; returns once ``/health`` answers."""
    cmd = [sys.executable, "-m", "xpuspec", "--log-level", "WARNING", "serve", model, "--port", str(port),
           "--low-bit", "int8_asym", "--speculative", speculative]
    server = subprocess.Popen(cmd)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode} while starting")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise SystemExit("the server did not answer /health in time")
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--speculative", default="prompt_lookup", help="the server's --speculative mode")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    port = free_port()
    server = start(args.model, port, args.speculative)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        done = client.completions.create(model=args.model, prompt=PROMPT, max_tokens=args.max_tokens, temperature=0)
        print(f"completion: {done.choices[0].text!r}")
        print(f"speculative: {(done.usage.model_extra or {}).get('speculative_decoding')}")
        pieces = []
        for chunk in client.chat.completions.create(
                model=args.model, messages=[{"role": "user", "content": "Name three prime numbers."}],
                max_tokens=args.max_tokens, temperature=0, stream=True):
            pieces += [c.delta.content or "" for c in chunk.choices]
        print(f"chat, streamed: {''.join(pieces)!r}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    print(f"server exited with {server.returncode}")
    return server.returncode


if __name__ == "__main__":
    sys.exit(main())
