"""The hybrid layers' fused elementwise kernels on the layouts the layers now hand them, vs their
references under Triton's CPU interpreter (DDTREE_FUSED_KERNELS_INTERPRET=1): the GDN gating and
gated RMSNorm reading a / b / z as strided row slices of the one fused in_proj output (no copy), and
the gated attention's sigmoid output gate reading the gate half of the q projection in place."""

import pytest
import torch
from triton_utils import DEV, load_kernel_module, rel

fk = load_kernel_module("ddtree.kernels.gdn.fused")

import ddtree.kernels.fused as fused  # noqa: E402
from ddtree import envs  # noqa: E402
from ddtree.kernels.fused.reference import sigmoid_gate_reference  # noqa: E402
from ddtree.kernels.gdn import reference  # noqa: E402

BF16_REL = 2.5e-2 if DEV == "cpu" else 5e-3  # the interpreter truncates fp32 -> bf16


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setenv(fused.INTERPRET_ENV, "1")


def _spy(kernel, calls):
    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    return Spy()


def _no_copy(rows):
    def checked(t, inner):
        r = rows(t, inner)
        assert r.data_ptr() == t.data_ptr() and r.stride(-1) == 1  # a view, not a copy
        return r

    return checked


def test_gating_and_gated_norm_read_in_proj_slices(kernels_on, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    T, H, D = 7, 4, 32
    y = torch.randn(T, H * D + 2 * H + 5, generator=gen).to(DEV)  # [z | b | a | unused]
    z = y[:, : H * D].view(T, H, D)
    b, a = y[:, H * D : H * D + H], y[:, H * D + H : H * D + 2 * H]
    assert not (z.is_contiguous() or a.is_contiguous())
    A_log, dt = torch.randn(H, generator=gen).to(DEV), torch.randn(H, generator=gen).to(DEV)
    calls = []
    monkeypatch.setattr(fk, "_gating_kernel", _spy(fk._gating_kernel, calls))
    monkeypatch.setattr(fk, "_gated_rmsnorm_kernel", _spy(fk._gated_rmsnorm_kernel, calls))
    monkeypatch.setattr(fk, "_rows", _no_copy(fk._rows))
    g, beta = fk.gdn_gating(a, b, A_log, dt)
    rg, rbeta = reference.gdn_gating(a.contiguous(), b.contiguous(), A_log, dt)
    assert rel(g, rg) < 1e-5 and rel(beta, rbeta) < 1e-6 and g.is_contiguous()
    x = torch.randn(T, H, D, generator=gen).to(DEV)
    w = (1 + 0.2 * torch.randn(D, generator=gen)).to(DEV)
    out = fk.gated_rmsnorm(x, z, w, 1e-6)
    assert rel(out, reference.gated_rmsnorm(x, z.contiguous(), w, 1e-6)) < 1e-5
    assert len(calls) == 2


def _gate_calls(monkeypatch):
    calls = []
    mod = fused._triton(interpreted=DEV == "cpu")
    fn = mod.sigmoid_gate
    monkeypatch.setattr(mod, "sigmoid_gate", lambda *a: calls.append(1) or fn(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_matches_reference(kernels_on, monkeypatch, dtype):
    gen = torch.Generator().manual_seed(4)
    T, H, D = 5, 3, 16
    qg = torch.randn(T, H, 2 * D, generator=gen).to(dtype).to(DEV)
    gate = qg[..., D:]  # the gate half of [query | gate] per head: strided
    x = torch.randn(T, H, D, generator=gen).to(dtype).to(DEV)
    calls = _gate_calls(monkeypatch)
    out = fused.sigmoid_gate(x, gate)
    ref = sigmoid_gate_reference(x, gate)
    assert calls and out.dtype == dtype and out.shape == ref.shape
    assert rel(out, ref) < (1e-6 if dtype == torch.float32 else BF16_REL)


def test_sigmoid_gate_reference_switches(monkeypatch):
    x = torch.randn(2, 3, 8).to(DEV)
    calls = _gate_calls(monkeypatch)
    monkeypatch.setenv(fused.INTERPRET_ENV, "1")
    monkeypatch.setenv(envs.REFERENCE.name, "kernels")
    assert torch.equal(fused.sigmoid_gate(x, x), sigmoid_gate_reference(x, x)) and not calls
    monkeypatch.delenv(envs.REFERENCE.name)
    fused.sigmoid_gate(x, x)
    assert calls
