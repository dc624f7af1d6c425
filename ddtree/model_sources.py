"""Model paths that name a source other than a directory: `SCHEME:spec` (`inflate:qwen3-8b`).

A source answers what resolution and loading ask of a model path, before and after any weight
exists: its configs (torch-free, so `check-config` plans it), the drafter path it implies, its
tokenizer's directory, and the built (target, drafter). Sources register lazily by module name
(mini-sglang's registry of lazy factories): the serving code imports a tool's module only when a
path names its scheme, so the tools stay out of its import graph.
"""

from __future__ import annotations

import importlib
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
