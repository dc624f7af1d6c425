"""Layers point one way: kernels <- attention <- models <- engine <- server, and `speculative/` is
pure tree math. Every import in every module is checked, function-level (lazy) imports included."""

import ast
import pathlib
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "ddtree"

# package -> ddtree subpackages its modules must not import
FORBIDDEN = {
    "speculative": {"engine", "models", "server", "attention", "kernels", "bench", "train"},
    "kernels": {"attention", "models", "engine", "server", "bench", "train"},
    "attention": {"models", "engine", "server", "bench", "train"},
    "models": {"engine", "server", "bench"},
    "engine": {"server", "bench", "train"},
}


def ddtree_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute `ddtree.*` import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [
                (node.lineno, f"{node.module}.{a.name}")
                for a in node.names
                if node.module == "ddtree"
            ]
    return [(line, m) for line, m in out if m == "ddtree" or m.startswith("ddtree.")]


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((PKG / package).rglob("*.py")):
        for line, module in ddtree_imports(path):
            parts = module.split(".")
            if len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(PKG).as_posix()}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_point_one_way(package):
    assert violations(package) == []


def test_no_relative_imports():
    """Relative imports would slip past the check above."""
    rel = [
        f"{p.relative_to(PKG.parent)}:{n.lineno}"
        for p in PKG.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ImportFrom) and n.level
    ]
    assert rel == []


def test_the_check_can_fail(tmp_path, monkeypatch):
    (tmp_path / "speculative").mkdir()
    (tmp_path / "speculative" / "bad.py").write_text(
        "def f():\n    from ddtree.engine.request import Req\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path)
    assert violations("speculative") == ["speculative/bad.py:2 imports ddtree.engine.request"]


def test_attention_registry_is_lazy():
    """The seam imports no backend at module level (no cycle with the backends, which import its
    types)."""
    tree = ast.parse((PKG / "attention" / "backend.py").read_text())
    top = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert not [m for m in top if m and m.startswith("ddtree.")]
    from ddtree.attention.backend import BACKENDS, get_backend

    assert get_backend("torch").name == "torch" and set(BACKENDS) == {"torch", "triton"}
    with pytest.raises(ValueError, match="--attention-backend 'flex'"):
        get_backend("flex")
