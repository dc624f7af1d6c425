"""Layers point one way. Every module of the package sits on a floor and imports only from its own
floor or below; every import in every module is checked, function-level (lazy) imports included,
and every module must have a floor (a new package is placed here on purpose, not by accident).

    0  envs, assets, speculative (pure tree math), grammar (grammar specs, matchers and the draft
       tree under a grammar: host math beside speculative)
    1  kernels            2  attention
    3  models (with their configs from config.json, parameter counts, shapes and model sources)
    4  engine
    5  config: the configuration above the engine (server arguments, their resolution, the memory
       plan, check-config)
    6  server, llm, generate
    7  bench (the user-facing benchmarks), cli, launch_server, the package root
    8  tools: inflate, train, studies. Nothing below imports them: the serving graph reaches a
       tool only through `models.sources`' lazy registry, when a model path names its scheme.
"""

import ast
import pathlib
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "ddtree"

FLOORS = {
    "envs": 0,
    "assets": 0,
    "speculative": 0,
    "grammar": 0,
    "kernels": 1,
    "attention": 2,
    "models": 3,
    "engine": 4,
    "config": 5,
    "server": 6,
    "llm": 6,
    "generate": 6,
    "bench": 7,
    "cli": 7,
    "launch_server": 7,
    "__main__": 7,
    "__init__": 7,
    "tools": 8,
}


def unit(parts: list[str]) -> str:
    """The floor unit of a module path relative to the package (`engine/x.py` -> engine) or of an
    imported name's parts after `ddtree` (`tools.train.data` -> tools; a name the package root
    exports, e.g. `LLM`, -> __init__)."""
    head = parts[0].removesuffix(".py") if parts else "__init__"
    return head if head in FLOORS else "__init__"


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


def module_units() -> dict[pathlib.Path, str | None]:
    """Every module of the package and its unit (None: a module no floor names)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG).parts
        head = parts[0].removesuffix(".py")
        out[path] = head if head in FLOORS else None
    return out


def violations() -> list[str]:
    bad = []
    for path, own in module_units().items():
        if own is None:
            continue
        for line, module in ddtree_imports(path):
            if module == "ddtree":  # `from ddtree import x`: judged by its `ddtree.x` entry
                continue
            other = unit(module.split(".")[1:])
            if FLOORS[other] > FLOORS[own]:
                rel = path.relative_to(PKG).as_posix()
                bad.append(f"{rel}:{line} imports {module} (floor {FLOORS[other]} > {FLOORS[own]})")
    return bad


def test_every_module_has_a_floor():
    assert [p for p, u in module_units().items() if u is None] == []


def test_layers_point_one_way():
    assert violations() == []


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
    for sub in ("speculative", "engine", "weird"):
        (tmp_path / sub).mkdir()
    (tmp_path / "speculative" / "bad.py").write_text(
        "def f():\n    from ddtree.engine.scheduling.request import Req\n"
    )
    (tmp_path / "engine" / "bad.py").write_text("import ddtree.tools.train.data\n")
    (tmp_path / "weird" / "x.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path)
    assert violations() == [
        "engine/bad.py:1 imports ddtree.tools.train.data (floor 8 > 4)",
        "speculative/bad.py:2 imports ddtree.engine.scheduling.request (floor 4 > 0)",
    ]
    assert [p.name for p, u in module_units().items() if u is None] == ["x.py"]


def test_attention_registry_is_lazy():
    """The seam imports no backend at module level (a backend, and Triton with it, loads only when
    its name is asked for); the backends import the shared types from `metadata`, never the seam
    (no cycle)."""
    tree = ast.parse((PKG / "attention" / "backend.py").read_text())
    top = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert [m for m in top if m and m.startswith("ddtree.")] == ["ddtree.attention.metadata"]
    for backend in ("torch_ref.py", "triton_backend.py"):
        used = {m for _, m in ddtree_imports(PKG / "attention" / backend)}
        assert "ddtree.attention.backend" not in used, backend
    from ddtree.attention.backend import BACKENDS, get_backend

    assert get_backend("torch").name == "torch" and set(BACKENDS) == {"torch", "triton"}
    with pytest.raises(ValueError, match="--attention-backend 'flex'"):
        get_backend("flex")
