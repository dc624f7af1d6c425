"""Engine construction from resolved ServerArgs: device, tokenizer, weights, then pools sized by
`ddtree.engine.config.plan_pools` (the memory plan's function) for the weights actually loaded.
Under tensor parallelism each rank loads its shard and sizes its pools for it; the ranks' plans must
agree (every rank schedules the same batches), which `build_runner` checks."""

from __future__ import annotations

import logging
import os

import torch

from ddtree.engine.config import device_memory_bytes, plan_pools, runner_config
from ddtree.engine.model_runner import ModelRunner
from ddtree.models.configs import ConfigError
from ddtree.models.layers import torch_dtype
from ddtree.models.loader import load_drafter, load_target
from ddtree.models.quant import quantize_model
from ddtree.models.sources import source_for, weight_problems
from ddtree.models.weight_bytes import rank_weight_bytes, served_fp8

logger = logging.getLogger("ddtree")


def resolve_device(name: str) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_tokenizer(path: str | None):
    if not path or not any(
        os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def device_bytes(device: torch.device) -> int:
    """What the static pool is a fraction of: the GPU's memory (the plan assumes nothing else uses
    it), or host RAM on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return device_memory_bytes("cpu")[0]


def module_bytes(*modules) -> int:
    """Parameter bytes of the loaded models (shared tensors counted once)."""
    seen = {id(p): p for m in modules if m is not None for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


def drafter_options(args) -> dict:
    """The drafter's constructor arguments from the server flags (resolve refused the ones its
    class does not take)."""
    tree = args.speculative_ddtree_dflash2_tree
    return {} if tree is None else {"tree": tree}


def sourced_models(args, dtype: torch.dtype, device: torch.device):
    """(target, drafter) of a model path that names a source (`ddtree.models.sources`, e.g.
    `inflate:`: built in memory on the device in the serving dtype, no files); (None, None) for a
    directory."""
    source = source_for(args.model_path)
    if source is None:
        return None, None
    # --tp-size > 1 with a sourced path is refused by resolve_server_args, before any rank starts
    logger.info("Building the pair %s on %s in %s.", args.model_path, device, dtype)
    target, drafter = source.build_pair(args.model_path, args.is_speculative, dtype, device)
    for model, layout in ((target, args.target_fp8), (drafter, args.drafter_fp8)):
        if model is not None and layout is not None:  # --quantization fp8: quantized in memory
            quantize_model(model, layout)
            logger.info(
                "Quantized %s in memory to block FP8 %s.", type(model).__name__, layout.block
            )
    return target, drafter


def _same_plan_on_every_rank(cfg, tp) -> None:
    plans = [None] * tp.group.size
    # on the model group: it times out (DDTREE_TP_TIMEOUT_S) where a rank never gets here
    torch.distributed.all_gather_object(plans, cfg, group=tp.group.group)
    bad = [r for r, c in enumerate(plans) if c != plans[0]]
    if bad:
        raise ConfigError(
            f"tensor-parallel ranks {bad} planned other pools than rank 0 ({plans[bad[0]]} vs "
            f"{plans[0]}): the ranks need identical devices; set --max-total-tokens"
        )


def build_runner(args, device: torch.device, tp=None) -> tuple[ModelRunner, int]:
    """Load the weights (this rank's shard under `tp`, a `TPRank`), size the pools for them, build
    the runner; returns it and the context length."""
    if args.target_config is None:
        raise ValueError(
            "build_runner needs resolved ServerArgs (resolve_server_args / prepare_server_args)"
        )
    dtype = torch_dtype(args.dtype)
    group = None if tp is None else tp.group
    if weight_problems(args):  # resolving read config.json only: the checkpoint may be missing
        raise ConfigError(weight_problems(args))
    if args.cpu_threads is not None:  # resolved: --cpu-threads, OMP_NUM_THREADS or by model size
        torch.set_num_threads(args.cpu_threads)
    # the plan for the weights the configs say will load: a plan that cannot fit is refused
    # before anything loads (the memory plan's weight bytes are the loaded ones, tested)
    planned = rank_weight_bytes(
        args.target_config, args.drafter_config, args.tp_size, args.dtype, served_fp8(args)
    )
    why = plan_pools(args, device_bytes(device), planned, device.type).refusal()
    if why is not None:
        raise ConfigError([f"the memory plan does not fit: {why}"])
    target, drafter = sourced_models(args, dtype, device)
    if target is None:
        target = load_target(args.model_path, dtype, str(device), group, args.quantization)
    if args.is_speculative and drafter is None:
        drafter = load_drafter(
            args.speculative_draft_model_path,
            dtype,
            str(device),
            group,
            args.speculative_draft_quantization,
            drafter_options(args),
        )
    elif drafter is not None and args.speculative_ddtree_dflash2_tree is not None:
        # a sourced (inflated) drafter is built by its source: the tree is set on it
        if not hasattr(drafter, "marginal_tree"):
            raise ConfigError(
                ["--speculative-ddtree-dflash2-tree: the drafter is not DFlash2; drop the flag"]
            )
        drafter.marginal_tree = args.speculative_ddtree_dflash2_tree == "marginal"
    pools = plan_pools(args, device_bytes(device), module_bytes(target, drafter), device.type)
    for w in pools.warnings:
        logger.warning("%s", w)
    why = pools.refusal()
    if why is not None:  # the loaded weights differ from the configs' count: refused all the same
        raise ConfigError([f"the memory plan does not fit: {why}"])
    cfg = runner_config(args, pools, device.type)
    if tp is not None:
        _same_plan_on_every_rank(cfg, tp)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        need = pools.kv_pool_bytes + pools.state_pool_bytes + pools.graph_bytes
        if need > free:  # the plan assumes the device holds only this engine
            logger.warning(
                "the KV and state pools and the CUDA graphs (%.1f GiB) exceed the free device "
                "memory (%.1f GiB): "
                "another process holds memory; lower --mem-fraction-static",
                need / 2**30,
                free / 2**30,
            )
    logger.info(
        "KV cache: %d pages x %d tokens (%.1f MiB, held by %s), %d max running requests, "
        "context %d",
        cfg.num_pages,
        cfg.page_size,
        pools.kv_pool_bytes / 2**20,
        pools.kv_limit,
        cfg.max_running_requests,
        cfg.max_context,
    )
    if pools.state_rows is not None and cfg.prefix_cache:
        # a hybrid prefix hit restores one of these; with none every prompt is recomputed
        log = logger.info if cfg.state_checkpoints else logger.warning
        log(
            "Prefix cache: %d recurrent-state checkpoint rows (%.1f MiB)%s",
            cfg.state_checkpoints,
            pools.checkpoint_bytes / 2**20,
            "" if cfg.state_checkpoints else ": no hybrid prompt can hit the cache",
        )
    return ModelRunner(target, drafter, cfg, device, dtype), cfg.max_context
