"""Block-FP8 kernels (ddtree/kernels/fp8) against the PyTorch reference, through Triton's interpreter on
a machine without a GPU (tests/gpu/test_fp8_gpu.py repeats them on the device at the served shapes).

The interpreter runs fp8 loads, stores and `tl.dot` on fp8 operands exactly, but its own fp32 -> e4m3
cast (`triton.runtime.interpreter._convert_float`) is not the GPU's round-to-nearest-even: a carry out
of the mantissa is lost in odd binades (124.3 -> 64, not 128; 31.5 -> 16), e4m3 subnormals (below
2^-6) are truncated, a tie rounds up. So on the CPU the quantization kernels are compared with the
reference's scaled values cast by that same function (`cast`): everything but the cast's rounding is
checked bit for bit; on the GPU they are compared with the reference itself. ~10 s.
"""

import pytest
import torch
from triton_utils import DEV, load_kernel_module

kernels = load_kernel_module("ddtree.kernels.fp8.triton")

import ddtree.kernels.fp8 as fp8  # noqa: E402
from ddtree.kernels.fp8 import reference as R  # noqa: E402
from ddtree.kernels.fp8.tuning import EXACT, GemmConfig, auto_split, gemm_config  # noqa: E402

CONFIGS = [
    GemmConfig(16, 32, 4, 2),
    GemmConfig(32, 64, 4, 2),
    GemmConfig(16, 32, 4, 2, split_k=2),
    GemmConfig(16, 64, 4, 2, split_k=3),  # uneven runs where K blocks do not divide
]


def cast(scaled: torch.Tensor) -> torch.Tensor:
    """float32 values -> e4m3 as the kernels' cast does it here: the GPU's (torch's: nearest even), or
    the interpreter's own conversion."""
    if DEV == "cuda":
        return scaled.to(R.FP8)
    import numpy as np
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import _convert_float

    bits = _convert_float(
        scaled.contiguous().numpy().astype(np.float32),
        tl.float32,
        tl.float8e4nv,
        ir.ROUNDING_MODE.RTNE,
    )
    return torch.from_numpy(bits.astype(np.uint8)).view(R.FP8)


def ref_quant(x: torch.Tensor, group: int):
    """group_quant's reference, cast as the kernels' cast does where they run."""
    q, s = R.group_quant(x, group)
    M, K = x.shape
    scaled = (x.float() / s.repeat_interleave(group, 1)[:, :K]).clamp(-R.FP8_MAX, R.FP8_MAX)
    return cast(scaled), s


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def data(M, N, K, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=gen) * torch.linspace(0.1, 4, K)).to(dtype).to(DEV)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(DEV)
    return x, w


def test_interpreter_cast_is_not_the_gpus():
    """Why the CPU comparisons cast with the interpreter's function: it rounds otherwise (if Triton
    fixes it, this fails: then compare with the reference directly)."""
    if DEV == "cuda":
        pytest.skip("the interpreter only")
    x = torch.tensor([124.3, -31.5, 100.0, 3.3, 0.011])
    assert cast(x).float().tolist() == [64.0, -16.0, 104.0, 3.25, 0.009765625]
    assert x.to(R.FP8).float().tolist() == [128.0, -32.0, 96.0, 3.25, 0.01171875]


@pytest.mark.parametrize(
    "M,K,group",
    # several programs a row: whole ones (2048: 2 x 8 groups), and a last one of 1 group (1152)
    [(1, 128, 128), (7, 384, 128), (5, 200, 64), (33, 96, 32), (3, 2048, 128), (2, 1152, 128)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_quant_matches_reference(M, K, group, dtype):
    x, _ = data(M, 8, K, M * K, dtype)
    x[0, :group] = 0  # an all-zero group: scale EPS / 448, values 0
    q, s = kernels.group_quant(x, group)
    rq, rs = ref_quant(x, group)
    assert torch.equal(s, rs)
    assert torch.equal(bits(q), bits(rq))


def test_group_quant_pads_rows_and_writes_column_major_scales():
    x, _ = data(6, 8, 256, 3)
    q, s = kernels.group_quant(x, 128, rows=8, column_major=True)
    assert q.shape == (8, 256) and s.shape == (8, 2) and s.stride() == (1, 8)
    rq, rs = ref_quant(x, 128)
    assert torch.equal(bits(q[:6]), bits(rq)) and torch.equal(s[:6], rs)
    assert not q[6:].float().any() and torch.equal(s[6:], torch.full_like(s[6:], R.EPS / R.FP8_MAX))


@pytest.mark.parametrize(
    "M,N,K,block,group_n",
    [
        (1, 96, 256, (32, 128), 32),  # decode row
        (17, 130, 200, (64, 64), 64),  # ragged N, ragged K
        (40, 64, 128, (128, 128), 1),  # a fused projection's per-row scales
        (9, 48, 96, (16, 32), 16),  # the TP tests' small blocks
    ],
)
@pytest.mark.parametrize("config", CONFIGS)
def test_gemm_matches_reference(M, N, K, block, group_n, config):
    x, w = data(M, N, K, M + N + K)
    wq, ws = R.quantize_weight(w, block)
    if group_n == 1:
        ws = ws.repeat_interleave(block[0], 0)[:N]
    xq, xs = R.group_quant(x, block[1])
    ref = R.block_matmul(xq, xs, wq, ws, group_n, block[1], torch.float32)
    out = torch.full((M, N), float("nan"), device=DEV)  # every element must be written
    got = kernels.gemm(xq, xs, wq, ws, group_n, block[1], torch.float32, config, out=out)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[3]], ids=["split1", "split3"])
