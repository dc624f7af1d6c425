from typing import NamedTuple

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from ddtree.kernels.gdn import (
    causal_conv1d_prefill,
    causal_conv1d_step,
    causal_conv1d_varlen,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gather_node_state,
    gdn_gating,
    replay_conv_path,
    replay_path,
    tree_causal_conv1d,
    tree_gated_delta_rule,
)

TOL = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class Given(NamedTuple):
    """A decay gate whose g / beta are given: what a state context's rule takes besides the
    layer's `fused.GateInputs` (anything with values())."""

    g: torch.Tensor
    beta: torch.Tensor

    def values(self):
        return self.g, self.beta


def rule_inputs(b, T, Hk, Hv, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, T, Hk, dk, generator=gen)
    k = torch.randn(b, T, Hk, dk, generator=gen)
    v = torch.randn(b, T, Hv, dv, generator=gen)
    a = torch.randn(b, T, Hv, generator=gen)
    bb = torch.randn(b, T, Hv, generator=gen)
    A_log = torch.empty(Hv).uniform_(0.1, 2.0, generator=gen).log()
    g, beta = gdn_gating(a, bb, A_log, torch.randn(Hv, generator=gen))
    S0 = torch.randn(b, Hv, dk, dv, generator=gen)
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("T", [1, 5, 64, 100, 130])
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4)])
@pytest.mark.parametrize("carry", [False, True])
def test_rules_match_transformers(T, Hk, Hv, carry):
    q, k, v, g, beta, S0 = rule_inputs(2, T, Hk, Hv, seed=T)
    S0 = S0 if carry else None
    kw = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_hc, s_hc = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=64, **kw)
    o_hr, s_hr = hf.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    o_r, s_r = gated_delta_rule_recurrent(q, k, v, g, beta, S0)
    for cs in (64, 16):
        o_c, s_c = gated_delta_rule_chunked(q, k, v, g, beta, S0, chunk_size=cs)
        assert rel(o_c, o_r) < TOL and rel(s_c, s_r) < TOL
        assert o_c.shape == (2, T, Hv, 8) and s_c.dtype == torch.float32
    assert rel(o_r, o_hr) < TOL and rel(s_r, s_hr) < TOL
    assert rel(o_r, o_hc) < TOL and rel(s_r, s_hc) < TOL


