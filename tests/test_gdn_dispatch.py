"""GDN backend dispatch: the reference on CPU and under DDTREE_REFERENCE=gdn; the fla branch's argument
plumbing (keywords, layouts, fp32 states) checked against a stand-in fla built from the reference, so the
test never needs fla or a GPU."""

import types

import pytest
import torch
from test_gdn_reference import Given, rel, rule_inputs

from ddtree import envs
from ddtree.kernels.gdn import backend, dispatch
from ddtree.kernels.gdn.reference import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    tree_gated_delta_rule,
)

CUDA_LIKE = types.SimpleNamespace(is_cuda=True)


def test_reference_on_cpu_and_describe():
    backend.ran.clear()
    q, k, v, g, beta, S0 = rule_inputs(1, 9, 2, 4, seed=0)
    o, S = dispatch.chunk_rule(q, k, v, g, beta, S0)
    ro, rS = gated_delta_rule_chunked(q, k, v, g, beta, S0)
    assert torch.equal(o, ro) and torch.equal(S, rS)
    dispatch.recurrent_rule(q, k, v, g, beta, S0)
    assert backend.ran == {("prefill", "reference"): 1, ("decode", "reference"): 1}
    assert set(backend.describe("cpu").values()) <= {"reference", "torch-gather"}


def test_force_switch(monkeypatch):
    monkeypatch.setattr(backend, "fla_ops", lambda: (None, None))
    monkeypatch.setattr(backend, "triton_ok", lambda: True)
    monkeypatch.delenv(envs.REFERENCE.name, raising=False)
    assert backend.use_fla(CUDA_LIKE) and backend.use_triton(CUDA_LIKE)
    for off in ("", "kernels", "attention,tree_build"):  # other parts leave GDN alone
        monkeypatch.setenv(envs.REFERENCE.name, off)
        assert backend.use_fla(CUDA_LIKE)
    monkeypatch.setenv(envs.REFERENCE.name, "gdn")
    assert not backend.use_fla(CUDA_LIKE) and not backend.use_triton(CUDA_LIKE)
    monkeypatch.setattr(backend, "fla_ops", lambda: None)  # fla missing: reference even on CUDA
    monkeypatch.delenv(envs.REFERENCE.name)
    assert not backend.use_fla(CUDA_LIKE)


def _fake_fla(calls):
    """fla's call signatures over the reference: only keyword arguments past v are accepted, as a guard
    against the positional trap (fla's 6th parameter is gk, not beta)."""

    def check(q, k, v, g, beta, initial_state, kw):
        assert kw.pop("output_final_state") and kw.pop("use_qk_l2norm_in_kernel") and not kw
        assert q.shape[2] == k.shape[2] and v.shape[2] % k.shape[2] == 0  # GVA: k is not expanded
        assert g.dtype == torch.float32 and (
            initial_state is None or initial_state.dtype == torch.float32
        )

    def chunk(q, k, v, *, g, beta, initial_state=None, cu_seqlens=None, **kw):
        check(q, k, v, g, beta, initial_state, kw)
        calls.append("chunk")
        return gated_delta_rule_chunked(q, k, v, g, beta, initial_state, cu_seqlens=cu_seqlens)

    def fused(q, k, v, *, g, beta, initial_state=None, **kw):
        check(q, k, v, g, beta, initial_state, kw)
        calls.append("fused")
        return gated_delta_rule_recurrent(q, k, v, g, beta, initial_state)

    return chunk, fused


