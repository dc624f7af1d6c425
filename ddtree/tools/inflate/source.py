"""`--model-path inflate:<shape>[:<src_target>:<src_drafter>]`: an inflated pair served from memory.

The 27B hybrid pair is ~55 GB in bf16, too large for the H200 machine's 64 GiB disk once written, so
the engine builds it where it runs (`inflate_pair` on the GPU, directly in the serving dtype) and
nothing is written. Resolution is the same as for a model directory and happens before any weight
exists: the target / drafter configs are `plan_pair`'s, from the source pair's config.json files
and the shape (this module is torch-free, so `ddtree check-config` plans it), and the tokenizer is
the source target's. `<shape>` is qwen3-8b, qwen3.6-27b or a config.json file (no ':' in it);
without sources the embedded pair is inflated. The drafter is the pair's own: the spec serves as
`--speculative-draft-model-path` too (omit the flag or repeat the spec).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ddtree.models.configs import DrafterConfig, TargetConfig

PREFIX = "inflate:"
SYNTAX = "inflate:<shape>[:<src_target>:<src_drafter>]"


def is_inflate_path(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


@dataclass(frozen=True)
class InflateSource:
    shape: str
    src_target: str
    src_drafter: str


def parse_source(path: str) -> InflateSource:
    """Raises ValueError with the syntax when the spec is malformed."""
    parts = path[len(PREFIX) :].split(":")
    if len(parts) == 1 and parts[0]:
        from ddtree.assets import default_model_paths

        return InflateSource(parts[0], *default_model_paths())
    if len(parts) == 3 and all(parts):
        return InflateSource(*parts)
    raise ValueError(f"{path!r} is not {SYNTAX}")


@functools.lru_cache(maxsize=8)
def pair_configs(path: str) -> tuple[TargetConfig, DrafterConfig]:
    """The widened pair's configs (as the engine will build it); raises ValueError (InflateError,
    a bad spec) or OSError (an unreadable source)."""
    from ddtree.tools.inflate.plan import plan_pair

    src = parse_source(path)
    plan = plan_pair(
        TargetConfig.from_path(src.src_target), DrafterConfig.from_path(src.src_drafter), src.shape
    )
    return (
        TargetConfig.from_dict(plan.target_config),
        DrafterConfig.from_dict(plan.drafter_config),
    )


def resolve_config(path: str, is_target: bool, p: list[str]):
    """`load_model_config` for an inflate: path: (path, config or None), problems appended to p."""
    name = "--model-path" if is_target else "--speculative-draft-model-path"
    try:
        t, d = pair_configs(path)
    except (OSError, KeyError, ValueError) as e:
        p.append(
            f"{name} {path}: {e}; pass {SYNTAX} with a named shape (qwen3-8b, qwen3.6-27b) or a "
            f"config.json file, and source model directories that hold config.json"
        )
        return path, None
    return path, t if is_target else d


def drafter_path_for(target: str | None, drafter: str | None, speculative: bool, p: list[str]):
    """The drafter path to resolve: an inflate: target brings its own drafter (the same spec)."""
    if not (is_inflate_path(target) or is_inflate_path(drafter)) or not speculative:
        return drafter
    if drafter is None or drafter == target:
        return target
    p.append(
        f"--speculative-draft-model-path {drafter}: an inflated pair is served with its own "
        f"drafter; drop the flag or pass the same spec as --model-path ({target})"
    )
    return drafter


def tokenizer_dir(model_path: str | None) -> str | None:
    """The directory whose tokenizer serves `model_path`: an inflate: pair's source target's."""
    if not is_inflate_path(model_path):
        return model_path
    try:
        return parse_source(model_path).src_target
    except ValueError:
        return None


def build_pair(path: str, speculative: bool, dtype, device):
    """(target, drafter or None) built in memory on `device` (torch from here on)."""
    from ddtree.models.configs import ConfigError
    from ddtree.models.shapes import InflateError
    from ddtree.tools.inflate.pair import inflate_pair

    src = parse_source(path)
    try:
        pair = inflate_pair(src.src_target, src.src_drafter, src.shape, device, dtype)
    except InflateError as e:
        raise ConfigError([f"--model-path {path}: {e}"]) from e
    return pair.target, pair.drafter if speculative else None


class InflatePaths:
    """`ddtree.models.sources.ModelSource` for `inflate:` paths."""

    resolve_config = staticmethod(resolve_config)
    drafter_path_for = staticmethod(drafter_path_for)
    tokenizer_dir = staticmethod(tokenizer_dir)
    build_pair = staticmethod(build_pair)


SOURCE = InflatePaths()
