"""What a plain `pip install -e .` resolves: Triton comes in through xgrammar, and unpinned it is a
release whose bindings print leak reports at every server exit and whose interpreter fails the
kernel tests; the base dependencies pin the range the tests run with."""

import pathlib
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]


def base_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return {r.name: r for r in reqs}


def test_triton_is_pinned_in_the_base_dependencies():
    triton = base_requirements()["triton"]
    assert Version("3.7.1") in triton.specifier and Version("3.6.0") in triton.specifier
    assert Version("3.9.0") not in triton.specifier and Version("3.8.0") not in triton.specifier


def test_installed_triton_is_in_the_pinned_range():
    try:
        installed = metadata.version("triton")
    except metadata.PackageNotFoundError:  # not a Linux x86-64 machine: the marker leaves it out
        return
    assert Version(installed) in base_requirements()["triton"].specifier
