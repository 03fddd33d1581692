"""The xpuspec command: devices, generate, and clear errors."""

import os
import subprocess
import sys

from conftest import MODEL


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "xpuspec", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


def test_devices_lists_cpu_for_both_backends():
    done = _cli("devices")
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert any(l.split()[:2] == ["cpu", "openvino"] for l in lines)
    assert any(l.split()[:2] == ["cpu", "torch"] for l in lines)
    assert any("ipex" in l and "unavailable" in l for l in lines)


def test_generate_streams_and_reports_speed(smollm2_path):
    done = _cli("generate", "--model", MODEL, "--low-bit", "int8_asym", "--max-new-tokens", "16", "def add(a, b):")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "def add(a, b):" in done.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("[prompt tokens") and "new tokens 16" in last and "tokens/s" in last and "TTFT" in last


def test_npu_absent_gives_a_clear_error(smollm2_path):
    done = _cli("generate", "--model", MODEL, "hello", env={"XPUSPEC_DEVICE": "npu"})
    assert done.returncode == 2
    assert "error: Device 'npu' is not available on this machine. Available: cpu (openvino)" in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_cli_input_gives_one_line_errors():
    for args, phrase in [(["generate", ""], "The prompt is empty"),
                         (["generate", "hi", "--num-assistant-tokens", "3"], "need --speculative MODE")]:
        done = _cli(*args)
        assert done.returncode == 2 and phrase in done.stderr and "Traceback" not in done.stderr