def test_quant_then_gemm_matches_reference(dtype, with_bias, config):
    """The launches a linear runs (group quant, GEMM, the split's reduce), in the model dtype, with
    a bias."""
    M, N, K, block = 11, 80, 320, (32, 64)
    x, w = data(M, N, K, 5, dtype)
    wq, ws = R.quantize_weight(w, block)
    bias = torch.randn(N, device=DEV).to(dtype) if with_bias else None
    xq, xs = ref_quant(x, block[1])
    ref = R.block_matmul(xq, xs, wq, ws, block[0], block[1], dtype, bias)
    got = kernels.gemm(*kernels.group_quant(x, block[1]), wq, ws, *block, dtype, config, bias)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("reference", ["", "fp8", "kernels"])
def test_dispatch_backends(monkeypatch, reference):
    """`linear` through the kernels (the Triton GEMM off CUDA) and under DDTREE_REFERENCE=fp8 or
    kernels (the PyTorch reference) == the reference's numbers."""
    monkeypatch.setenv("DDTREE_REFERENCE", reference)
    monkeypatch.setenv("DDTREE_FUSED_KERNELS_INTERPRET", "1")
    assert fp8.use_kernels(torch.empty(1, device=DEV)) is (reference == "")
    x, w = data(6, 64, 256, 11)
    wq, ws = R.quantize_weight(w, (128, 128))
    x3 = x.view(2, 3, 256)
    got = fp8.linear(x3, wq, ws, 128, 128, scale_t=None)
    assert got.shape == (2, 3, 64)
    xq, xs = ref_quant(x, 128) if not reference else R.group_quant(x, 128)
    ref = R.block_matmul(xq, xs, wq, ws, 128, 128, torch.float32).view(2, 3, 64)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


TABLE = {  # a measured table's form (kernels/fp8/table.py): per shape, per row class, fastest first
    "shapes": {"24576x4096": [["triton", "cublas"], ["cublas", "triton"], ["cublas", "triton"]]},
    "families": {"wide": [["cublas"], ["cublas"], ["cublas"]], "long_k": [["cublas"]] * 3},
}


def test_choose_and_the_tiles(monkeypatch):
    # auto: the measured table's first backend that runs (tests/test_fp8_dispatch.py: the table)
    monkeypatch.setattr(fp8.table, "load", lambda: TABLE)
    assert fp8.choose(1, 24576, 4096, cublas=True) == "triton"
    assert fp8.choose(64, 4096, 4096, cublas=True) == "cublas"
    assert fp8.choose(1, 4096, 12288, cublas=True) == "cublas"
    assert fp8.choose(65, 24576, 4096, cublas=True) == "cublas"
    assert fp8.choose(520, 24576, 4096, cublas=False) == "triton"
    # float32 activations: one row-invariant GEMM at every row count (speculation == AR)
    assert fp8.choose(520, 24576, 4096, cublas=True, exact=True) == "triton"
    assert fp8.choose(1, 4096, 12288, cublas=True, exact=True) == "triton"
    assert gemm_config(1, 4096) == GemmConfig(16, 32, 4, 4)
    assert gemm_config(16, 34816) == GemmConfig(16, 64, 4, 4)


def test_the_engine_never_splits_and_the_studies_split():
    """The engine's tiles are unsplit at every row count; `auto_split` (what a study passes the
    kernel: studies/gpu_fp8_gemm.py) gives decode rows programs up to 4 per SM, runs >= 4 K
    blocks, never past 16 rows."""
    assert all(
        gemm_config(m, n, exact).split_k == 1
        for m in (1, 16, 17, 520)
        for n in (4096, 34816)
        for exact in (False, True)
    )
    plain = gemm_config(1, 4096)
    # 8B o at 1 row on 132 SMs: 128 tiles of 16x32 -> ceil(528 / 128) = 5 runs (32 K blocks)
    assert auto_split(1, 4096, 4096, plain, 132) == 5
    # 8B down: 96 K blocks, same tiles -> 5; a short K caps it (8 blocks -> 2 runs of 4)
    assert auto_split(16, 4096, 12288, plain, 132) == 5
    assert auto_split(1, 4096, 1024, plain, 132) == 2
    # enough tiles already (27B gate|up: 544 tiles of 16x64), more rows, no device
    assert auto_split(1, 34816, 5120, gemm_config(1, 34816), 132) == 1
    assert auto_split(17, 4096, 4096, gemm_config(17, 4096), 132) == 1
    assert auto_split(1, 4096, 4096, plain, 0) == 1
    # float32: one tile shape (one instruction: wgmma) at every row count, so one summation order
    exact = {gemm_config(m, n, exact=True) for m in (1, 16, 65, 1040) for n in (64, 34816)}
    assert exact == {EXACT}


def test_reference_scales_are_ieee_quotients():
    """max|x| / 448 rounded once (not x times the rounded reciprocal), on any device."""
    x, _ = data(64, 8, 256, 21)
    _, s = R.group_quant(x, 128)
    amax = x.double().abs().view(64, 2, 128).amax(-1)
    assert torch.equal(s, (amax / 448.0).float())
    _, ws = R.quantize_weight(x, (16, 128))
    wmax = x.double().abs().view(4, 16, 2, 128).amax(dim=(1, 3))
    assert torch.equal(ws, (wmax / 448.0).float())
