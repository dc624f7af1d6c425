"""The Python standard library as a corpus: the embedded pair's training text and, held out from
it, the modules whose text the benches prompt with (prompts the project never trained on)."""

from __future__ import annotations

import os
import sysconfig


def stdlib_files(
    holdout: tuple[str, ...] = ("json", "argparse", "textwrap", "statistics"),
    root: str | None = None,
) -> tuple[list[str], list[str]]:
    """(train, held-out) .py files of the Python standard library, sorted; tests, site-packages and idlelib
    are skipped. `holdout` names top-level modules or packages kept for evaluation."""
    root = root or sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}
    train, held = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            top = os.path.relpath(path, root).split(os.sep)[0].removesuffix(".py")
            (held if top in holdout else train).append(path)
    return train, held


def read_texts(files: list[str]) -> list[str]:
    texts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts
