"""Model paths that name a source other than a directory: `SCHEME:spec` (`inflate:qwen3-8b`).

A source answers what resolution and loading ask of a model path, before and after any weight
exists: its configs (torch-free, so `check-config` plans it), the drafter path it implies, its
tokenizer's directory, and the built (target, drafter). Sources register lazily by module name
(mini-sglang's registry of lazy factories): the serving code imports a tool's module only when a
path names its scheme, so the tools stay out of its import graph.
"""

from __future__ import annotations

import importlib
import os
from typing import Protocol

# scheme -> module whose `SOURCE` implements ModelSource
_MODULES: dict[str, str] = {"inflate": "ddtree.tools.inflate.source"}


class ModelSource(Protocol):
    def resolve_config(self, path: str, is_target: bool, problems: list[str]):
        """(path, TargetConfig / DrafterConfig or None); problems appended to `problems`."""

    def drafter_path_for(
        self, target: str | None, drafter: str | None, speculative: bool, problems: list[str]
    ) -> str | None:
        """The drafter path to resolve when the target or drafter path names this source."""

    def tokenizer_dir(self, path: str) -> str | None: ...

    def build_pair(self, path: str, speculative: bool, dtype, device):
        """(target, drafter or None) built on `device` in `dtype`."""


def register(scheme: str, module: str) -> None:
    _MODULES[scheme] = module


def scheme_of(path: str | None) -> str | None:
    if not isinstance(path, str) or ":" not in path:
        return None
    scheme = path.split(":", 1)[0]
    return scheme if scheme in _MODULES else None


def source_for(path: str | None) -> ModelSource | None:
    scheme = scheme_of(path)
    return None if scheme is None else importlib.import_module(_MODULES[scheme]).SOURCE


def has_weights(path: str) -> bool:
    """What the loader reads is there: `model.safetensors.index.json` or a `*.safetensors` file."""
    try:
        files = os.listdir(path)
    except OSError:
        return False
    return "model.safetensors.index.json" in files or any(f.endswith(".safetensors") for f in files)


def weight_problems(args) -> list[str]:
    """One line per model directory of resolved args that has config.json but no weights (an
    inflate: pair is built in memory and has none to check)."""
    p = []
    dirs = [("--model-path", args.model_path)]
    if args.is_speculative:
        dirs.append(("--speculative-draft-model-path", args.speculative_draft_model_path))
    for name, path in dirs:
        if path and source_for(path) is None and not has_weights(path):
            p.append(
                f"{name} {path}: no *.safetensors weights, only config.json (enough for "
                "check-config and prepare_server_args, not to serve); pass the directory holding "
                "the full checkpoint (e.g. hf download REPO --local-dir DIR)"
            )
    return p