def test_rule_varlen_equals_separate():
    lens = [3, 70, 1, 17]
    q, k, v, g, beta, _ = rule_inputs(1, sum(lens), 2, 4, seed=1)
    S0 = torch.randn(len(lens), 4, 16, 8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    for fn in (gated_delta_rule_chunked, gated_delta_rule_recurrent):
        o, s = fn(q, k, v, g, beta, S0, cu_seqlens=cu)
        for i in range(len(lens)):
            seg = slice(cu[i], cu[i + 1])
            o_i, s_i = gated_delta_rule_recurrent(
                q[:, seg], k[:, seg], v[:, seg], g[:, seg], beta[:, seg], S0[i : i + 1]
            )
            assert rel(o[:, seg], o_i) < TOL and rel(s[i : i + 1], s_i) < TOL


def test_conv_matches_transformers():
    C, K, T = 24, 4, 9
    x, w = torch.randn(T, C), torch.randn(C, K)
    y, state = causal_conv1d_prefill(x, w)
    y_hf = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    assert rel(y, y_hf) < TOL and torch.equal(state, x[-(K - 1) :].t())
    xs, conv = torch.randn(3, C), torch.randn(3, C, K - 1)
    hf_state = torch.cat([torch.zeros(3, C, 1), conv], -1)  # transformers keeps K columns
    y_hf = hf.causal_conv1d_update(xs[..., None], hf_state, w, None, "silu")[..., 0]
    y, new = causal_conv1d_step(xs, conv, w)
    assert rel(y, y_hf) < TOL and rel(new, hf_state[..., 1:]) < TOL
    # input state untouched, shifted copy returned
    assert torch.equal(conv[:, :, 1:], new[:, :, :-1])


@pytest.mark.parametrize("split", [0, 1, 2, 7])
def test_conv_prefill_then_steps_equals_one_conv(split):
    C, K, T = 16, 4, 12
    x, w, bias, s0 = torch.randn(T, C), torch.randn(C, K), torch.randn(C), torch.randn(C, K - 1)
    y_all, s_all = causal_conv1d_prefill(x, w, s0, bias)
    y1, s = causal_conv1d_prefill(x[:split], w, s0, bias)
    ys = [y1]
    for t in range(split, T):
        y_t, s = causal_conv1d_step(x[t][None], s[None], w, bias)
        ys.append(y_t)
        s = s[0]
    assert rel(torch.cat(ys), y_all) < TOL and rel(s, s_all) < TOL
    lens = [split or 1, T - (split or 1)]
    cu = torch.tensor([0, lens[0], T])
    st = torch.randn(2, C, K - 1)
    y, s_v = causal_conv1d_varlen(x, w, cu, st, bias)
    for i in range(2):
        y_i, s_i = causal_conv1d_prefill(x[cu[i] : cu[i + 1]], w, st[i], bias)
        assert rel(y[cu[i] : cu[i + 1]], y_i) < TOL and rel(s_v[i], s_i) < TOL


def test_layer_forward_matches_transformers_module():
    cfg = Qwen3_5TextConfig(
        hidden_size=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    layer = hf.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    h = torch.randn(2, 11, 64)
    with torch.no_grad():
        ref = layer(h)
        qkv = layer.in_proj_qkv(h).reshape(-1, layer.conv_dim)
        cu = torch.tensor([0, 11, 22])
        qkv, _ = causal_conv1d_varlen(qkv, layer.conv1d.weight[:, 0], cu)
        q, k, v = qkv.reshape(2, 11, -1).split([32, 32, 32], -1)
        g, beta = gdn_gating(layer.in_proj_a(h), layer.in_proj_b(h), layer.A_log, layer.dt_bias)
        o, _ = gated_delta_rule_chunked(
            q.reshape(2, 11, 2, 16), k.reshape(2, 11, 2, 16), v.reshape(2, 11, 4, 8), g, beta
        )
        o = layer.norm(o.reshape(-1, 8), layer.in_proj_z(h).reshape(-1, 8))
        out = layer.out_proj(o.reshape(2, 11, -1))
    assert rel(out, ref) < TOL


def random_tree(n, max_depth, gen):
    """Parents/depths with node 0 the root, then shuffled so flat order is not chain order."""
    parents, depths = [-1], [0]
    for _ in range(1, n):
        cand = [j for j in range(len(parents)) if depths[j] < max_depth]
        p = cand[torch.randint(len(cand), (1,), generator=gen).item()]
        parents.append(p)
        depths.append(depths[p] + 1)
    perm = torch.randperm(n, generator=gen).tolist()  # old index j lands at perm[j]
    new_par, new_dep = [0] * n, [0] * n
    for j in range(n):
        new_par[perm[j]] = -1 if parents[j] < 0 else perm[parents[j]]
        new_dep[perm[j]] = depths[j]
    return new_par, new_dep


def pad_trees(trees, n):
    parents = torch.full((len(trees), n), -1)
    depths = torch.full((len(trees), n), -1)
    for i, (p, d) in enumerate(trees):
        parents[i, : len(p)], depths[i, : len(d)] = torch.tensor(p), torch.tensor(d)
    return parents, depths


def chain(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_case(trees, seed=0, Hk=2, Hv=4, C=12, K=4):
    n = max(len(p) for p, _ in trees)
    parents, depths = pad_trees(trees, n)
    b = len(trees)
    q, k, v, g, beta, S0 = rule_inputs(b, n, Hk, Hv, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x, w, conv = (
        torch.randn(b, n, C, generator=gen),
        torch.randn(C, K, generator=gen),
        torch.randn(b, C, K - 1),
    )
    pad = depths < 0
    for t in (q, k, v, g, beta, x):  # padding carries garbage
        t[pad] = float("nan")
    return parents, depths, (q, k, v, g, beta), S0, x, w, conv


def check_tree(trees, seed):
    parents, depths, ins, S0, x, w, conv = tree_case(trees, seed)
    valid = depths >= 0
    o, states = tree_gated_delta_rule(*ins, parents, depths, S0, return_node_states=True)
    y, conv_states = tree_causal_conv1d(x, parents, conv, w, valid=valid, return_node_states=True)
    assert torch.isfinite(o).all() and torch.isfinite(states).all() and torch.isfinite(y).all()
    assert (o[~valid] == 0).all() and (y[~valid] == 0).all()
    for r, (par, _) in enumerate(trees):
        for node in range(len(par)):
            path = torch.tensor(chain(par, node))
            o_ref, s_ref = gated_delta_rule_recurrent(
                *(t[r : r + 1, path] for t in ins), S0[r : r + 1]
            )
            assert rel(o[r, node], o_ref[0, -1]) < TOL and rel(states[r, node], s_ref[0]) < TOL
            y_ref, c_ref = causal_conv1d_prefill(x[r, path], w, conv[r])
            assert rel(y[r, node], y_ref[-1]) < TOL and torch.equal(conv_states[r, node], c_ref)
    o2, none = tree_gated_delta_rule(*ins, parents, depths, S0, max_depth=int(depths.max()))
    assert none is None and torch.equal(o, o2)
    return parents, depths, ins, S0, x, w, conv, states, conv_states


def test_tree_flat_order_differs_from_chain_order():
    # 1 and 2 are both children of the root; 3's parent is 2, 4's is 3, 5's is 1
    check_tree(
        [([-1, 0, 0, 2, 3, 1], [0, 1, 1, 2, 3, 2]), ([3, 0, -1, 2, 1], [2, 3, 0, 1, 4])], seed=3
    )


@pytest.mark.parametrize("seed", range(4))
def test_random_trees_match_sequential_chains(seed):
    gen = torch.Generator().manual_seed(seed)
    trees = [
        random_tree(torch.randint(1, 31, (1,), generator=gen).item(), 6, gen) for _ in range(2)
    ]
    check_tree(trees, seed)


def test_chain_tree_equals_sequential():
    n = 9
    parents, depths, ins, S0, x, w, conv = tree_case(
        [(list(range(-1, n - 1)), list(range(n)))] * 2, seed=5
    )
    o, _ = tree_gated_delta_rule(*ins, parents, depths, S0)
    o_ref, _ = gated_delta_rule_chunked(*ins, S0)
    y, _ = tree_causal_conv1d(x, parents, conv, w)
    for r in range(2):
        y_ref, _ = causal_conv1d_prefill(x[r], w, conv[r])
        assert rel(y[r], y_ref) < TOL
    assert rel(o, o_ref) < TOL


@pytest.mark.parametrize("seed", range(3))
def test_replay_equals_gathered_node_state(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    trees = [
        random_tree(torch.randint(1, 31, (1,), generator=gen).item(), 6, gen) for _ in range(2)
    ]
    parents, depths, ins, S0, x, w, conv, states, conv_states = check_tree(trees, seed)
    accepted = torch.tensor([torch.randint(len(p), (1,), generator=gen).item() for p, _ in trees])
    paths = [chain(trees[r][0], accepted[r].item()) for r in range(2)]
    L = max(len(p) for p in paths)
    path = torch.tensor([p + [-1] * (L - len(p)) for p in paths])
    by_copy = gather_node_state(states, accepted)
    by_replay = replay_path(*ins, path, S0)
    assert by_copy.shape == S0.shape and rel(by_replay, by_copy) < TOL
    assert torch.equal(replay_conv_path(x, path, conv), gather_node_state(conv_states, accepted))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_root_conv_equals_the_one_node_tree_conv(dtype):
    """AR rounds run `root_causal_conv1d`: bit-identical to `tree_causal_conv1d` on one-node trees
    (outputs and node states), so AR and speculative rounds keep sharing one conv numerics."""
    from ddtree.kernels.gdn import root_causal_conv1d, tree_causal_conv1d

    gen = torch.Generator().manual_seed(3)
    b, C = 3, 96
    x, w = (torch.randn(*s, generator=gen).to(dtype) for s in ((b, C), (C, 4)))
    st, bias = torch.randn(b, C, 3, generator=gen).to(dtype), torch.randn(C).to(dtype)
    y, s = root_causal_conv1d(x, st, w, bias)
    parents, valid = torch.full((b, 1), -1), torch.ones(b, 1, dtype=torch.bool)
    ty, ts = tree_causal_conv1d(x[:, None], parents, st, w, bias, valid, True)
    assert torch.equal(y, ty[:, 0]) and torch.equal(s, ts[:, 0])
