"""The house's layering and the decode round's size, read from the source (see docs/design.md)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "xpuspec"
PLUGINS = ("xpuspec_openvino", "xpuspec_torch", "xpuspec_ipex")
#: modules above the speculation layer: speculative/ must never import them
ABOVE_SPECULATIVE = ("decode", "engine", "modeling", "loading", "serve", "bench", "cli", "__main__")


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


def test_the_engine_step_is_flat_named_phases_and_small():
    """One decode path: the engine's step calls its phases in order, each a method of its own; decode.py keeps only
    per-row functions (no loop of its own)."""
    step = _function(PACKAGE / "engine.py", "step")
    assert step.end_lineno - step.lineno + 1 <= 40
    calls = [n for n in ast.walk(step) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    called = [n.func.attr for n in sorted(calls, key=lambda n: (n.lineno, n.col_offset))]
    phases = ["_admit", "_prefill", "_propose", "_parts", "_verify", "_accept"]
    assert [c for c in called if c in phases] == phases
    decode = ast.parse((PACKAGE / "decode.py").read_text())
    assert not any(isinstance(n, (ast.While, ast.For)) and any(isinstance(c, ast.Call) and getattr(c.func, "attr", "")
                   == "forward" for c in ast.walk(n)) for n in ast.walk(decode))
    assert len((PACKAGE / "decode.py").read_text().splitlines()) <= 300


def test_generation_stats_import_nothing_above_them():
    assert [n for n in _imports(PACKAGE / "generation.py") if n.startswith("xpuspec.")] == ["xpuspec.errors"]


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The checks above can fail: an upward relative import and a backend import are both read."""
    upward = tmp_path / "xpuspec" / "speculative" / "bad.py"
    upward.parent.mkdir(parents=True)
    upward.write_text("from ..decode import decode\nfrom . import policy\nimport xpuspec_openvino.ir\n")
    assert list(_imports(upward, tmp_path / "xpuspec")) == ["xpuspec.decode", "xpuspec.speculative",
                                                              "xpuspec_openvino.ir"]
