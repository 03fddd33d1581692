"""The house's layering and the decode round's size, read from the source (see docs/design.md)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "xpuspec"
PLUGINS = ("xpuspec_openvino", "xpuspec_torch", "xpuspec_ipex")
#: modules above the speculation layer: speculative/ must never import them
ABOVE_SPECULATIVE = ("decode", "engine", "modeling", "serve", "bench", "cli", "generate_cli")


def _imports(path: Path, root: Path = PACKAGE):
    """Absolute module names ``path`` imports (relative imports resolved against the package at ``root``)."""
    package = list(path.relative_to(root.parent).with_suffix("").parts)[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            yield ".".join(base + ([node.module] if node.module else []))


def _core_files():
    return sorted(PACKAGE.rglob("*.py"))


def test_the_core_never_imports_a_backend_by_name():
    offenders = [(str(p.relative_to(PACKAGE)), name) for p in _core_files() for name in _imports(p)
                 if name.split(".")[0] in PLUGINS]
    assert offenders == []


def test_no_import_runs_from_speculative_back_up_to_the_loop():
    offenders = [(str(p.relative_to(PACKAGE)), name) for p in sorted((PACKAGE / "speculative").rglob("*.py"))
                 for name in _imports(p) if name.split(".")[:2][-1] in ABOVE_SPECULATIVE and name.startswith("xpuspec.")]
    assert offenders == []


def _function(path: Path, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.parametrize("function, most", [("decode_round", 60), ("decode", 60)])
def test_the_round_and_the_loop_stay_small(function, most):
    node = _function(PACKAGE / "decode.py", function)
    assert node.end_lineno - node.lineno + 1 <= most
    assert len((PACKAGE / "decode.py").read_text().splitlines()) <= 300


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The checks above can fail: an upward relative import and a backend import are both read."""
    upward = tmp_path / "xpuspec" / "speculative" / "bad.py"
    upward.parent.mkdir(parents=True)
    upward.write_text("from ..decode import decode\nfrom . import policy\nimport xpuspec_openvino.ir\n")
    assert list(_imports(upward, tmp_path / "xpuspec")) == ["xpuspec.decode", "xpuspec.speculative",
                                                              "xpuspec_openvino.ir"]
