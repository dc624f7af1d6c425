"""The embedded default model pair, used when no `--model-path` is given.

Preference order: the trained reference pair shipped in the package (`ddtree/assets/default_pair`), else
the toy pair that `ddtree.train.toy` trains in seconds on the CPU and caches (`$DDTREE_CACHE` or
`~/.cache/ddtree`)."""

from __future__ import annotations

import os

from ddtree import envs

PACKAGE_PAIR = os.path.join(os.path.dirname(__file__), "assets", "default_pair")


def cache_dir() -> str:
    return envs.CACHE.get() or os.path.join(os.path.expanduser("~"), ".cache", "ddtree")


def _complete(path: str) -> bool:
    return all(
        os.path.exists(os.path.join(path, sub, "config.json")) for sub in ("target", "drafter")
    )


def default_model_paths() -> tuple[str, str]:
    """(target_dir, drafter_dir) of the embedded default pair; trains the toy pair on first use if the
    package ships no reference pair."""
    if _complete(PACKAGE_PAIR):
        return os.path.join(PACKAGE_PAIR, "target"), os.path.join(PACKAGE_PAIR, "drafter")
    from ddtree.train.toy import build_toy_pair

    return build_toy_pair(os.path.join(cache_dir(), "toy_pair"))
