"""Gated DeltaNet kernels on the device against the PyTorch reference (ddtree/kernels/gdn): the
Triton tree kernel (outputs and node states; chains, bushy and random trees, a padded request; fp32
and bf16), the chunk-form tree verify (outputs and the accepted node's state) and its Triton kernel
(outputs, stash rows, the gate inside, CUDA graph replay behind the tree conv, launch options). Formerly the
checks of studies/gpu_gdn_tree.py sections (a) and (b), which now only time."""

import pytest
import torch

pytestmark = pytest.mark.gpu

HK, HV, DK, DV = 16, 48, 128, 128


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def tree(b, n, kind, gen, dev):
    """Depth-sorted parents (parent < child): chain, bushy or random; (parents, depths) on the
    device."""
    parents = torch.full((b, n), -1, dtype=torch.int64)
    for r in range(b):
        for c in range(1, n):
            if kind == "chain":
                p = c - 1
            elif kind == "bushy":
                p = max(0, c - 1 - int(torch.randint(0, 9, (1,), generator=gen)))
            else:
                p = int(torch.randint(0, c, (1,), generator=gen))
            parents[r, c] = p
    depths = torch.zeros(b, n, dtype=torch.int64)
    for c in range(1, n):
        depths[:, c] = depths.gather(1, parents[:, c : c + 1])[:, 0] + 1
    return parents.to(dev), depths.to(dev)


def inputs(b, n, dtype, gen, dev):
    q, k = (torch.randn(b, n, HK, DK, generator=gen).to(dev, dtype) for _ in range(2))
    v = torch.randn(b, n, HV, DV, generator=gen).to(dev, dtype)
    g = (-torch.rand(b, n, HV, generator=gen) * 2).to(dev)
    beta = torch.rand(b, n, HV, generator=gen).to(dev, dtype)
    s0 = (torch.randn(b, HV, DK, DV, generator=gen) * 0.1).to(dev)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("kind", ["chain", "bushy", "random"])
