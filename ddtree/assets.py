"""The embedded default model pair (`ddtree/assets/default_pair`, trained by
`scripts/train_reference_pair.sh`), used when no `--model-path` is given."""

from __future__ import annotations

import os

PACKAGE_PAIR = os.path.join(os.path.dirname(__file__), "assets", "default_pair")


def default_model_paths() -> tuple[str, str]:
    """(target_dir, drafter_dir) of the embedded default pair."""
    paths = tuple(os.path.join(PACKAGE_PAIR, sub) for sub in ("target", "drafter"))
    missing = [p for p in paths if not os.path.exists(os.path.join(p, "config.json"))]
    if missing:
        raise FileNotFoundError(
            f"{missing[0]}/config.json is missing: the installed package lacks its embedded pair "
            "(reinstall it, or pass --model-path)"
        )
    return paths
