"""The one-token in-place rule kernel (ddtree/kernels/gdn/decode_triton.py) against
`reference.gated_delta_rule_recurrent` (T = 1) under Triton's CPU interpreter: GQA shapes (Hk !=
Hv), a dv of a partial tile, batch 1 to 5, slots in any order, padded rows on the pool's scratch
row (the only row written besides the requests'), fp32 / bf16 / fp16 pools, q / k / v as strided
slices of one conv output row, the gate given or raw (gated inside); and the dispatch
(`dispatch.decode_step`): the same in-place semantics on the reference path."""

import pytest
import torch
from test_gdn_reference import Given
from triton_utils import DEV, load_kernel_module, rel

kernel = load_kernel_module("ddtree.kernels.gdn.decode_triton")

from ddtree.kernels.gdn import backend, dispatch  # noqa: E402
from ddtree.kernels.gdn.fused import GateInputs  # noqa: E402
from ddtree.kernels.gdn.reference import gated_delta_rule_recurrent, gdn_gating  # noqa: E402

R = 6  # pool rows; row R - 1 plays the scratch row


def _case(b, hk, hv, dk, dv, ssm_dtype, seed, pad=0, dtype=torch.float32):
    """Inputs of b live requests (+ pad padded rows on the scratch row): q / k / v slices of one
    [b + pad, C] row (the conv output's layout), the raw gate, the pool, the rows."""
    gen = torch.Generator().manual_seed(seed)
    n = b + pad
    kd = hk * dk
    y = torch.randn(n, 2 * kd + hv * dv, generator=gen).to(dtype)
    q, k, v = torch.split(y, [kd, kd, hv * dv], dim=-1)
    q, k, v = q.view(n, hk, dk), k.view(n, hk, dk), v.view(n, hv, dv)
    a = (torch.randn(n, 2 * hv, generator=gen) * 6).to(dtype)[:, :hv]  # strided, as in_proj's
    bb = torch.randn(n, hv, generator=gen).to(dtype)
    A_log = torch.empty(hv).uniform_(0.1, 2.0, generator=gen).log()
    dt_bias = torch.randn(hv, generator=gen)
    ssm = (torch.randn(R, hv, dk, dv, generator=gen) * 0.5).to(ssm_dtype)
    rows = torch.randperm(R - 1, generator=gen)[:b].tolist() + [R - 1] * pad
    to = lambda t: t.to(DEV)  # noqa: E731
    return (
        *(to(t) for t in (q, k, v)),
        tuple(to(t) for t in (a, bb, A_log, dt_bias)),
        to(ssm),
        torch.tensor(rows, device=DEV),
    )


def _reference(q, k, v, g, beta, ssm, rows):
    steps = (t[:, None] for t in (q, k, v, g, beta))
    o, S = gated_delta_rule_recurrent(*steps, ssm[rows].float())
    return o[:, 0], S


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(
    "b,hk,hv,dk,dv,ssm_dtype,pad",
    [
        (1, 2, 4, 16, 24, torch.float32, 0),  # GQA, a partial column tile
        (3, 1, 2, 32, 16, torch.float32, 2),  # padded rows on the scratch row
        (5, 2, 2, 16, 32, torch.bfloat16, 1),
        (2, 2, 6, 16, 16, torch.float16, 3),
    ],
)
@pytest.mark.parametrize("raw", [False, True])
def test_kernel_matches_reference_in_place(b, hk, hv, dk, dv, ssm_dtype, pad, raw):
    q, k, v, gate, ssm, rows = _case(b, hk, hv, dk, dv, ssm_dtype, seed=b + hv + pad, pad=pad)
    g, beta = gdn_gating(*gate)
    before = ssm.clone()
    o = kernel.gated_delta_decode_triton(q, k, v, gate if raw else (g, beta), ssm, rows)
    ro, rS = _reference(q[:b], k[:b], v[:b], g[:b], beta[:b], before, rows[:b])
    tol = TOL[ssm_dtype]
    assert o.shape == (b + pad, hv, dv) and torch.isfinite(o).all()
    assert rel(o[:b], ro) < tol and rel(ssm[rows[:b]].float(), rS) < tol
    touched = set(rows.tolist())
    for r in range(R):  # rows no request owns (the scratch row apart) are left alone
        if r not in touched:
            assert torch.equal(ssm[r], before[r]), r
    if pad:
        assert not torch.equal(ssm[R - 1], before[R - 1])  # the padded rows wrote the scratch row
        assert torch.isfinite(ssm[R - 1].float()).all()


