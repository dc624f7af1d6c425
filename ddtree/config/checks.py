"""Checks of model directories and of a target/drafter pair, from config.json alone. Each problem is appended
to a list as one line that names the flag and the fix; `resolve_server_args` raises them together.

Parsing and planning read config.json only, so a directory holding just the configs (before a 55 GB
download) validates and plans; whether the weights are there is `models.sources.weight_problems`,
asked where they are about to load (`serve`'s start, the engine)."""

from __future__ import annotations

import logging
import os

from ddtree.models import checkpoint as ckpt
from ddtree.models import configs
from ddtree.models.configs import ConfigError, DrafterConfig, TargetConfig
from ddtree.models.sources import source_for
from ddtree.models.tp_layout import fp8_cuts, tp_problems

FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell

logger = logging.getLogger("ddtree")


def hf_cache_dir(path: str) -> str | None:
    if os.path.exists(path) or path.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        hit = try_to_load_from_cache(path, "config.json")
    except ValueError:  # not a valid repo id (e.g. "/models"): a local path that does not exist
        return None
    return os.path.dirname(hit) if isinstance(hit, str) else None


def load_model_config(path: str, is_target: bool, p: list[str]):
    """(resolved dir, parsed config or None); every problem found is appended to p."""
    source = source_for(path)
    if source is not None:  # e.g. inflate: built in memory by the engine, configs from its plan
        return source.resolve_config(path, is_target, p)
    name = "--model-path" if is_target else "--speculative-draft-model-path"
    cached = hf_cache_dir(path)
    if cached:
        logger.info("%s %s resolved to the local Hugging Face cache: %s", name, path, cached)
        path = cached
    if not os.path.isfile(os.path.join(path, "config.json")):
        what = "has no config.json" if os.path.isdir(path) else "directory does not exist"
        p.append(
            f"{name} {path}: {what}; pass the local model directory that holds config.json (or a Hugging "
            "Face repo id already in the local cache)"
        )
        return path, None
    supported = configs.DENSE_ARCHITECTURES + configs.HYBRID_ARCHITECTURES
    try:
        raw = configs.read_config_json(path)
        arch = (raw.get("architectures") or ["<none>"])[0]
        if is_target and arch in configs.DRAFTER_ARCHITECTURES:
            p.append(
                f"--model-path {path}: this is a {arch} drafter; pass it as --speculative-draft-model-path "
                "and the target model as --model-path"
            )
        elif is_target and arch not in supported:
            p.append(
                f"--model-path {path}: architecture {arch!r} is not supported; supported: {', '.join(supported)}"
            )
        elif not is_target and arch not in configs.DRAFTER_ARCHITECTURES:
            p.append(
                f"--speculative-draft-model-path {path}: architecture {arch!r} is not a DFlash drafter "
                f"({' or '.join(configs.DRAFTER_ARCHITECTURES)}); pass one (e.g. "
                "z-lab/Qwen3-8B-DFlash-b16)"
            )
        elif is_target:
            return path, TargetConfig.from_dict(raw)
        else:
            d = DrafterConfig.from_dict(raw)
            bad = d.problems()
            p.extend(
                f"{name} {path}: {line}; fix config.json or pass another drafter" for line in bad
            )
            return path, None if bad else d
    except ConfigError as e:  # a quantization_config it cannot serve exactly
        p.extend(f"{name} {path}: {line}" for line in e.problems)
    except (OSError, KeyError, TypeError, ValueError) as e:
        p.append(
            f"{name} {path}: config.json is unreadable or lacks key {e}; fix or re-download the config"
        )
    return path, None


def check_pair(t: TargetConfig, d: DrafterConfig, p: list[str]) -> None:
    F = "--speculative-draft-model-path"
    if d.hidden_size != t.hidden_size:
        p.append(
            f"{F}: drafter hidden_size {d.hidden_size} != target hidden_size {t.hidden_size}; use the DFlash "
            "drafter trained for this --model-path"
        )
    if d.vocab_size != t.vocab_size:
        p.append(
            f"{F}: drafter vocab_size {d.vocab_size} != target vocab_size {t.vocab_size}; use the DFlash "
            "drafter trained for this --model-path"
        )
    if d.mask_token_id is None:
        p.append(
            f"{F}: drafter config has no dflash_config.mask_token_id; add the mask token id the drafter was "
            f"trained with (a row of the target embedding, < {t.vocab_size})"
        )
    elif not 0 <= d.mask_token_id < t.vocab_size:
        p.append(
            f"{F}: mask_token_id {d.mask_token_id} is not a row of the target embedding (vocab "
            f"{t.vocab_size}); use the drafter trained for this target"
        )
    n = t.num_hidden_layers
    bad = [i for i in d.target_layer_ids if not 0 <= i < n]
    if not d.target_layer_ids:
        p.append(
            f"{F}: drafter config has neither dflash_config.target_layer_ids nor num_target_layers; add "
            "target_layer_ids"
        )
    elif bad:
        p.append(
            f"{F}: target_layer_ids {bad} out of range for the target's {n} layers (valid 0..{n - 1}); use "
            "the drafter trained for this --model-path"
        )
    if d.num_target_layers and d.num_target_layers != n:
        p.append(
            f"{F}: drafter was built for a {d.num_target_layers}-layer target but --model-path has {n} layers;"
            " use the drafter trained for this target"
        )


