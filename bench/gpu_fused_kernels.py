"""Fused layer kernels on the GPU (ddtree/kernels/fused): Triton vs the PyTorch reference at Qwen3-8B shapes.

    python3 bench/gpu_fused_kernels.py          # H200, about 30 s; exit 1 on a mismatch

For M = 1, 65, 520 tokens: each kernel's error against the reference (max |diff| / max |ref|, relative L2, the
fraction of bit-identical elements), then one layer's worth of calls replayed from a CUDA graph (reference vs
Triton): the elementwise calls alone (2 add+RMSNorm, q/k norm+RoPE, SiLU-mul) and the layer without attention
(the same plus the qkv, o, gate|up and down GEMMs), with kernels per layer counted by torch.profiler. Last, a
2-layer Qwen3-8B-shaped target forward through the model code, reference vs Triton.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import ddtree.kernels.fused as fused  # noqa: E402
from ddtree.bench.cuda_timing import time_graph  # noqa: E402
from ddtree.kernels.fused import reference as R  # noqa: E402
from ddtree.models.layers import RotaryEmbedding  # noqa: E402

H, HQ, HKV, D, INTER, EPS = 4096, 32, 8, 128, 12288, 1e-6
MAX_REL = 1e-2  # max |diff| / max |ref|: a few bf16 ulps of the largest element
L2_REL = 3e-3


def err(got, ref):
    g, r = got.double(), ref.double()
    return ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item(), \
        ((g - r).norm() / r.norm().clamp_min(1e-30)).item(), (got == ref).float().mean().item()


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
        self.w_o, self.w_gu, self.w_down = rnd(H, HQ * D, s=0.02), rnd(2 * INTER, H, s=0.02), rnd(H, INTER, s=0.02)

    def qk(self):
        q = self.qkv[:, :HQ * D].view(-1, HQ, D)
        k = self.qkv[:, HQ * D:(HQ + HKV) * D].view(-1, HKV, D)
        return q, k


def check(inp: Inputs, tk) -> list[tuple[str, float, float, float]]:
    rows = []
    q, k = inp.qk()
    for name, got, ref in (
        ("add_rmsnorm", tk.add_rmsnorm(inp.x, inp.res, inp.w, EPS), R.add_rmsnorm_reference(inp.x, inp.res, inp.w, EPS)),
        ("rmsnorm", tk.add_rmsnorm(inp.x, None, inp.w, EPS)[:1], (R.rmsnorm_reference(inp.x, inp.w, EPS),)),
        ("add_rmsnorm(1+w)", tk.add_rmsnorm(inp.x, inp.res, inp.w - 1, EPS, True),
         R.add_rmsnorm_reference(inp.x, inp.res, inp.w - 1, EPS, True)),
        ("qk_norm_rope", tk.qk_norm_rope(q, k, inp.qw, inp.kw, inp.cos, inp.sin, EPS),
         R.qk_norm_rope_reference(q, k, inp.qw, inp.kw, inp.cos, inp.sin, EPS)),
        ("silu_mul", (tk.silu_mul(inp.gu),), (R.silu_mul_reference(inp.gu),)),
    ):
        for j, (g, r) in enumerate(zip(got, ref)):
            assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, r.shape, g.dtype, r.dtype)
            rows.append((f"{name}[{j}]", *err(g, r)))
    return rows


def layer_calls(inp: Inputs, with_gemms: bool):
    """One decoder layer's work through the dispatch (attention output stood in by the q slice)."""
    def run():
        h, res = fused.add_rmsnorm(inp.x, inp.res, inp.w, EPS)
        qkv = h @ inp.w_qkv.t() if with_gemms else inp.qkv
        q = qkv[:, :HQ * D].view(-1, HQ, D)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(-1, HKV, D)
        q, k = fused.qk_norm_rope(q, k, inp.qw, inp.kw, inp.cos, inp.sin, EPS)
        a = q.view(-1, HQ * D) @ inp.w_o.t() if with_gemms else inp.x
        h, res = fused.add_rmsnorm(a, res, inp.w, EPS)
        gu = h @ inp.w_gu.t() if with_gemms else inp.gu
        act = fused.silu_mul(gu)
        return act @ inp.w_down.t() if with_gemms else act
    return run


def count_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def set_reference(on: bool):
    if on:
        os.environ[fused.FORCE_REFERENCE_ENV] = "1"
    else:
        os.environ.pop(fused.FORCE_REFERENCE_ENV, None)


def model_check(dev) -> float:
    from ddtree.bench.random_pair import QWEN3_8B, build_pair, pair_configs

    shape = dict(QWEN3_8B, num_layers=2)
    tcfg, dcfg = pair_configs(shape, 1, 16, "bfloat16")
    target, _ = build_pair(tcfg, dcfg, dev, torch.bfloat16, 0)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    ids = torch.randint(0, tcfg.vocab_size, (1, 65), device=dev)
    out = {}
    for ref in (True, False):
        set_reference(ref)
        with torch.no_grad():
            out[ref] = target.forward_train(ids, tap_layers=(0,))
    set_reference(False)
    worst = 0.0
    for name, g, r in (("logits", out[False][0], out[True][0]), ("tap0", out[False][1], out[True][1])):
        mx, l2, same = err(g, r)
        print(f"  2-layer 8B target {name:7s} max_rel {mx:.2e}  l2_rel {l2:.2e}  identical {100 * same:5.1f}%")
        worst = max(worst, l2)
    del target
    torch.cuda.empty_cache()
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--skip-model", action="store_true")
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    t0 = time.time()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    from ddtree.kernels.fused import triton as tk

    bad = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  Qwen3-8B shapes (bf16)")
    for m in (1, 65, 520):
        inp = Inputs(m, dev, gen)
        print(f"\nM = {m}")
        for name, mx, l2, same in check(inp, tk):
            ok = mx < MAX_REL and l2 < L2_REL
            bad += [] if ok else [f"M={m} {name}"]
            print(f"  {name:22s} max_rel {mx:.2e}  l2_rel {l2:.2e}  identical {100 * same:5.1f}%  {'ok' if ok else 'MISMATCH'}")
        for gemms in (False, True):
            label = "layer w/o attention" if gemms else "elementwise calls  "
            times, kernels = {}, {}
            for ref in (True, False):
                set_reference(ref)
                fn = layer_calls(inp, gemms)
                kernels[ref] = count_kernels(fn)
                times[ref] = time_graph(fn, reps=ns.reps) * 1e6
            set_reference(False)
            print(f"  {label} reference {times[True]:8.1f} us ({kernels[True]:3d} kernels)   triton {times[False]:8.1f} us "
                  f"({kernels[False]:3d} kernels)   x36 layers: {36 * times[True] / 1e3:.2f} -> {36 * times[False] / 1e3:.2f} ms")
        del inp
        torch.cuda.empty_cache()
    if not ns.skip_model:
        print()
        worst = model_check(dev)
        if worst > 2e-2:
            bad.append("2-layer target forward")
    print(f"\n{time.time() - t0:.1f} s; {'MISMATCH: ' + ', '.join(bad) if bad else 'all kernels match the reference'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
