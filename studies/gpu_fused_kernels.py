"""Fused layer kernels on the GPU (ddtree/kernels/fused): Triton vs the PyTorch reference at Qwen3-8B shapes.

    python3 studies/gpu_fused_kernels.py          # H200, about 30 s

For M = 1, 65, 520 tokens: one layer's worth of calls replayed from a CUDA graph (reference vs Triton): the
elementwise calls alone (2 add+RMSNorm, q/k norm+RoPE, SiLU-mul) and the layer without attention (the same
plus the qkv, o, gate|up and down GEMMs), with kernels per layer counted by torch.profiler. The kernels'
errors against the references (and a 2-layer target forward) are tests/gpu/test_fused_kernels_gpu.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import ddtree.kernels.fused as fused  # noqa: E402
from ddtree import envs  # noqa: E402
from ddtree.bench.cuda_timing import count_kernels, time_graph  # noqa: E402
from ddtree.models.layers import RotaryEmbedding  # noqa: E402

H, HQ, HKV, D, INTER, EPS = 4096, 32, 8, 128, 12288, 1e-6


class Inputs:
    def __init__(self, m, dev, gen):
        dt = torch.bfloat16

        def rnd(*shape, s=1.0):
            return (s * torch.randn(*shape, generator=gen, device=dev)).to(dt)

        self.x, self.res = rnd(m, H), rnd(m, H, s=4.0)
        self.w = (1 + 0.2 * torch.randn(H, generator=gen, device=dev)).to(dt)
        self.qkv = rnd(m, (HQ + 2 * HKV) * D, s=2.0)
        self.qw = (1 + 0.2 * torch.randn(D, generator=gen, device=dev)).to(dt)
        self.kw = (1 + 0.2 * torch.randn(D, generator=gen, device=dev)).to(dt)
        pos = torch.randint(0, 40000, (m,), generator=gen, device=dev)
        self.cos, self.sin = RotaryEmbedding(D, 1e6).cos_sin(pos, dt)
        self.gu = rnd(m, 2 * INTER, s=2.0)
        self.w_qkv = rnd((HQ + 2 * HKV) * D, H, s=0.02)
        self.w_o, self.w_gu, self.w_down = (
            rnd(H, HQ * D, s=0.02),
            rnd(2 * INTER, H, s=0.02),
            rnd(H, INTER, s=0.02),
        )

    def qk(self):
        q = self.qkv[:, : HQ * D].view(-1, HQ, D)
        k = self.qkv[:, HQ * D : (HQ + HKV) * D].view(-1, HKV, D)
        return q, k


def layer_calls(inp: Inputs, with_gemms: bool):
    """One decoder layer's work through the dispatch (attention output stood in by the q slice)."""

    def run():
        h, res = fused.add_rmsnorm(inp.x, inp.res, inp.w, EPS)
        qkv = h @ inp.w_qkv.t() if with_gemms else inp.qkv
        q = qkv[:, : HQ * D].view(-1, HQ, D)
        k = qkv[:, HQ * D : (HQ + HKV) * D].view(-1, HKV, D)
        q, k = fused.qk_norm_rope(q, k, inp.qw, inp.kw, inp.cos, inp.sin, EPS)
        a = q.view(-1, HQ * D) @ inp.w_o.t() if with_gemms else inp.x
        h, res = fused.add_rmsnorm(a, res, inp.w, EPS)
        gu = h @ inp.w_gu.t() if with_gemms else inp.gu
        act = fused.silu_mul(gu)
        return act @ inp.w_down.t() if with_gemms else act

    return run


def set_reference(on: bool):
    if on:
        os.environ[envs.REFERENCE.name] = "kernels"
    else:
        os.environ.pop(envs.REFERENCE.name, None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
    )
    p.add_argument("--reps", type=int, default=20)
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    t0 = time.time()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  Qwen3-8B shapes (bf16)")
    for m in (1, 65, 520):
        inp = Inputs(m, dev, gen)
        print(f"\nM = {m}")
        for gemms in (False, True):
            label = "layer w/o attention" if gemms else "elementwise calls  "
            times, kernels = {}, {}
            for ref in (True, False):
                set_reference(ref)
                fn = layer_calls(inp, gemms)
                kernels[ref] = count_kernels(fn)
                times[ref] = time_graph(fn, reps=ns.reps) * 1e6
            set_reference(False)
            print(
                f"  {label} reference {times[True]:8.1f} us ({kernels[True]:3d} kernels)   "
                f"triton {times[False]:8.1f} us ({kernels[False]:3d} kernels)   "
                f"x36 layers: {36 * times[True] / 1e3:.2f} -> {36 * times[False] / 1e3:.2f} ms"
            )
        del inp
        torch.cuda.empty_cache()
    print(f"\n{time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
