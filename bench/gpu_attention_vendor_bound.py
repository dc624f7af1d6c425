#!/usr/bin/env python3
"""H200: what the best attention kernels torch ships reach on the tree-verify work, beside ours, one run.

    python3 bench/gpu_attention_vendor_bound.py       # ~2 minutes; writes $OUT/gpu_attention_vendor_bound.json

Issue 7's targets are ratios to the KV-read floor. This asks how close the vendor kernels come on the same
arithmetic, in the form most favourable to them: the context part only (no tree mask, no new tokens), dense
contiguous K/V (no pages), each KV head's GQA group folded into the query length (rows = nodes x 4), and the
context cut into S chunks laid out as batch (flash-decoding's split, so the grid fills the GPU), best S per
backend, without the split merge that a real answer needs. Per point: SDPA's cuDNN, flash and efficient
backends, our default paged kernel (the full tree problem: mask, pages, merge), the KV floor (KV bytes / SM
copy bandwidth of this run) and the tensor floor (the FLOPs of the rows in 64-row blocks at the wgmma ceiling
that bench/gpu_wgmma_ceiling.py measured, 900 TFLOP/s). Cold L2 as in gpu_tree_attention.py: a CUDA graph over
R input copies that together exceed the L2 several times. Also: the device time of two back-to-back minimal
kernels in a graph (the fixed cost a split kernel + merge pair pays before any work).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpu_tree_attention import DEV, DT, HKV, HQ, D, Problem, bandwidths, cold_copies, rel, save_json  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from ddtree.bench.cuda_timing import time_graph  # noqa: E402

T0 = time.time()
G = HQ // HKV
WGMMA_CEILING = 900e12  # FLOP/s, bench/gpu_wgmma_ceiling.py on this H200 (884-920 measured)
POINTS = [
    ("b1 n65 1k", 1, 65, 1024),
    ("b1 n65 4k", 1, 65, 4096),
    ("b1 n65 16k", 1, 65, 16384),
    ("b1 n65 32k", 1, 65, 32768),
    ("b8 n65 8k", 8, 65, 8192),
    ("b1 n64 16k", 1, 64, 16384),
    ("b1 n1 16k", 1, 1, 16384),
]
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def vendor(b: int, rows: int, ctx: int, backend) -> tuple[float, int, float]:
    """(best seconds per call, its chunk count S, rel err vs an fp32 reference of one copy) for the context part
    of b requests x HKV heads, `rows` query rows per KV head, cut into S chunks."""
    best = (float("inf"), 0, float("nan"))
    for s in (1, 2, 4, 8, 16, 32, 64):
        if ctx % s or ctx // s < 128:
            continue
        n = ctx // s
        r_copies = cold_copies(2 * b * ctx * HKV * D * 2)
        qs = [torch.randn(b * s, HKV, rows, D, dtype=DT, device=DEV) for _ in range(r_copies)]
        ks = [torch.randn(b * s, HKV, n, D, dtype=DT, device=DEV) for _ in range(r_copies)]
        vs = [torch.randn(b * s, HKV, n, D, dtype=DT, device=DEV) for _ in range(r_copies)]
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(qs[0], ks[0], vs[0])
                t = time_graph(
                    lambda: [
                        F.scaled_dot_product_attention(qs[i], ks[i], vs[i]) for i in range(r_copies)
                    ],
                    r_copies,
                )
        except Exception as e:  # noqa: BLE001  (a backend that does not take this shape)
            print(f"    {backend} S={s}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        if t < best[0]:
            ref = F.scaled_dot_product_attention(qs[0].float(), ks[0].float(), vs[0].float())
            best = (t, s, rel(out, ref))
    return best


def ours(b: int, n: int, ctx: int) -> tuple[float, float, int]:
    L = ctx + n
    p = Problem([n] * b, [L] * b, cold_copies(b * L * HKV * D * 4), tree=n > 1, seed=ctx + n)
    out, plan = p.ours_plan(0)
    err = rel(out, p.reference(0))
    t = time_graph(lambda: [p.ours(r) for r in range(p.R)], p.R)
    return t, err, plan.num_splits


def launch_pair(pairs: int = 50) -> float:
    x = torch.zeros(32, device=DEV)
    return time_graph(lambda: [(x.add_(1.0), x.mul_(1.0)) for _ in range(pairs)], pairs, reps=30)


def main():
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}"
    )
    bw = bandwidths()["sm_copy_graph"]
    torch.cuda.empty_cache()
    pair = launch_pair()
    print(
        f"SM copy {bw / 1e12:.2f} TB/s; two minimal kernels (50 pairs in a graph): {pair * 1e6:.1f} us per pair",
        flush=True,
    )
    rows_out = []
    for name, b, n, ctx in POINTS:
        rows = n * G
        floor = b * ctx * HKV * D * 4 / bw
        tensor = 4 * b * HKV * (-(-rows // 64) * 64) * ctx * D / WGMMA_CEILING
        row = {"point": name, "floor_us": floor * 1e6, "tensor_floor_us": tensor * 1e6}
        t, err, s = ours(b, n, ctx)
        row["ours"] = (t * 1e6, s, err)
        for key, be in BACKENDS.items():
            tv, sv, ev = vendor(b, rows, ctx, be)
            row[key] = (tv * 1e6, sv, ev)
        flops = 4 * b * HKV * rows * ctx * D
        print(
            f"  {name:<11} floor {floor * 1e6:6.1f} tensor {tensor * 1e6:6.1f} | ours {t * 1e6:7.1f} "
            f"({t / floor:.2f}x, s={s}, rel {err:.1e}) | "
            + " | ".join(
                f"{k} {row[k][0]:7.1f} ({row[k][0] / 1e6 / floor:.2f}x, S={row[k][1]}, "
                f"{flops / (row[k][0] / 1e6) / 1e12:.0f} TF/s)"
                for k in BACKENDS
            ),
            flush=True,
        )
        rows_out.append(row)
    print(
        "\n| point | KV floor | tensor floor | ours (x floor) | cuDNN, ctx only (x) | flash (x) | efficient (x) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows_out:
        cells = [f"{r[k][0]:.1f} ({r[k][0] / r['floor_us']:.2f}x)" for k in ("ours", *BACKENDS)]
        print(
            f"| {r['point']} | {r['floor_us']:.1f} | {r['tensor_floor_us']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    save_json(
        "gpu_attention_vendor_bound.json",
        {"sm_copy_Bps": bw, "launch_pair_s": pair, "points": rows_out},
    )
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
