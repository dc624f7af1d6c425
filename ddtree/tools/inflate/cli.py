"""`ddtree inflate [SRC_TARGET SRC_DRAFTER] --shape qwen3-8b|qwen3.6-27b|CONFIG.json OUT_DIR`."""

from __future__ import annotations

import argparse
import sys
import time

USAGE_PATHS = "give OUT_DIR (the embedded pair is the source) or SRC_TARGET SRC_DRAFTER OUT_DIR"


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="ddtree inflate",
        description="Widen a trained small (target, DFlash drafter) pair to a production shape "
        "with the same "
        "logits over its vocabulary; writes OUT_DIR/target and OUT_DIR/drafter (HF layout).",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help=USAGE_PATHS)
    p.add_argument(
        "--shape",
        required=True,
        help='qwen3-8b, qwen3.6-27b, or an HF config.json file (with an optional "drafter" object)',
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where to build: cpu, cuda, auto (the 8B pair builds in seconds on a GPU)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="weights dtype: bfloat16, float16, float32, or fp8 (Qwen's block-FP8 checkpoint "
        "layout: built in bfloat16, every decoder linear but the GDN's b / a quantized in 128x128 "
        "blocks, the rest bfloat16)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the Gated DeltaNet layers' random weights"
    )
    p.add_argument("--shard-size-gb", type=float, default=5.0, help="safetensors shard size")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = make_parser().parse_args(argv)
    if len(ns.paths) not in (1, 3):
        print(f"error: {USAGE_PATHS} (got {len(ns.paths)} paths)", file=sys.stderr)
        return 2
    import torch

    from ddtree.assets import default_model_paths
    from ddtree.models.layers import torch_dtype
    from ddtree.tools.inflate import InflateError, inflate_pair, write_pair
    from ddtree.tools.inflate.pair import quantize_pair

    fp8 = ns.dtype == "fp8"
    try:
        dtype = torch_dtype("bfloat16" if fp8 else ns.dtype)
    except ValueError as e:
        print(f"error: --dtype: {e}", file=sys.stderr)
        return 2
    device = ("cuda" if torch.cuda.is_available() else "cpu") if ns.device == "auto" else ns.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "error: --device cuda but no CUDA device is visible; use --device cpu", file=sys.stderr
        )
        return 2
    src_t, src_d = default_model_paths() if len(ns.paths) == 1 else ns.paths[:2]
    t0 = time.perf_counter()
    try:
        pair = inflate_pair(src_t, src_d, ns.shape, device, dtype, ns.seed)
    except (InflateError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if fp8:
        quantize_pair(pair)
    t1 = time.perf_counter()
    tdir, ddir = write_pair(pair, ns.paths[-1], int(ns.shard_size_gb * (1 << 30)))
    n_t = sum(p.numel() for p in pair.target.parameters())
    n_d = sum(p.numel() for p in pair.drafter.parameters())
    print(
        f"target  {tdir}: {n_t / 1e9:.2f}B params, "
        f"{pair.target_config['num_hidden_layers']} layers, source "
        f"layers on {pair.carriers}"
    )
    print(
        f"drafter {ddir}: {n_d / 1e9:.2f}B params, "
        f"taps {pair.drafter_config['dflash_config']['target_layer_ids']}"
    )
    print(
        f"built{' and quantized to block FP8' if fp8 else ''} in {t1 - t0:.1f} s on {device}, "
        f"written in {time.perf_counter() - t1:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