def test_fla_branch_plumbing(monkeypatch):
    calls = []
    monkeypatch.setattr(dispatch, "use_fla", lambda t: True)
    monkeypatch.setattr(dispatch, "fla_ops", lambda: _fake_fla(calls))
    backend.ran.clear()
    q, k, v, g, beta, S0 = rule_inputs(1, 12, 2, 4, seed=1)
    cu = torch.tensor([0, 5, 12])
    S0 = S0.repeat(2, 1, 1, 1).bfloat16()  # a bf16 state pool row goes in as fp32
    o, S = dispatch.chunk_rule(q, k, v, g, beta, S0, cu_seqlens=cu)
    ro, rS = gated_delta_rule_chunked(q, k, v, g, beta, S0, cu_seqlens=cu)
    assert rel(o, ro) < 1e-6 and rel(S, rS) < 1e-6
    o2, S2 = dispatch.recurrent_rule(q, k, v, g, beta, S0[:1])
    ro2, rS2 = gated_delta_rule_recurrent(q, k, v, g, beta, S0[:1].float())
    assert rel(o2, ro2) < 1e-6 and rel(S2, rS2) < 1e-6
    assert calls == ["chunk", "fused"]
    assert backend.ran == {("prefill", "fla"): 1, ("decode", "fla"): 1}


def test_tree_rule_rows_reference():
    """The pool-row arguments on the reference path: read rows initial_rows, write rows state_rows only."""
    q, k, v, g, beta, _ = rule_inputs(2, 5, 2, 4, dk=8, dv=8, seed=2)
    parents = torch.tensor([[-1, 0, 0, 1, -1], [-1, 0, 1, 2, 3]])
    depths = torch.tensor([[0, 1, 1, 2, -1], [0, 1, 2, 3, 4]])
    pool = torch.randn(4, 4, 8, 8)
    rows = torch.tensor([3, 1])
    buf = torch.full((4, 7, 4, 8, 8), 7.0)
    o, st = dispatch.tree_rule(
        q,
        k,
        v,
        g,
        beta,
        parents,
        depths,
        pool,
        return_node_states=True,
        node_states=buf,
        initial_rows=rows,
        state_rows=rows,
    )
    ro, rst = tree_gated_delta_rule(
        q, k, v, g, beta, parents, depths, pool[rows], return_node_states=True
    )
    assert st is buf and torch.equal(o, ro) and torch.equal(buf[rows, :5], rst)
    assert (buf[[0, 2]] == 7).all() and (buf[rows, 5:] == 7).all()


@pytest.mark.parametrize("strategy", ["extra_buffer", "no_buffer"])
def test_decode_extend_uses_step_kernels(strategy):
    """All q_lens == 1: the decode path (step conv + recurrent rule) equals the packed prefill path."""
    from ddtree.engine.memory.state_pool import GDNGeometry, HybridStatePool

    geo = GDNGeometry(1, 2, 8, 4, 8, 4)
    pools = [HybridStatePool(geo, 3, 4, "cpu", strategy, dtype=torch.float32) for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    for p in pools:
        p.conv.copy_(torch.randn(p.conv.shape, generator=torch.Generator().manual_seed(4)))
        p.ssm.copy_(torch.randn(p.ssm.shape, generator=torch.Generator().manual_seed(5)))
    x = torch.randn(2, geo.conv_dim, generator=gen)
    w = torch.randn(geo.conv_dim, 4, generator=gen)
    q, k, v, g, beta, _ = rule_inputs(2, 1, 2, 4, dk=8, dv=8, seed=6)
    outs = []
    # [1, 2] forces the packed path; only 2 tokens are used
    for p, lens in zip(pools, ([1, 1], [1, 2])):
        ctx = p.extend_context([2, 0], lens, [5, 7])
        assert ctx.decode == (lens == [1, 1])
        ctx.cu_seqlens = torch.tensor([0, 1, 2])
        outs.append(
            (
                ctx.conv(0, x, w, None),
                ctx.rule(0, q[:, 0], k[:, 0], v[:, 0], Given(g[:, 0], beta[:, 0])),
            )
        )
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-6) and rel(outs[0][1], outs[1][1]) < 1e-5
    assert (
        torch.allclose(pools[0].conv, pools[1].conv, atol=1e-6)
        and rel(pools[0].ssm, pools[1].ssm) < 1e-5
    )
