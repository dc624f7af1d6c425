"""Fused Gated DeltaNet elementwise ops (ddtree/kernels/gdn/fused.py) vs their references, under
Triton's CPU interpreter (DDTREE_FUSED_KERNELS_INTERPRET=1, as tests/test_fused_kernels.py), and the
switches that keep the reference (the CPU by default, DDTREE_REFERENCE=kernels)."""

import pytest
import torch
from triton_utils import DEV, load_kernel_module, rel

fk = load_kernel_module("ddtree.kernels.gdn.fused")

import ddtree.kernels.fused as fused  # noqa: E402
from ddtree import envs  # noqa: E402
from ddtree.kernels.gdn import reference  # noqa: E402

BF16_REL = 2.5e-2 if DEV == "cpu" else 5e-3  # the interpreter truncates fp32 -> bf16


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setenv(fused.INTERPRET_ENV, "1")


def _gating_inputs(dtype, T=37, H=12):
    gen = torch.Generator().manual_seed(1)
    a = (torch.randn(T, H, generator=gen) * 12).to(dtype)  # wide range: both softplus branches
    b = torch.randn(T, H, generator=gen).to(dtype)
    A_log, dt = torch.randn(H, generator=gen).to(dtype), torch.randn(H, generator=gen).to(dtype)
    return [t.to(DEV) for t in (a, b, A_log, dt)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gating_matches_reference(kernels_on, dtype, monkeypatch):
    args = _gating_inputs(dtype)
    calls = []
    monkeypatch.setattr(fk, "_gating_kernel", _spy(fk._gating_kernel, calls))
    g, beta = fk.gdn_gating(*args)
    rg, rbeta = reference.gdn_gating(*args)
    assert calls and g.dtype == rg.dtype and beta.dtype == rbeta.dtype
    assert rel(g, rg) < 1e-5
    assert rel(beta, rbeta) < (1e-6 if dtype == torch.float32 else BF16_REL)


@pytest.mark.parametrize(
    "dtype,wdtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]
)
def test_gated_rmsnorm_matches_reference(kernels_on, dtype, wdtype, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    x, z = (torch.randn(5, 4, 96, generator=gen).to(dtype).to(DEV) for _ in range(2))
    w = (1 + 0.2 * torch.randn(96, generator=gen)).to(wdtype).to(DEV)
    calls = []
    monkeypatch.setattr(fk, "_gated_rmsnorm_kernel", _spy(fk._gated_rmsnorm_kernel, calls))
    out, ref = fk.gated_rmsnorm(x, z, w, 1e-6), reference.gated_rmsnorm(x, z, w, 1e-6)
    assert calls and out.dtype == ref.dtype and out.shape == ref.shape
    assert rel(out, ref) < (1e-5 if dtype == torch.float32 else BF16_REL)


def test_reference_where_the_kernels_do_not_run(monkeypatch):
    monkeypatch.setenv(fused.INTERPRET_ENV, "1")
    monkeypatch.setenv(envs.REFERENCE.name, "kernels")
    calls = []
    monkeypatch.setattr(fk, "_gating_kernel", _spy(fk._gating_kernel, calls))
    args = _gating_inputs(torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(fk.gdn_gating(*args), reference.gdn_gating(*args)))
    assert not calls


def _spy(kernel, calls):
    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    return Spy()