def check_tp(tp: int, t: TargetConfig | None, d: DrafterConfig | None, p: list[str]) -> None:
    """The split the engine really makes (`ddtree.models.tp_layout`): heads and widths divide by tp,
    KV-style heads divide or are replicated (a divisor of tp)."""
    p.extend(tp_problems(tp, t, d))


def check_quantization(
    a, t: TargetConfig | None, d: DrafterConfig | None, paths, device: str, capability, p: list[str]
):
    """(target, drafter) FP8 layouts (`checkpoint.Fp8Layout`, None: the model dtype) for
    --quantization / --speculative-draft-quantization and what each checkpoint stores (its
    safetensors headers: no weight loads), with every problem appended to p: a checkpoint whose
    scales would be read wrongly, FP8 on a GPU without FP8 tensor cores, a --tp-size whose slices
    cut weight blocks."""
    layouts = []
    for cfg, path, request, flag, linears, shapes in (
        (
            t,
            paths[0],
            a.quantization,
            "--model-path",
            ckpt.TARGET_LINEARS,
            ckpt.target_linear_shapes,
        ),
        (
            d,
            paths[1],
            a.speculative_draft_quantization,
            "--speculative-draft-model-path",
            ckpt.DRAFTER_LINEARS,
            ckpt.drafter_linear_shapes,
        ),
    ):
        layout = None
        if cfg is not None and source_for(path) is not None:  # built in memory (inflate:)
            if request == "fp8":
                layout = ckpt.at_load_layout(shapes(cfg), linears, None)
        elif cfg is not None:
            rename = (
                ckpt.target_rename(cfg.weight_prefix)
                if isinstance(cfg, TargetConfig)
                else ckpt.drafter_rename
            )
            q: list[str] = []
            layout = ckpt.fp8_layout(path, cfg.quantization, rename, linears, request, q)
            p.extend(f"{flag} {path}: {line}" for line in q)
            if request == "unquant" and layout is not None:
                logger.info("%s %s: FP8 weights are dequantized to --dtype at load.", flag, path)
        if layout is not None and a.tp_size > 1:
            cuts = fp8_cuts(cfg, a.tp_size, layout.shapes, layout.block)
            if cuts:
                p.append(
                    f"--tp-size {a.tp_size} cuts the FP8 weight blocks {list(layout.block)} of "
                    f"{flag}'s {', '.join(cuts)}; pass a --tp-size whose slices are whole blocks "
                    "(or serve the model dtype)"
                )
        layouts.append(layout)
    fp8 = layouts[0] is not None or (
        layouts[1] is not None and a.speculative_draft_quantization != "unquant"
    )
    if fp8 and device == "cpu":
        logger.warning(
            "FP8 on the CPU runs the PyTorch reference (weights dequantized at every call): "
            "slower than --dtype; FP8 is for GPUs with FP8 tensor cores"
        )
    if fp8 and device == "cuda" and capability is None:
        capability = local_capability()
    if fp8 and device == "cuda" and capability is not None and capability < FP8_MIN_CAPABILITY:
        p.append(
            f"FP8 weights (--quantization fp8 / --speculative-draft-quantization fp8 / a block-FP8 "
            f"checkpoint) need FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell);"
            f" this GPU is sm_{capability[0]}{capability[1]}: serve the bf16 checkpoint (drop "
            "--quantization; --speculative-draft-quantization unquant for an FP8 drafter)"
        )
    return layouts[0], layouts[1]


def local_capability() -> tuple[int, int] | None:
    """The local GPU's compute capability (None without a usable one: a plan for another machine)."""
    from ddtree.engine.config import cuda_available

    if not cuda_available():
        return None
    import torch

    try:
        return tuple(torch.cuda.get_device_capability())
    except (RuntimeError, AssertionError):
        return None
