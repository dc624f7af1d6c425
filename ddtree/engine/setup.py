"""Engine construction from resolved ServerArgs: device, tokenizer, weights, pools sized to memory."""

from __future__ import annotations

import logging
import os

import torch

from ddtree.engine.model_runner import ModelRunner, RunnerConfig
from ddtree.models.layers import torch_dtype
from ddtree.models.loader import load_drafter, load_target

logger = logging.getLogger("ddtree")

CPU_KV_BUDGET_BYTES = 2 << 30  # the CPU path is for tests and small models: cap its KV pool


def resolve_device(name: str) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_tokenizer(path: str | None):
    if not path or not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def verify_width(args) -> int:
    algo = args.speculative_algorithm
    if algo == "DDTREE":
        return 1 + int(args.speculative_ddtree_budget)
    if algo == "DFLASH":
        return int(args.speculative_dflash_block_size)
    return 1


def _num_pages(args, runner_bytes_per_token: int, device: torch.device, max_reqs: int, ctx: int, width: int) -> int:
    if args.max_total_tokens:
        tokens = int(args.max_total_tokens)
    else:
        want = max_reqs * (ctx + width)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * args.mem_fraction_static)
        else:
            budget = CPU_KV_BUDGET_BYTES
        tokens = min(want, budget // max(runner_bytes_per_token, 1))
    return max(2, -(-tokens // args.page_size))


def build_runner(args, device: torch.device) -> tuple[ModelRunner, int]:
    tcfg = args.target_config
    dtype = torch_dtype(args.dtype if args.dtype != "auto" else tcfg.dtype)
    target = load_target(args.model_path, dtype, str(device))
    drafter = None
    if args.speculative_algorithm in ("DFLASH", "DDTREE"):
        drafter = load_drafter(args.speculative_draft_model_path, dtype, str(device))
    ctx = int(args.context_length or tcfg.max_position_embeddings)
    width = verify_width(args)
    max_reqs = int(args.max_running_requests)
    per_token = ModelRunner.kv_bytes_per_token(tcfg, drafter.config if drafter else None, dtype)
    pages = _num_pages(args, per_token, device, max_reqs, ctx, width)
    cfg = RunnerConfig(
        page_size=args.page_size, num_pages=pages, max_running_requests=max_reqs, max_context=ctx,
        block_size=int(args.speculative_dflash_block_size or 16), max_verify_width=width,
        attention_backend=args.attention_backend, mamba_strategy=args.mamba_scheduler_strategy or "extra_buffer",
        mamba_ssm_dtype=args.mamba_ssm_dtype, enable_cuda_graph=device.type == "cuda" and not args.disable_cuda_graph,
        cuda_graph_max_bs=int(args.cuda_graph_max_bs or RunnerConfig.cuda_graph_max_bs),
    )
    logger.info("KV cache: %d pages x %d tokens (%.1f MiB), %d max running requests, context %d",
                pages, args.page_size, pages * args.page_size * per_token / 2**20, max_reqs, ctx)
    return ModelRunner(target, drafter, cfg, device, dtype), ctx
