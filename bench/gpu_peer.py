#!/usr/bin/env python3
"""H200: the paper's reference code (liranringel/ddtree) per decoding round on a random Qwen3-8B-shaped bf16
pair (36 layers, hidden 4096, 32/8 heads, head dim 128, MLP 12288, vocab 151936; 5-layer drafter), batch 1.
One run, < 3 minutes. The checkout is never committed: it must travel with the working tree (carry `.peer`).

    python3 bench/gpu_peer.py [--peer-checkout .peer] [--budgets 64] [--context 1024] [--rounds 30] [--dflash]
    # $OUT/gpu_peer.json when $OUT is set

Weights come from ddtree.bench.random_pair (the rounds benchmark's builder) and are shared with the peer's
HF target and DFlash drafter (ddtree.bench.peer), so this is the same pair `ddtree bench rounds` times.
Field notes (2026-11-29, same harness idea): DDTree B=64 101.4 ms/round, B=256 83.9, DFlash chain 121.5.
"""

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ddtree.bench.peer import build_peer_models, load_peer, peer_round_ms  # noqa: E402
from ddtree.bench.random_pair import QWEN3_8B, SMOKE, build_pair, pair_configs  # noqa: E402

SPEEDUP_TARGET = (
    12.0  # issue #4: our DDTREE round >= 12x faster than the peer's on the same GPU and weights
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--peer-checkout", default=".peer")
    p.add_argument("--budgets", default="64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--dflash", action="store_true", help="also the peer's DFlash chain (dflash_generate)"
    )
    p.add_argument(
        "--no-cpp-compact", action="store_true", help="skip the peer's inline C++ KV compaction"
    )
    p.add_argument(
        "--draft-attn",
        default="auto",
        help="auto: flash_attention_2 if flash_attn imports, else sdpa",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny fp32 pair on the CPU (checks the script only)"
    )
    ns = p.parse_args()
    t0 = time.perf_counter()
    dev = torch.device("cpu" if ns.smoke else "cuda")
    cuda = dev.type == "cuda"
    # fails fast, naming --peer-checkout, before 18 GB are allocated
    peer = load_peer(ns.peer_checkout)
    import transformers

    dtype = torch.float32 if ns.smoke else torch.bfloat16
    tcfg, dcfg = pair_configs(
        SMOKE if ns.smoke else QWEN3_8B, 2 if ns.smoke else 5, 16, str(dtype)[6:]
    )
    target, drafter = build_pair(tcfg, dcfg, dev, dtype, seed=0)
    draft_attn = ns.draft_attn
    if draft_attn == "auto":
        import importlib.util

        draft_attn = (
            "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
        )
    models = build_peer_models(peer, target, drafter, dev, draft_attn)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    if cuda:
        torch.cuda.synchronize()
    print(
        f"{name} torch {torch.__version__} transformers {transformers.__version__}; "
        f"pair built in {time.perf_counter() - t0:.1f} s, "
        f"{torch.cuda.memory_allocated() / 1e9 if cuda else 0:.1f} GB; "
        f"peer {peer.root} adaptations {peer.adaptations}",
        flush=True,
    )
    cases = [("DDTREE", int(b)) for b in ns.budgets.split(",") if b.strip()] + (
        [("DFLASH", 0)] if ns.dflash else []
    )
    rows, failed = [], False
    for algo, budget in cases:
        t1 = time.perf_counter()
        try:
            r = peer_round_ms(
                ns.peer_checkout,
                target,
                drafter,
                ns.context,
                budget,
                ns.rounds,
                dev,
                algorithm=algo,
                warmup=ns.warmup,
                draft_attn=draft_attn,
                cpp_compact=cuda and not ns.no_cpp_compact,
                models=models,
            )
        except Exception:
            traceback.print_exc()
            failed = True
            continue
        r.pop("output_ids")
        r["seconds"] = time.perf_counter() - t1
        rows.append(r)
        name = f"DDTREE B={budget}" if algo == "DDTREE" else "DFLASH"
        split = " ".join(
            f"{k} {v:.2f}" for k, v in r["stages_ms"].items() if not k.startswith("tree_build_")
        )
        sub = " ".join(
            f"{k[11:]} {v:.2f}" for k, v in r["stages_ms"].items() if k.startswith("tree_build_")
        )
        print(
            f"peer {name:<12} ctx {ns.context} b1: {r['ms']:8.2f} ms/round (mean {r['ms_mean']:.2f}, p10 "
            f"{r['ms_p10']:.2f}, p90 {r['ms_p90']:.2f}; {r['rounds']} rounds, {r['emitted_mean']:.2f} tok/round)"
            f" | {split} | tree build: {sub} | draft attn {r['draft_attn']}, cpp compact {r['cpp_compact']} "
            f"| ours must be <= {r['ms'] / SPEEDUP_TARGET:.2f} ms for {SPEEDUP_TARGET:g}x "
            f"({time.perf_counter() - t1:.1f} s)",
            flush=True,
        )
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_peer.json"), "w", encoding="utf-8") as f:
            json.dump(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "context": ns.context,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
