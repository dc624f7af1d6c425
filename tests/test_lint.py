"""The code meets the project's lint standard (`[tool.ruff]` in pyproject.toml): `ruff check` (pycodestyle,
pyflakes, import order; comments and strings to 120 columns) and `ruff format --check` (code wrapped at 100).
Run `ruff format . && ruff check --fix .` to comply."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff")
    cmd = [exe] if exe else [sys.executable, "-m", "ruff"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")])
def test_ruff(args):
    res = ruff(*args)
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_can_fail(tmp_path):
    """Control: the same invocation rejects a line over the limit and unformatted code."""
    bad = tmp_path / "bad.py"
    bad.write_text("x = [1,2]\ny = '" + "a" * 130 + "'\n")
    config = ["--config", str(ROOT / "pyproject.toml")]
    assert ruff("check", *config, str(bad)).returncode != 0
    assert ruff("format", "--check", *config, str(bad)).returncode != 0
