"""The house's layering and the decode round's size, read from the source (see docs/design.md)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "xpuspec"
PLUGINS = ("xpuspec_openvino", "xpuspec_torch", "xpuspec_ipex")
#: modules above the speculation layer: speculative/ must never import them
ABOVE_SPECULATIVE = ("decode", "engine", "modeling", "serve", "bench", "cli", "__main__")


def _imports(path: Path, root: Path = PACKAGE):
    """Absolute module names ``path`` imports (relative imports resolved against the package at ``root``)."""
    package = list(path.relative_to(root.parent).with_suffix("").parts)[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            yield ".".join(base + ([node.module] if node.module else []))


def test_the_core_never_imports_a_backend_by_name():
    offenders = [(str(p.relative_to(PACKAGE)), name) for p in sorted(PACKAGE.rglob("*.py")) for name in _imports(p)
                 if name.split(".")[0] in PLUGINS]
    assert offenders == []


def test_no_import_runs_from_speculative_back_up_to_the_loop():
    offenders = [(str(p.relative_to(PACKAGE)), name) for p in sorted((PACKAGE / "speculative").rglob("*.py"))
                 for name in _imports(p) if name.startswith("xpuspec.") and name.split(".")[1] in ABOVE_SPECULATIVE]
    assert offenders == []


def _function(path: Path, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_round_and_the_loop_stay_small():
    for function in ("decode_round", "decode"):
        node = _function(PACKAGE / "decode.py", function)
        assert node.end_lineno - node.lineno + 1 <= 60, function
    assert len((PACKAGE / "decode.py").read_text().splitlines()) <= 300


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The checks above can fail: an upward relative import and a backend import are both read."""
    upward = tmp_path / "xpuspec" / "speculative" / "bad.py"
    upward.parent.mkdir(parents=True)
    upward.write_text("from ..decode import decode\nfrom . import policy\nimport xpuspec_openvino.ir\n")
    assert list(_imports(upward, tmp_path / "xpuspec")) == ["xpuspec.decode", "xpuspec.speculative",
                                                              "xpuspec_openvino.ir"]
