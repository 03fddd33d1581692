"""How long a GGUF conversion that fails takes the first time and the second time (issue 41).

Damages a copy of the built-in SmolLM2 GGUF (0xFF over the first 4 MB of tensor data: the first tensors' fp16 block
scales become NaN, so the converted model's logits are NaN and the gate refuses it), then runs ``xpuspec pull`` on it
twice in fresh processes against an empty cache, and prints each attempt's wall time, exit code and last line.

    python benchmarks/gguf_failure_memory.py
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    from gguf import GGUFReader

    from xpuspec import sources

    source = sources._fetch_gguf(sources.BUILTIN_MODELS["smollm2-135m-instruct"])
    with tempfile.TemporaryDirectory() as tmp:
        damaged = Path(tmp) / "damaged.gguf"
        shutil.copyfile(source, damaged)
        start = GGUFReader(str(source)).data_offset
        with open(damaged, "r+b") as f:
            f.seek(start)
            f.write(b"\xff" * 4_000_000)
        env = dict(os.environ, XPUSPEC_CACHE=str(Path(tmp) / "cache"))
        print(f"load average before: {Path('/proc/loadavg').read_text().strip()}")
        for attempt in ("first", "second"):
            began = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "xpuspec", "pull", str(damaged)], env=env,
                                  capture_output=True, text=True)
            wall = time.perf_counter() - began
            last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
            print(f"{attempt} attempt: {wall:.2f} s wall, exit {done.returncode}: {last[:300]}")
        began = time.perf_counter()
        try:
            env_cache = os.environ.get("XPUSPEC_CACHE")
            os.environ["XPUSPEC_CACHE"] = env["XPUSPEC_CACHE"]
            sources.pull_gguf(damaged)
        except sources.PullError:
            print(f"second attempt in-process (pull_gguf; the unchanged file is matched by path, size and mtime, not hashed): {time.perf_counter() - began:.3f} s")
        finally:
            if env_cache is None:
                os.environ.pop("XPUSPEC_CACHE", None)
            else:
                os.environ["XPUSPEC_CACHE"] = env_cache
        print(f"load average after: {Path('/proc/loadavg').read_text().strip()}")
        print("lock files left:", sorted(p.name for p in (Path(tmp) / "cache" / "models").glob("*.lock")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
