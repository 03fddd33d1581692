"""The examples run on SmolLM2: the drop-in one prints what transformers prints, the speculative one the plain
greedy text, the export one the same text from openvino_genai and xpuspec, and the server client the plain greedy
text through a real ``xpuspec serve``."""

import importlib.util
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


def _load_example(name: str):
    """The example module (its ``main`` does not run on import)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_speculative_example_prints_the_plain_greedy_text(ov_int8, tokenizer):
    example = _load_example("speculative")
    out = _run(EXAMPLES / "speculative.py", "--mode", "prompt_lookup", "--max-new-tokens", 24)
    inputs = tokenizer(example.PROMPT, return_tensors="pt")
    plain = ov_int8.generate(**inputs, max_new_tokens=24, do_sample=False)  # this process, no speculation
    text = tokenizer.decode(plain[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    assert f"speculative: {text!r}\n" in out and f"plain:       {text!r}\n" in out
    assert "identical to plain greedy: True" in out and "drafted" in out


def test_export_and_genai_example_gives_one_text(smollm2_path, tmp_path):
    out = _run(EXAMPLES / "export_and_genai.py", "--output", tmp_path / "smollm2-int8", "--max-new-tokens", 16)
    assert (tmp_path / "smollm2-int8" / "openvino_model.xml").is_file()
    genai = next(line for line in out.splitlines() if line.startswith("openvino_genai:"))
    assert "identical: True" in out and len(genai) > len("openvino_genai: ''")


def test_serve_client_gets_the_plain_greedy_text_and_the_server_exits_0(ov_int8, tokenizer):
    import pytest

    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    example = _load_example("serve_client")
    out = _run(EXAMPLES / "serve_client.py", "--max-tokens", 12)
    inputs = tokenizer(example.PROMPT, return_tensors="pt")
    plain = ov_int8.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(plain[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    assert f"completion: {text!r}\n" in out
    chat = next(line for line in out.splitlines() if line.startswith("chat, streamed: "))
    assert len(chat) > len("chat, streamed: ''") and "'num_draft_tokens'" in out
    assert out.endswith("server exited with 0\n")


def test_batch_example_rows_equal_each_prompt_alone(smollm2_path):
    out = _run(EXAMPLES / "batch.py", "--max-new-tokens", 12)
    assert "every row identical to its prompt alone: True" in out and out.count(" -> ") == 3