def test_raw_gate_gives_the_gating_kernels_numbers(monkeypatch):
    """bf16 gate inputs: the gate computed inside (beta rounded to bf16 as `fused.gdn_gating`
    stores it) == the gating kernel's g / beta handed in. Both in the interpreter, which rounds
    fp32 -> bf16 its own way (truncation), so the comparison is kernel against kernel."""
    from ddtree.kernels.gdn import fused

    monkeypatch.setenv("DDTREE_FUSED_KERNELS_INTERPRET", "1")
    q, k, v, gate, ssm, rows = _case(3, 2, 4, 16, 16, torch.float32, seed=7, dtype=torch.bfloat16)
    g, beta = fused.gdn_gating(*gate)
    assert beta.dtype == torch.bfloat16
    given, inside = ssm.clone(), ssm.clone()
    o1 = kernel.gated_delta_decode_triton(q, k, v, (g, beta), given, rows)
    o2 = kernel.gated_delta_decode_triton(q, k, v, gate, inside, rows)
    assert torch.equal(o2, o1) and torch.equal(inside, given)


def test_kernel_steps_twice_like_the_recurrence_over_two_tokens():
    """Two calls on the same rows = the reference recurrence over the two tokens (the state is
    really carried in place between rounds)."""
    q, k, v, gate, ssm, rows = _case(2, 1, 2, 16, 16, torch.float32, seed=3)
    q2, k2, v2, gate2, _, _ = _case(2, 1, 2, 16, 16, torch.float32, seed=4)
    S0 = ssm[rows].clone()
    kernel.gated_delta_decode_triton(q, k, v, gate, ssm, rows)
    o = kernel.gated_delta_decode_triton(q2, k2, v2, gate2, ssm, rows)
    (g, beta), (g2, beta2) = gdn_gating(*gate), gdn_gating(*gate2)
    two = [torch.stack(p, 1) for p in ((q, q2), (k, k2), (v, v2), (g, g2), (beta, beta2))]
    ro, rS = gated_delta_rule_recurrent(*two, S0)
    assert rel(o, ro[:, 1]) < 1e-5 and rel(ssm[rows], rS) < 1e-5


def test_dispatch_reference_path_is_in_place(monkeypatch):
    """The CPU without the interpreter switch: the reference step, gathered and written back into
    the same rows, the gate's values from its inputs; with the interpreter switch the kernel, the
    gate handed in or computed inside."""
    if DEV != "cpu":
        pytest.skip("CPU dispatch")
    monkeypatch.delenv("DDTREE_FUSED_KERNELS_INTERPRET", raising=False)
    q, k, v, gate, ssm, rows = _case(3, 2, 4, 16, 8, torch.float32, seed=5, pad=1)
    g, beta = gdn_gating(*gate)
    before = ssm.clone()
    backend.ran.clear()
    live = GateInputs(gate[0][:3], gate[1][:3], *gate[2:])
    o = dispatch.decode_step(q[:3], k[:3], v[:3], live, ssm, rows[:3])
    assert backend.ran == {("decode_step", "reference"): 1}
    # bit for bit against the same functions on the same inputs: the gate's values as the dispatch
    # takes them (`live.values()`: 3 contiguous rows), then the recurrence
    ro, rS = _reference(q[:3], k[:3], v[:3], *live.values(), before, rows[:3])
    assert torch.equal(o, ro) and torch.equal(ssm[rows[:3]], rS)
    # and the gate computed over the whole strided batch (other vector / scalar splits of exp):
    # the same numbers up to fp32 rounding
    ro_all, rS_all = _reference(q[:3], k[:3], v[:3], g[:3], beta[:3], before, rows[:3])
    assert rel(o, ro_all) < 1e-6 and rel(ssm[rows[:3]], rS_all) < 1e-6
    assert torch.equal(ssm[R - 1], before[R - 1])  # no padded row in this call
    monkeypatch.setenv("DDTREE_FUSED_KERNELS_INTERPRET", "1")
    kept = ssm.clone()
    for given in (Given(g[:3], beta[:3]), live):  # g / beta handed in, or gated in the kernel
        ssm.copy_(kept)
        backend.ran.clear()
        o2 = dispatch.decode_step(q[:3], k[:3], v[:3], given, ssm, rows[:3])
        assert backend.ran == {("decode_step", "triton"): 1}
        ro2, rS2 = _reference(q[:3], k[:3], v[:3], g[:3], beta[:3], kept, rows[:3])
        assert rel(o2, ro2) < 1e-5 and rel(ssm[rows[:3]], rS2) < 1e-5
