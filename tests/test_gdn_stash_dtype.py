"""The tree GDN kernel with a bf16 node-state stash (DDTREE_GDN_STASH_DTYPE=bfloat16) against the fp32
reference, under Triton's CPU interpreter: every node within the proven error bound
(tests/gdn_stash_fixtures.py) in one verify, and the committed state over many rounds within the sum of
the rounds' bounds; the pool and the memory plan take the switch; the launch switches (tile, prefetch)
give the reference's numbers."""

import pytest
import torch
from gdn_stash_fixtures import U, check_bound, inputs, random_tree
from triton_utils import DEV, load_kernel_module, rel

kernel_module = load_kernel_module("ddtree.kernels.gdn.triton_tree")

from ddtree import envs  # noqa: E402
from ddtree.engine.config import GDNGeometry, stash_ssm_dtype  # noqa: E402
from ddtree.kernels.gdn import backend  # noqa: E402
from ddtree.kernels.gdn.reference import tree_gated_delta_rule  # noqa: E402

HK, HV, D = 2, 4, 16


def _verify(n, gen, s0, stash_dtype):
    par, dep = random_tree(n, gen)
    q, k, v, g, beta = inputs(n, HK, HV, D, gen)
    args = [t.to(DEV) for t in (q, k, v, g, beta, par[None], dep[None], s0)]
    buf = torch.zeros(1, n, HV, D, D, dtype=stash_dtype, device=DEV)
    o, st = kernel_module.tree_gated_delta_rule_triton(
        *args, return_node_states=True, node_states=buf
    )
    ro, rst = tree_gated_delta_rule(*args, return_node_states=True)
    return o, st, ro, rst, dep[None]


def test_bf16_stash_within_bound_in_one_verify():
    gen = torch.Generator().manual_seed(0)
    s0 = torch.randn(1, HV, D, D, generator=gen).to(DEV)
    o, st, ro, rst, dep = _verify(12, gen, s0, torch.bfloat16)
    assert st.dtype == torch.bfloat16
    worst = check_bound(st, rst, o, ro, dep, D**-0.5)
    # the stash really rounds (the bound is not met by accident of an fp32 buffer) and the bound is
    # not vacuous: the worst node uses a visible share of it
    assert rel(st, rst) > 1e-4 and worst > 0.02
    o32, st32, ro32, rst32, _ = _verify(12, torch.Generator().manual_seed(0), s0, torch.float32)
    assert rel(st32, rst32) < 1e-5  # the fp32 stash: reference-exact up to reduction order


def test_bf16_stash_commits_stay_within_the_summed_bound():
    """Round after round the committed state (a random node's, as the accept walk leaves it) is the
    rounded stash entry; its drift from the fp32 run stays under the sum of the rounds' bounds."""
    gen = torch.Generator().manual_seed(1)
    s_ref = s_bf = torch.randn(1, HV, D, D, generator=gen).to(DEV)
    budget, worst = 0.0, 0.0
    for _ in range(5):
        n = 6
        par, dep = random_tree(n, gen)
        q, k, v, g, beta = inputs(n, HK, HV, D, gen)
        common = [t.to(DEV) for t in (q, k, v, g, beta, par[None], dep[None])]
        buf = torch.zeros(1, n, HV, D, D, dtype=torch.bfloat16, device=DEV)
        _, st = kernel_module.tree_gated_delta_rule_triton(
            *common, s_bf, return_node_states=True, node_states=buf
        )
        _, rst = tree_gated_delta_rule(*common, s_ref, return_node_states=True)
        last = int(torch.randint(0, n, (), generator=gen))
        s_bf, s_ref = st[:, last].float(), rst[:, last]
        smax = max(rst.flatten(3).norm(dim=-1).amax().item(), s_ref.flatten(2).norm(dim=-1).amax())
        budget += (int(dep[last]) + 1) * U * float(smax)
        err = (s_bf - s_ref).flatten(2).norm(dim=-1).amax().item()
        assert err <= budget
        worst = max(worst, err / budget)
    assert worst > 0.01  # the drift is real, and bounded


def test_stash_dtype_switch_sizes_pool_and_plan(monkeypatch):
    from ddtree.engine.state_pool import HybridStatePool

    geo = GDNGeometry(num_layers=2, hk=HK, dk=D, hv=HV, dv=D, kernel=4)
    fp32 = geo.stash_bytes(5, "extra_buffer", "float32", "bfloat16")
    pool = HybridStatePool(geo, 2, 5, "cpu", strategy="extra_buffer")
    assert pool.stash["node_ssm"].dtype == torch.float32 and pool.stash_in_kernel
    monkeypatch.setenv(envs.GDN_STASH_DTYPE.name, "bfloat16")
    assert stash_ssm_dtype("float32") == "bfloat16"
    half = geo.stash_bytes(5, "extra_buffer", "float32", "bfloat16")
    conv = 2 * 5 * geo.conv_dim * 3 * 2
    assert half - conv == (fp32 - conv) // 2
    pool = HybridStatePool(geo, 2, 5, "cpu", strategy="extra_buffer")
    assert pool.stash["node_ssm"].dtype == torch.bfloat16 and pool.stash_in_kernel
    assert pool.ssm.dtype == torch.float32 and pool.stash_bytes == half * 2
    monkeypatch.setenv(envs.GDN_STASH_DTYPE.name, "int8")
    with pytest.raises(ValueError, match="DDTREE_GDN_STASH_DTYPE"):
        stash_ssm_dtype("float32")


@pytest.mark.parametrize("env", [{"DDTREE_GDN_TREE_BV": "16"}, {"DDTREE_GDN_TREE_PREFETCH": "1"}])
def test_launch_switches_keep_the_reference_numbers(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    opts = backend.tree_kernel_options()
    assert opts["block_v"] == int(env.get("DDTREE_GDN_TREE_BV", 0)) or opts["prefetch"]
    gen = torch.Generator().manual_seed(2)
    par, dep = random_tree(10, gen)
    args = [t.to(DEV) for t in (*inputs(10, HK, HV, D, gen), par[None], dep[None])]
    s0 = torch.randn(1, HV, D, D, generator=gen).to(DEV)
    o, st = kernel_module.tree_gated_delta_rule_triton(*args, s0, return_node_states=True, **opts)
    ro, rst = tree_gated_delta_rule(*args, s0, return_node_states=True)
    assert rel(o, ro) < 1e-4 and rel(st, rst) < 1e-4


def test_launch_switch_errors_name_the_variable(monkeypatch):
    assert backend.tree_kernel_options() == dict(block_v=None, num_warps=4, prefetch=False)
    monkeypatch.setenv(envs.GDN_TREE_BV.name, "24")
    with pytest.raises(ValueError, match="DDTREE_GDN_TREE_BV"):
        backend.tree_kernel_options()
    monkeypatch.setenv(envs.GDN_TREE_BV.name, "auto")
    monkeypatch.setenv(envs.GDN_TREE_WARPS.name, "3")
    with pytest.raises(ValueError, match="DDTREE_GDN_TREE_WARPS"):
        backend.tree_kernel_options()
    from ddtree.engine.state_pool import HybridStatePool  # the pool checks them when it is built

    geo = GDNGeometry(num_layers=1, hk=HK, dk=D, hv=HV, dv=D, kernel=4)
    with pytest.raises(ValueError, match="DDTREE_GDN_TREE_WARPS"):
        HybridStatePool(geo, 1, 2, "cpu")
