"""The xpuspec command: devices, generate, doctor, clear errors, and Ctrl-C."""

import os
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from conftest import MODEL, default_sigint


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "xpuspec", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


def _main(capsys, monkeypatch, *args):
    """``xpuspec ARGS`` in this process (``xpuspec.cli.main``, what ``python -m xpuspec`` runs): its exit status and
    stderr. The process-wide verbosity settings are left alone; the subprocess tests above and below cover the
    entry point itself (test_npu_absent_gives_a_clear_error: exit 2, one line, no traceback)."""
    from xpuspec import cli

    monkeypatch.setattr(cli, "_set_verbosity", lambda level, log_level: None)
    capsys.readouterr()
    try:
        status = cli.main(list(args))
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code
    return status, capsys.readouterr().err


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


def test_bad_cli_input_gives_one_line_errors(capsys, monkeypatch):
    for args, phrase in [(["generate", ""], "The prompt is empty"),
                         (["generate", "hi", "--num-assistant-tokens", "3"], "need --speculative MODE"),
                         (["generate", "hi", "--draft-vocab-size", "1024"], "need --speculative MODE"),
                         (["generate", "hi", "--draft-context-length", "16"], "need --speculative MODE"),
                         (["generate", "hi", "--speculative", "hybrid", "--draft-context-length", "-2"],
                          "draft_context_length must be an int >= 1, 0"),
                         (["generate", "hi", "--speculative", "hybrid", "--draft-vocab-size", "-3"],
                          "draft_vocab_size must be an int >= 1, 0")]:
        status, err = _main(capsys, monkeypatch, *args)
        assert status == 2 and phrase in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_bad_generation_options_are_refused_before_the_model_is_looked_up(capsys, monkeypatch):
    """A model that does not exist: each error is about the option, so none waited for a model to load."""
    for args, phrase in [(["--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
                         (["--do-sample", "--temperature", "0"], "needs temperature > 0"),
                         (["--do-sample", "--top-k", "-1"], "`top_k` has to be a strictly positive integer"),
                         (["--speculative", "layer-skip"], "did you mean 'layer_skip'?")]:
        status, err = _main(capsys, monkeypatch, "generate", "hi", "--model", "no-such-model", *args)
        assert status == 2 and phrase in err and "Traceback" not in err, err


def test_ctrl_c_while_the_cli_imports_torch_exits_130_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "xpuspec", "generate", "hi"], preexec_fn=default_sigint,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.monotonic() + 120
    while "libtorch" not in maps.read_text():  # torch's shared library is being loaded: mid-import
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err[-2000:]


def test_doctor_reports_versions_plugins_devices_and_cache(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "blob").write_bytes(b"x" * 1234)
    done = _cli("doctor", env={"XPUSPEC_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for package in ("torch", "openvino", "nncf", "optimum-intel", "transformers"):
        assert re.search(rf"^  {package} +{re.escape(version(package))}$", out, re.M), package
    assert re.search(r"^  openvino +xpuspec_openvino:OpenVINOBackend +loads$", out, re.M)
    assert re.search(r"^  torch +xpuspec_torch:TorchBackend +loads$", out, re.M)
    assert re.search(r"^  ipex +xpuspec_ipex:IPEXBackend +unavailable: intel_extension_for_pytorch does not import", out,
                     re.M)
    assert re.search(r"^  cpu +openvino +FULL_DEVICE_NAME=", out, re.M)
    assert f"cache: {tmp_path} ($XPUSPEC_CACHE): 1234 bytes (0.00 GiB)" in out
