"""The examples run, and the drop-in example prints what transformers prints."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: Path, *args) -> str:
    done = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_drop_in_prints_what_transformers_prints(smollm2_path, tmp_path):
    source = (EXAMPLES / "drop_in.py").read_text()
    import_line = "from xpuspec import AutoModelForCausalLM, AutoTokenizer"
    assert source.count(import_line) == 1
    plain = tmp_path / "plain_transformers.py"
    plain.write_text(source.replace(import_line, "from transformers import AutoModelForCausalLM, AutoTokenizer"))
    ours = _run(EXAMPLES / "drop_in.py", smollm2_path)
    theirs = _run(plain, smollm2_path)
    assert ours == theirs
    assert ours.startswith("def fibonacci(n):") and "return" in ours
