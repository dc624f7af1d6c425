#!/usr/bin/env python3
"""H200: the tensor-core ceiling for the tree kernel's wgmma shapes (issue 7), measured, not taken from a data sheet.

    python3 bench/gpu_wgmma_ceiling.py        # ~20 s

A Gluon loop of m64nNk16 x 8 (K = 128) per iteration on operands resident in shared memory (or A in registers),
one warpgroup per program, 1-3 programs per SM, 1 or 2 independent accumulators (groups) in flight. The
attention kernel's S = Q K^T is N = 64 and its P V is N = 128 (A = P in registers). TFLOP/s counts 2 * M * N * K
per instruction group. N = 256 with two accumulators needs more registers than a thread has and is not run.
"""

import time

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def wg_bench(
    a_ptr,
    b_ptr,
    out_ptr,
    ITERS,
    N: gl.constexpr,
    RS: gl.constexpr,
    TWO: gl.constexpr,
    num_warps: gl.constexpr,
):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N, 16]
    )
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, 128], gl.bfloat16)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
    a_s = gl.allocate_shared_memory(
        gl.bfloat16, [64, 128], a_sl, gl.load(a_ptr + r[:, None] * 128 + c[None, :])
    )
    rb = gl.arange(0, N, layout=gl.SliceLayout(1, ld))
    b_s = gl.allocate_shared_memory(
        gl.bfloat16, [N, 128], b_sl, gl.load(b_ptr + rb[:, None] * 128 + c[None, :])
    )
    fence_async_shared()
    gl.thread_barrier()
    acc = gl.zeros([64, N], gl.float32, acc_l)
    acc2 = gl.zeros([64, N], gl.float32, acc_l)
    a_op = a_s.load(gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2))
    for i in range(ITERS):
        if RS:
            tok = warpgroup_mma(a_op, b_s.permute((1, 0)), acc, is_async=True)
        else:
            tok = warpgroup_mma(a_s, b_s.permute((1, 0)), acc, is_async=True)
        if TWO:
            if RS:
                tok2 = warpgroup_mma(a_op, b_s.permute((1, 0)), acc2, is_async=True)
            else:
                tok2 = warpgroup_mma(a_s, b_s.permute((1, 0)), acc2, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(tok,))
            acc2 = warpgroup_mma_wait(0, deps=(tok2,))
        else:
            acc = warpgroup_mma_wait(0, deps=(tok,))
    rr = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    gl.store(out_ptr + gl.program_id(0) * 64 + rr, gl.sum(acc + acc2, axis=1))


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    a = torch.randn(64, 128, dtype=torch.bfloat16, device=dev) * 0.01
    b = torch.randn(256, 128, dtype=torch.bfloat16, device=dev) * 0.01
    out = torch.empty(sms * 4 * 64, dtype=torch.float32, device=dev)
    iters = 4000
    print(f"{torch.cuda.get_device_name()}; {sms} SMs")
    print("N   A     groups  programs/SM  TFLOP/s")
    for n in (64, 128, 256):
        for rs in (0, 1):
            for two in (0, 1) if n < 256 else (0,):
                for per_sm in (1, 2, 3):
                    grid = (sms * per_sm,)

                    def f(grid=grid):
                        wg_bench[grid](a, b, out, iters, N=n, RS=rs, TWO=two, num_warps=4)

                    f()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(3):
                        f()
                    torch.cuda.synchronize()
                    t = (time.perf_counter() - t0) / 3
                    flops = 2 * 64 * n * 128 * iters * (1 + two) * grid[0]
                    print(
                        f"{n:<4}{'reg' if rs else 'smem':<6}{1 + two:<8}{per_sm:<13}{flops / t / 1e12:7.0f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