@pytest.mark.parametrize("budget", [1, 4, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_tree_kernel_matches_reference(dtype, budget, kind):
    pytest.importorskip("triton")
    from ddtree.kernels.gdn import reference
    from ddtree.kernels.gdn.triton_tree import tree_gated_delta_rule_triton

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(budget * 7 + len(kind))
    parents, depths = tree(2, budget + 1, kind, gen, dev)
    if kind == "random" and budget > 1:  # request 1 padded: its last third is padding
        cut = (budget + 1) * 2 // 3
        parents[1, cut:], depths[1, cut:] = -1, -1
    q, k, v, g, beta, s0 = inputs(2, budget + 1, dtype, gen, dev)
    args = (q, k, v, g, beta, parents, depths, s0)
    o, st = tree_gated_delta_rule_triton(*args, return_node_states=True)
    ro, rst = reference.tree_gated_delta_rule(*args, return_node_states=True)
    assert torch.isfinite(o).all()
    assert rel(o, ro) < (1e-4 if dtype == torch.float32 else 2e-2) and rel(st, rst) < 1e-4


@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("with_state", [False, True])
def test_tree_chunk_matches_reference(b, with_state):
    pytest.importorskip("triton")
    from ddtree.kernels.gdn import reference
    from ddtree.kernels.gdn.tree_chunk import tree_chunk_gated_delta_rule

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(b)
    parents, depths = tree(b, 65, "bushy", gen, dev)
    q, k, v, g, beta, s0 = (t.float() for t in inputs(b, 65, torch.bfloat16, gen, dev))
    ro, rst = reference.tree_gated_delta_rule(
        q, k, v, g, beta, parents, depths, s0, return_node_states=True
    )
    last = torch.randint(0, 65, (b,), generator=gen).to(dev)
    o, st = tree_chunk_gated_delta_rule(
        q, k, v, g, beta, parents, depths, s0, last=last if with_state else None
    )
    assert torch.isfinite(o).all() and rel(o, ro) < 1e-4
    if with_state:
        assert rel(st, rst[torch.arange(b, device=dev), last]) < 1e-4


def _chunk_kernel_case(b, kind, dtype, seed):
    """A B=64 tree per request at the 27B head shape (request 1 of a batch padded in its last
    third), the round's tree_mask, pool rows for the initial states, and what the reference says."""
    from ddtree.kernels.gdn import reference
    from ddtree.speculative.tree import DraftTree

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(seed)
    parents, depths = tree(b, 65, kind, gen, dev)
    if b > 1:
        parents[1, 43:], depths[1, 43:] = -1, -1
    q, k, v, g, beta, s0 = inputs(b, 65, dtype, gen, dev)
    mask = DraftTree.from_parents(torch.zeros_like(parents), parents).tree_mask
    pool = torch.randn(b + 3, HV, DK, DV, device=dev) * 0.1
    rows = torch.randperm(b + 3, generator=gen)[:b].to(dev)
    pool[rows] = s0
    f32 = [t.float() for t in (q, k, v, g, beta)]
    want, _ = reference.tree_gated_delta_rule(*f32, parents, depths, s0)
    return (q, k, v, g, beta, depths, pool, mask, depths >= 0, rows), want


@pytest.mark.parametrize("kind", ["bushy", "random", "chain"])
@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tree_chunk_kernel_matches_reference(dtype, b, kind):
    """The no_buffer verify's Triton kernel (kernels/gdn/tree_chunk_triton.py: the solve, then the
    outputs overlapping it as programmatic dependents) at the 27B head shape (48 value heads over 16
    key heads, dk = dv = 128), B=64 trees, batch 1 and 8: outputs vs the per-node reference (fp32
    math on the same inputs), g / beta in the stash rows, and a CUDA graph replay equal to the eager
    call (the graph keeps the programmatic edges)."""
    pytest.importorskip("triton")
    from ddtree.kernels.gdn.tree_chunk_triton import tree_chunk_triton

    args, want = _chunk_kernel_case(b, kind, dtype, seed=b + len(kind))
    q, k, v, g, beta, depths, pool, mask, valid, rows = args
    node_g = torch.zeros(pool.shape[0], 65, HV, device=pool.device)
    node_beta = torch.zeros(pool.shape[0], 65, HV, device=pool.device, dtype=dtype)
    o = tree_chunk_triton(*args, stash=(node_g, node_beta, rows))
    assert torch.isfinite(o).all() and (o[~valid] == 0).all()
    err = rel(o, want)
    assert err < (1e-4 if dtype == torch.float32 else 1e-2), err
    assert torch.equal(node_g[rows][valid], g[valid])
    assert torch.equal(node_beta[rows][valid], beta[valid])
    graph = torch.cuda.CUDAGraph()
    static = tree_chunk_triton(*args)  # compiled before capture
    with torch.cuda.graph(graph):
        static = tree_chunk_triton(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, tree_chunk_triton(*args))


@pytest.mark.parametrize("b", [1, 8])
def test_tree_chunk_kernel_gates_inside_after_the_conv_in_a_graph(b):
    """The engine's sequence in one CUDA graph, fresh inputs every replay: the in_proj slices ->
    the tree conv (a programmatic-dependent kernel writing q / k / v) -> the chunk kernel with the
    raw gate (its output kernel loads q, k, v and the state rows before it waits for the solve).
    Every replay equals the reference on that replay's inputs (a load that ran ahead of its
    producer would not), and the stash holds `gdn_gating`'s g / beta."""
    pytest.importorskip("triton")
    from ddtree.kernels.gdn import reference
    from ddtree.kernels.gdn.fused import gdn_gating
    from ddtree.kernels.gdn.tree_chunk_triton import tree_chunk_triton
    from ddtree.kernels.gdn.tree_conv import conv
    from ddtree.speculative.tree import DraftTree

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(40 + b)
    n, C = 65, 2 * HK * DK + HV * DV
    parents, depths = tree(b, n, "bushy", gen, dev)
    mask = DraftTree.from_parents(torch.zeros_like(parents), parents).tree_mask
    proj = torch.empty(b * n, C + 2 * HV, device=dev, dtype=torch.bfloat16)
    weight = (torch.randn(C, 4, generator=gen) * 0.5).to(dev, torch.bfloat16)
    rows = torch.arange(b, device=dev) + 1
    conv_state = torch.zeros(b + 1, C, 3, device=dev, dtype=torch.bfloat16)
    ssm = torch.zeros(b + 1, HV, DK, DV, device=dev)
    A_log = torch.rand(HV, generator=gen).add(0.1).log().to(dev)
    dt_bias = torch.randn(HV, generator=gen).to(dev)
    node_g = torch.zeros(b + 1, n, HV, device=dev)
    node_beta = torch.zeros(b + 1, n, HV, device=dev, dtype=torch.bfloat16)

    def step():
        y, _ = conv(proj[:, :C].view(b, n, C), parents, conv_state, weight, None, state_rows=rows)
        y = y.view(b * n, C)
        q = y[:, : HK * DK].view(b, n, HK, DK)
        k = y[:, HK * DK : 2 * HK * DK].view(b, n, HK, DK)
        v = y[:, 2 * HK * DK :].view(b, n, HV, DV)
        raw = (proj[:, C : C + HV], proj[:, C + HV :], A_log, dt_bias)
        stash = (node_g, node_beta, rows)
        o = tree_chunk_triton(q, k, v, None, None, depths, ssm, mask, None, rows, stash, raw)
        return o, y

    def fill():
        proj.copy_(torch.randn(proj.shape, generator=gen).to(dev))
        conv_state.copy_((torch.randn(conv_state.shape, generator=gen)).to(dev))
        ssm.copy_(torch.randn(ssm.shape, generator=gen).to(dev) * 0.1)

    fill()
    step()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o, static_y = step()
    for _ in range(3):
        fill()
        graph.replay()
        torch.cuda.synchronize()
        y = static_y
        q = y[:, : HK * DK].view(b, n, HK, DK).float()
        k = y[:, HK * DK : 2 * HK * DK].view(b, n, HK, DK).float()
        v = y[:, 2 * HK * DK :].view(b, n, HV, DV).float()
        g, beta = gdn_gating(proj[:, C : C + HV], proj[:, C + HV :], A_log, dt_bias)
        g, beta = g.view(b, n, HV), beta.view(b, n, HV)
        want, _ = reference.tree_gated_delta_rule(
            q, k, v, g, beta.float(), parents, depths, ssm[rows]
        )
        assert rel(static_o, want) < 1e-2, rel(static_o, want)
        assert rel(node_g[rows], g) < 1e-5 and rel(node_beta[rows].float(), beta.float()) < 1e-2


@pytest.mark.parametrize(
    "block_v,block_k,warps,solve_warps,precision",
    [
        (16, 16, 8, None, "tf32x3"),
        (64, 16, 8, None, "tf32x3"),
        (32, 32, 4, 4, "tf32x3"),
        (32, 64, 4, None, "tf32"),
        (32, 16, 8, None, "ieee"),
    ],
)
def test_tree_chunk_kernel_launch_options_match_reference(
    block_v, block_k, warps, solve_warps, precision
):
    """Every launch option studies/gpu_gdn_tree.py (e) and studies/gpu_tree_cost.py time compiles and
    keeps the numbers (tf32: its 10-bit mantissa in the dots, a looser bound)."""
    pytest.importorskip("triton")
    from ddtree.kernels.gdn.tree_chunk_triton import tree_chunk_triton

    args, want = _chunk_kernel_case(8, "bushy", torch.float32, seed=3)
    o = tree_chunk_triton(
        *args,
        block_v=block_v,
        block_k=block_k,
        num_warps=warps,
        solve_warps=solve_warps,
        precision=precision,
    )
    assert rel(o, want) < (5e-3 if precision == "tf32" else 1e-4), rel(o, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunk_and_recurrent_dispatch_match_reference(dtype):
    """Prefill (varlen chunk rule, initial states) and decode continuing from its final state,
    through the dispatch (fla on CUDA where installed, else the reference), against the reference.
    Formerly section (d) of studies/gpu_gdn_tree.py (which still times it)."""
    from ddtree.kernels.gdn import dispatch, reference

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(11)
    lens = [1000, 37, 3059]
    q, k, v, g, beta, _ = inputs(1, sum(lens), dtype, gen, dev)
    s0 = (torch.randn(len(lens), HV, DK, DV, generator=gen) * 0.1).to(dev)
    cu = torch.tensor([0, *lens], device=dev).cumsum(0)
    o, S = dispatch.chunk_rule(q, k, v, g, beta, s0, cu_seqlens=cu)
    ro, rS = reference.gated_delta_rule_chunked(q, k, v, g, beta, s0, cu_seqlens=cu)
    nq, nk, nv, ng, nb, _ = inputs(len(lens), 1, dtype, gen, dev)
    od, Sd = dispatch.recurrent_rule(nq, nk, nv, ng, nb, S)
    rod, rSd = reference.gated_delta_rule_recurrent(nq, nk, nv, ng, nb, rS)
    tol = 5e-3 if dtype == torch.float32 else 3e-2  # fla's chunk dots run in tf32 on fp32 inputs
    errs = {
        "prefill_out": rel(o, ro),
        "prefill_state": rel(S, rS),
        "decode_out": rel(od, rod),
        "decode_state": rel(Sd, rSd),
    }
    assert torch.isfinite(Sd).all() and all(e < tol for e in errs.values()), errs


@pytest.mark.parametrize("b,acc", [(1, 1), (1, 16), (8, 8)])
def test_no_buffer_commit_rule_matches_reference(b, acc):
    """The no_buffer commit's rule part on 48 layers' accepted chains (what HybridStatePool._replay
    hands the reference replay): the chunk-form state of the chain's last node vs
    reference.replay_path. Formerly section (c') of studies/gpu_gdn_tree.py."""
    pytest.importorskip("triton")
    from ddtree.kernels.gdn import reference
    from ddtree.kernels.gdn.tree_chunk import tree_chunk_gated_delta_rule

    dev, P = torch.device("cuda"), 17
    N = 48 * b
    torch.manual_seed(b)
    q, k = (torch.randn(N, P, HK, DK, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(N, P, HV, DV, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(N, P, HV, device=dev) * 2
    beta = torch.rand(N, P, HV, device=dev, dtype=torch.bfloat16)
    s0 = torch.randn(N, HV, DK, DV, device=dev) * 0.1
    step = torch.arange(P, device=dev)
    path = torch.where(step <= acc, step, -1).repeat(N, 1)
    par = torch.where(path > 0, step - 1, -1)
    dep = torch.where(path >= 0, step, -1)
    want = reference.replay_path(q, k, v, g, beta, path, s0)
    last = torch.full((N,), acc, device=dev)
    got = tree_chunk_gated_delta_rule(q, k, v, g, beta, par, dep, s0, max_depth=16, last=last)[1]
    assert rel(got, want) < 1e-4


def test_root_conv_equals_the_one_node_tree_conv_on_the_device():
    """AR rounds' `root_causal_conv1d` == the one-node `tree_causal_conv1d`, bit for bit on CUDA."""
    from ddtree.kernels.gdn import root_causal_conv1d, tree_causal_conv1d

    dev = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(5, 10240, device=dev, dtype=dtype), torch.randn(10240, 4, device=dev)
        st = torch.randn(5, 10240, 3, device=dev, dtype=dtype)
        y, s = root_causal_conv1d(x, st, w.to(dtype))
        parents = torch.full((5, 1), -1, device=dev)
        valid = torch.ones(5, 1, dtype=torch.bool, device=dev)
        ty, ts = tree_causal_conv1d(x[:, None], parents, st, w.to(dtype), None, valid, True)
        assert torch.equal(y, ty[:, 0]) and torch.equal(s, ts[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gating_and_gated_norm_match_reference(dtype):
    """kernels/gdn/fused.py on the device (the 27B shape: Hv 48, dv 128, 65 tree nodes) vs the
    references."""
    pytest.importorskip("triton")
    from ddtree.kernels.gdn import fused, reference

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(4)
    a, b = ((torch.randn(65, HV, generator=gen) * 8).to(dev, dtype) for _ in range(2))
    A_log, dt = (torch.randn(HV, generator=gen).to(dev, dtype) for _ in range(2))
    g, beta = fused.gdn_gating(a, b, A_log, dt)
    rg, rbeta = reference.gdn_gating(a, b, A_log, dt)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert rel(g, rg) < 1e-5 and rel(beta, rbeta) < tol
    x, z = (torch.randn(65, HV, DV, generator=gen).to(dev, dtype) for _ in range(2))
    w = (1 + 0.2 * torch.randn(DV, generator=gen)).to(dev, dtype)
    assert rel(fused.gated_rmsnorm(x, z, w, 1e-6), reference.gated_rmsnorm(x, z, w, 1e-6)) < tol


@pytest.mark.parametrize("b,n", [(1, 1), (1, 65), (8, 65)])
def test_tree_conv_kernel_matches_reference(b, n):
    """kernels/gdn/tree_conv.py at the 27B shape (C = 10240 conv channels, bf16) vs
    reference.tree_causal_conv1d: outputs, and the node states bit for bit."""
    pytest.importorskip("triton")
    from ddtree.kernels.gdn import reference
    from ddtree.kernels.gdn.tree_conv import tree_causal_conv1d_triton

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(n)
    parents, _ = tree(b, n, "bushy", gen, dev)
    C = 2 * HK * DK + HV * DV
    x = torch.randn(b, n, C, generator=gen).to(dev, torch.bfloat16)
    st = torch.randn(b, C, 3, generator=gen).to(dev, torch.bfloat16)
    w = torch.randn(C, 4, generator=gen).to(dev, torch.bfloat16)
    valid = torch.ones(b, n, dtype=torch.bool, device=dev)
    y, s = tree_causal_conv1d_triton(x, parents, st, w, None, valid, True)
    ry, rs = reference.tree_causal_conv1d(x, parents, st, w, None, valid, True)
    assert rel(y, ry) < 1e-2 and torch.equal(s, rs)


# --- issue 19's kernel cuts and switches (hybrid2) ---------------------------------------------------


@pytest.mark.parametrize("bv,warps", [(4, 1), (8, 1), (16, 2), (64, 8)])
def test_tree_kernel_launch_options_match_reference(bv, warps):
    """The Triton recurrence's tile overrides (studies/gpu_gdn_tree.py (b)) on the device (fp32, B=64,
    b=2)."""
    pytest.importorskip("triton")
    from ddtree.kernels.gdn.reference import tree_gated_delta_rule
    from ddtree.kernels.gdn.triton_tree import tree_gated_delta_rule_triton

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(bv + warps)
    parents, depths = tree(2, 65, "random", gen, dev)
    args = (*inputs(2, 65, torch.float32, gen, dev)[:5], parents, depths)
    s0 = inputs(2, 65, torch.float32, gen, dev)[5]
    o, st = tree_gated_delta_rule_triton(*args, s0, True, block_v=bv, num_warps=warps)
    ro, rst = tree_gated_delta_rule(*args, s0, return_node_states=True)
    assert rel(o, ro) < 1e-4 and rel(st, rst) < 1e-4


def test_tree_conv_through_pool_rows_matches_reference():
    """The tree conv reading committed rows / writing the stash through the slot index (27B C)."""
    pytest.importorskip("triton")
    from ddtree.kernels.gdn import reference
    from ddtree.kernels.gdn.tree_conv import tree_causal_conv1d_triton

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(21)
    b, n, R, W = 3, 65, 6, 80
    parents, _ = tree(b, n, "bushy", gen, dev)
    C = 2 * HK * DK + HV * DV
    x = torch.randn(b, n, C, generator=gen).to(dev, torch.bfloat16)
    pool = torch.randn(R, C, 3, generator=gen).to(dev, torch.bfloat16)
    w = torch.randn(C, 4, generator=gen).to(dev, torch.bfloat16)
    rows = torch.tensor([4, 0, 2], device=dev)
    stash = torch.full((R, W, C, 3), 7.0, device=dev, dtype=torch.bfloat16)
    valid = torch.ones(b, n, dtype=torch.bool, device=dev)
    y, _ = tree_causal_conv1d_triton(
        x, parents, pool, w, None, valid, True, state_rows=rows, node_states=stash
    )
    ry, rs = reference.tree_causal_conv1d(x, parents, pool[rows], w, None, valid, True)
    assert rel(y, ry) < 1e-2 and torch.equal(stash[rows, :n], rs)
    assert (stash[[1, 3, 5]] == 7).all() and (stash[:, n:] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_gating_norm_and_sigmoid_gate_match_reference(dtype):
    """The layers' fused elementwise kernels on their real layouts at the 27B shape: a / b / z as
    slices of the one in_proj output, the gate as the strided half of the q projection."""
    pytest.importorskip("triton")
    from ddtree.kernels.fused import sigmoid_gate
    from ddtree.kernels.fused.reference import sigmoid_gate_reference
    from ddtree.kernels.gdn import fused, reference

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(22)
    T, C = 65, 2 * HK * DK + HV * DV
    y = torch.randn(T, C + HV * DV + 2 * HV, generator=gen).to(dev, dtype)
    z = y[:, C : C + HV * DV].view(T, HV, DV)
    b, a = y[:, C + HV * DV : C + HV * DV + HV], y[:, C + HV * DV + HV :]
    A_log, dt = (torch.randn(HV, generator=gen).to(dev, dtype) for _ in range(2))
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    g, beta = fused.gdn_gating(a, b, A_log, dt)
    rg, rbeta = reference.gdn_gating(a.contiguous(), b.contiguous(), A_log, dt)
    assert rel(g, rg) < 1e-5 and rel(beta, rbeta) < tol
    x = torch.randn(T, HV, DV, generator=gen).to(dev, dtype)
    w = (1 + 0.2 * torch.randn(DV, generator=gen)).to(dev, dtype)
    got = fused.gated_rmsnorm(x, z, w, 1e-6)
    assert rel(got, reference.gated_rmsnorm(x, z.contiguous(), w, 1e-6)) < tol
    qg = torch.randn(T, 24, 512, generator=gen).to(dev, dtype)  # 27B: 24 heads of [query | gate]
    out = torch.randn(T, 24, 256, generator=gen).to(dev, dtype)
    assert rel(sigmoid_gate(out, qg[..., 256:]), sigmoid_gate_reference(out, qg[..., 256:])) < tol


def test_gdn_layer_one_gemm_matches_four():
    """A 27B-shaped GatedDeltaNet: inference's one in_proj GEMM == HF's four (training's path)."""
    from ddtree.models.configs import TargetConfig
    from ddtree.models.gated_deltanet import IN_PROJ_PARTS, GatedDeltaNet
    from ddtree.models.shapes import resolve_shape

    cfg = TargetConfig.from_dict(resolve_shape("qwen3.6-27b")[0])
    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(23)
    layer = GatedDeltaNet(cfg).to(dev, torch.bfloat16)
    x = torch.randn(65, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
    with torch.no_grad():
        fused = layer._in_proj(x)
        parts = [getattr(layer, n).weight for n in IN_PROJ_PARTS]
        assert layer._fused is not None and parts[1].data_ptr() > parts[0].data_ptr()
        four = [torch.nn.functional.linear(x, p) for p in parts]
    for f, s in zip(fused, four):
        assert rel(f, s) < 1e-2


@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
def test_commit_kernel_matches_the_reference_commit(ssm_dtype, monkeypatch):
    """no_buffer's in-place commit kernel (kernels/gdn/commit_triton.py) at the 27B head shape, 8
    layers, batch 8 with ragged accept lengths (0..16) and permuted slots, against the pool's
    reference commit (gathers + the reference replay + index_put); rows no request owns untouched; a CUDA
    graph replay of the kernel equal to the eager call."""
    pytest.importorskip("triton")
    from ddtree import envs
    from ddtree.engine.config import GDNGeometry
    from ddtree.engine.memory.state_pool import HybridStatePool

    geo = GDNGeometry(num_layers=8, hk=HK, dk=DK, hv=HV, dv=DV, kernel=4)
    gen = torch.Generator().manual_seed(5)

    def pool():
        p = HybridStatePool(geo, 10, 65, "cuda", "no_buffer", ssm_dtype, torch.bfloat16)
        g = torch.Generator(device="cuda").manual_seed(5)
        for t in (p.conv, p.ssm, *p.stash.values()):
            t.copy_((torch.randn(t.shape, generator=g, device="cuda") * 0.3).to(t.dtype))
        p.stash["node_g"].copy_(-p.stash["node_g"].abs())
        p.stash["node_beta"].copy_(p.stash["node_beta"].sigmoid())
        return p

    slots = torch.randperm(10, generator=gen)[:8].cuda()
    acc = torch.tensor([0, 1, 2, 3, 5, 8, 13, 16]).cuda()
    path = torch.stack([torch.randperm(64, generator=gen)[:17] + 1 for _ in range(8)]).cuda()
    path[:, 0] = 0
    want, got, before = pool(), pool(), pool()
    monkeypatch.setenv(envs.REFERENCE.name, "gdn")
    want.commit(slots, path, acc)
    monkeypatch.delenv(envs.REFERENCE.name)
    got.commit(slots, path, acc)
    assert rel(got.ssm.float(), want.ssm.float()) < (1e-5 if ssm_dtype == "float32" else 1e-2)
    assert torch.equal(got.conv, want.conv)
    free = [r for r in range(10) if r not in slots.tolist()]
    assert torch.equal(got.ssm[:, free], before.ssm[:, free])
    again = pool()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        again.commit(slots, path, acc)
    again.ssm.copy_(before.ssm)
    again.conv.copy_(before.conv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(again.ssm, got.ssm) and torch.equal(again.conv, got.conv)


# --- one-node rounds in place ---------------------------------------------


def _decode_case(b, ssm_dtype, gen, dev, R=12):
    """b live requests + 2 padded rows on scratch row R - 1: q / k / v as slices of one bf16 conv
    output row, the raw gate as slices of one projection row, the pool, the rows."""
    n, kd = b + 2, HK * DK
    y = torch.randn(n, 2 * kd + HV * DV, generator=gen).to(dev, torch.bfloat16)
    q, k, v = torch.split(y, [kd, kd, HV * DV], dim=-1)
    ab = (torch.randn(n, 2 * HV, generator=gen) * 4).to(dev, torch.bfloat16)
    A_log = torch.empty(HV).uniform_(0.1, 2.0, generator=gen).log().to(dev, torch.bfloat16)
    dt_bias = torch.randn(HV, generator=gen).to(dev, torch.bfloat16)
    gate = (ab[:, :HV], ab[:, HV:], A_log, dt_bias)  # a, b: strided, as in_proj's slices
    ssm = (torch.randn(R, HV, DK, DV, generator=gen) * 0.3).to(dev, ssm_dtype)
    rows = torch.cat([torch.randperm(R - 1, generator=gen)[:b], torch.full((2,), R - 1)])
    heads = (q.view(n, HK, DK), k.view(n, HK, DK), v.view(n, HV, DV))
    return (*heads, gate, ssm, rows.to(dev))


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b", [1, 8])
def test_decode_kernel_matches_reference_in_place(b, ssm_dtype):
    """The one-token in-place rule (kernels/gdn/decode_triton.py) at the 27B head shape (GVA 16 ->
    48 heads, dk = dv = 128) vs `reference.gated_delta_rule_recurrent` (T = 1): outputs and the
    live rows' new states, the gate computed inside and handed in, rows in any order, two padded
    rows on the scratch row (the only other row written, finite); a CUDA graph replay of the call
    equal to the eager call on the live rows."""
    pytest.importorskip("triton")
    from ddtree.kernels.gdn import fused, reference
    from ddtree.kernels.gdn.decode_triton import gated_delta_decode_triton

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(30 + b)
    q, k, v, gate, ssm0, rows = _decode_case(b, ssm_dtype, gen, dev)
    # the gating kernel's g / beta (the decode kernel gates with the same jit code, so the bf16
    # beta rounds alike; the gating kernel vs the reference is checked above)
    g, beta = fused.gdn_gating(*gate)
    live, R = rows[:b], ssm0.shape[0]
    steps = (t[:b, None] for t in (q, k, v, g, beta))
    ro, rS = reference.gated_delta_rule_recurrent(*steps, ssm0[live].float())
    free = [r for r in range(R - 1) if r not in live.tolist()]
    tol = 1e-5 if ssm_dtype == torch.float32 else 1e-2
    for given in (gate, (g, beta)):
        ssm = ssm0.clone()
        o = gated_delta_decode_triton(q, k, v, given, ssm, rows)
        torch.cuda.synchronize()
        assert o.shape == (b + 2, HV, DV) and torch.isfinite(o).all()
        assert rel(o[:b], ro[:, 0]) < 1e-2 and rel(ssm[live].float(), rS) < tol
        assert torch.equal(ssm[free], ssm0[free])
        assert torch.isfinite(ssm[R - 1].float()).all() and not torch.equal(ssm[R - 1], ssm0[R - 1])
    ssm = ssm0.clone()
    eager = gated_delta_decode_triton(q, k, v, gate, ssm, rows)  # also compiles before capture
    want = ssm.clone()
    ssm.copy_(ssm0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta_decode_triton(q, k, v, gate, ssm, rows)
    ssm.copy_(ssm0)
    graph.replay()
    torch.cuda.synchronize()
    # the padded rows race on the scratch row: compare the live rows
    assert torch.equal(out[:b], eager[:b]) and torch.equal(ssm[live], want[live])


@pytest.mark.parametrize("b", [1, 8])
def test_in_place_tree_conv_on_the_device(b):
    """The one-node tree conv writing the new windows straight into the pool's committed rows (27B
    C = 10240, bf16, K = 4): outputs vs `reference.root_causal_conv1d`, the windows bit for bit,
    two padded rows (valid False) on the scratch row, rows no request owns untouched; a CUDA graph
    replay equal to the eager call."""
    pytest.importorskip("triton")
    from ddtree.kernels.gdn import reference
    from ddtree.kernels.gdn.tree_conv import tree_causal_conv1d_triton

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(40 + b)
    R, C, n = 12, 2 * HK * DK + HV * DV, b + 2
    x = torch.randn(n, 1, C, generator=gen).to(dev, torch.bfloat16)
    pool0 = torch.randn(R, C, 3, generator=gen).to(dev, torch.bfloat16)
    w = torch.randn(C, 4, generator=gen).to(dev, torch.bfloat16)
    bias = torch.randn(C, generator=gen).to(dev, torch.bfloat16)
    rows = torch.cat([torch.randperm(R - 1, generator=gen)[:b], torch.full((2,), R - 1)]).to(dev)
    valid = torch.arange(n, device=dev)[:, None] < b
    parents = torch.full((n, 1), -1, device=dev)
    live = rows[:b]
    ry, rs = reference.root_causal_conv1d(x[:b, 0], pool0[live], w, bias)
    pool = pool0.clone()
    args = (x, parents, pool, w, bias, valid)
    y, _ = tree_causal_conv1d_triton(*args, state_rows=rows, in_place=True)
    torch.cuda.synchronize()
    assert rel(y[:b, 0], ry) < 1e-2 and (y[b:] == 0).all() and torch.equal(pool[live], rs)
    free = [r for r in range(R - 1) if r not in live.tolist()]
    assert torch.equal(pool[free], pool0[free]) and (pool[R - 1][:, -1] == 0).all()
    want = pool.clone()
    pool.copy_(pool0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = tree_causal_conv1d_triton(*args, state_rows=rows, in_place=True)
    pool.copy_(pool0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:b], y[:b]) and torch.equal(pool[live], want[live])
