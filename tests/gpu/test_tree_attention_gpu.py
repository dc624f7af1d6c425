"""Tree attention on the device: the Triton kernel and the Gluon (sm_90) kernel against the PyTorch
reference on random ragged batches (trees, causal chains, decode, prefill; contexts up to 32k; pages
of 16 and 1), output poisoned with NaN first, at the serving shape (32 query heads, 8 KV heads, head
dim 128, bf16), and at the hybrid Qwen3.6-27B target's gated attention (24 query heads, 4 KV heads,
head dim 256: the Triton kernel, every tile config its timing sweep tries). Formerly the
correctness passes of studies/gpu_tree_attention.py and studies/gpu_tree_attention_hopper.py."""

import pytest
import torch

pytestmark = pytest.mark.gpu

HQ, HKV, D, DT = 32, 8, 128, torch.bfloat16
TOL = 1e-2
CASES = [  # (q_lens, kv_lens, page, tree)
    ([17, 17, 17, 17], [32768, 8192 + 17, 1000, 17], 16, True),
    ([65, 65], [16384 + 65, 3000], 16, True),
    ([65, 3, 1], [4000 + 65, 70, 1], 16, True),
    ([1, 1, 1], [32768, 5, 3001], 16, False),
    ([16, 16], [20000, 16], 16, False),
    ([512, 37, 1], [512, 4000, 70], 16, False),
    ([9, 9], [5000, 700], 1, True),
    # one-node tails (rows = 64 k + 4) beside full blocks, so the swapped tail block runs next to
    # the 64-row path
    ([40, 33], [9000, 5000], 16, False),
    ([17, 33, 80], [3000, 17000 + 33, 900], 16, False),
    ([66, 65, 80, 17], [20000, 7000 + 65, 1000, 17], 16, True),
    ([33], [70], 16, True),
]


def _kernel():
    return pytest.importorskip("ddtree.kernels.tree_attention.launch")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def problem(q_lens, kv_lens, page, tree, seed, heads=(HQ, HKV, D)):
    """Random paged pools (pages scattered), q and tree masks on the device; heads = (query heads,
    KV heads, head dim)."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    b = len(q_lens)
    pages = [-(-kv // page) for kv in kv_lens]
    total = sum(pages) + 4
    perm = torch.randperm(total, generator=gen)
    table = torch.zeros(b, max(pages) + 1, dtype=torch.int64)
    o = 0
    for i, p in enumerate(pages):
        table[i, :p] = perm[o : o + p]
        o += p
    k_pool = torch.randn(total * page, hkv, d, generator=gen).to(dev, DT)
    v_pool = torch.randn(total * page, hkv, d, generator=gen).to(dev, DT)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dev, DT)
    indptr = torch.zeros(b + 1, dtype=torch.int64)
    indptr[1:] = torch.tensor(q_lens).cumsum(0)
    mask = None
    if tree:
        n = max(q_lens)
        mask = torch.zeros(b, n, n, dtype=torch.bool)
        for i in range(b):
            m = torch.eye(n, dtype=torch.bool)
            for c in range(1, n):
                m[c] |= m[int(torch.randint(0, c, (1,), generator=gen))]
            mask[i] = m
        mask = mask.to(dev)
    return dict(
        q=q,
        k_pool=k_pool,
        v_pool=v_pool,
        block_table=table.to(dev),
        qo_indptr=indptr.to(dev),
        kv_lens=torch.tensor(kv_lens, device=dev),
        page_size=page,
        scale=d**-0.5,
        max_q_len=max(q_lens),
        max_kv_len=max(kv_lens),
        tree_mask=mask,
    )


def run(p, **kw):
    """(error vs the fp32 reference, the plan that ran) of one poisoned-output call."""
    from ddtree.kernels.tree_attention.reference import paged_attention_reference

    k = _kernel()
    out = torch.full_like(p["q"], float("nan"))
    pos = [
        p[n]
        for n in (
            "q",
            "k_pool",
            "v_pool",
            "block_table",
            "qo_indptr",
            "kv_lens",
            "page_size",
            "scale",
        )
    ]
    _, plan = k.paged_attention_plan(
        *pos,
        max_q_len=p["max_q_len"],
        max_kv_len=p["max_kv_len"],
        tree_mask=p["tree_mask"],
        out=out,
        **kw,
    )
    ref = paged_attention_reference(p["q"].float(), *pos[1:], tree_mask=p["tree_mask"])
    assert torch.isfinite(out).all(), "unwritten or NaN output rows"
    return rel(out, ref), plan


@pytest.mark.parametrize("splits", [None, 1, 7])
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_triton_kernel_matches_reference(ci, splits):
    q_lens, kv_lens, page, tree = CASES[ci]
    err, plan = run(problem(q_lens, kv_lens, page, tree, ci), num_splits=splits, hopper_ctx=False)
    assert plan.kernel == "triton" and err < TOL, (plan, err)


WIDE = (24, 4, 256)  # the hybrid 27B target's gated attention
WIDE_CASES = [  # its rounds: B=64 trees at 1k (batch 1 and 3), the DFLASH chain, AR, 16k, ragged
    ([65], [1024 + 65], 16, True),
    ([65, 65, 65], [1024 + 65, 3000, 65], 16, True),
    ([16], [1024 + 16], 16, True),
    ([1, 1], [1025, 300], 16, False),
    ([65], [16384 + 65], 16, True),
    ([65, 16, 1], [5000 + 65, 700, 33], 16, True),
]


def _wide_configs(rows):
    """The default tiles and the head-dim-256 configs the sweep times (rows: q tokens x GQA group)."""
    from ddtree.kernels.tree_attention.tuning import wide_head_candidates

    return [None, *wide_head_candidates(rows)]


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("ci", range(len(WIDE_CASES)))
def test_wide_head_matches_reference(ci, splits):
    """Head dim 256 (no Gluon kernel there): the default tiles and every swept config, split counts
    chosen, one, and three."""
    q_lens, kv_lens, page, tree = WIDE_CASES[ci]
    p = problem(q_lens, kv_lens, page, tree, 200 + ci, heads=WIDE)
    rows = max(q_lens) * WIDE[0] // WIDE[1]
    for cfg in _wide_configs(rows):
        err, plan = run(p, num_splits=splits, config=cfg)
        assert plan.kernel == "triton" and err < TOL, (cfg, plan, err)


def _hopper_configs():
    from ddtree.kernels.tree_attention.hopper import HopperConfig

    return [
        HopperConfig(),
        HopperConfig(128, 128, 3),
        HopperConfig(128, 64, 3),
        HopperConfig(tail_n=0),
    ]


@pytest.mark.parametrize("variant", ["default", "splits 3", "splits 7", "configs"])
@pytest.mark.parametrize("ci", [i for i, c in enumerate(CASES) if c[2] == 16])
def test_hopper_kernel_matches_reference(ci, variant):
    """The default dispatch (the Gluon kernel where `dispatch.gluon_unsupported` gives no reason),
    forced split counts, and every timed HopperConfig."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is sm_90 only")
    q_lens, kv_lens, page, tree = CASES[ci]
    p = problem(q_lens, kv_lens, page, tree, 100 + ci)
    if variant == "configs":
        for cfg in _hopper_configs():
            err, plan = run(p, hopper_ctx=cfg)
            assert plan.kernel == "hopper" and plan.hopper == cfg and err < TOL, (cfg, plan, err)
        return
    splits = None if variant == "default" else int(variant.split()[1])
    err, plan = run(p, num_splits=splits, hopper_ctx=True)
    assert err < TOL, (plan, err)
    assert plan.fallback is None or plan.kernel == "triton", plan


def test_default_dispatch_takes_the_gluon_kernel_on_h200():
    """On the H200 (sm_90, Triton 3.6) the default plan of a 65-node tree and of decode is the Gluon
    kernel: a dispatch that silently fell back would pass the comparisons above on the Triton kernel
    alone."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    for q_lens, kv_lens, tree in (([65], [16384 + 65], True), ([1, 1], [4096, 900], False)):
        err, plan = run(problem(q_lens, kv_lens, 16, tree, 7))
        assert plan.kernel == "hopper" and plan.fallback is None and err < TOL, plan


def test_graph_replay_matches_eager():
    """The default launch replayed from a CUDA graph (the merge as a programmatic dependent there
    too) equals the eager call, after other inputs ran in between."""
    k = _kernel()
    p = problem([65, 1], [16384 + 65, 3000], 16, True, 3)
    pos = [
        p[n]
        for n in (
            "q",
            "k_pool",
            "v_pool",
            "block_table",
            "qo_indptr",
            "kv_lens",
            "page_size",
            "scale",
        )
    ]
    kw = dict(max_q_len=p["max_q_len"], max_kv_len=p["max_kv_len"], tree_mask=p["tree_mask"])
    eager = k.paged_attention(*pos, **kw)
    out = torch.empty_like(eager)
    k.paged_attention(*pos, out=out, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k.paged_attention(*pos, out=out, **kw)
    out.fill_(float("nan"))
    k.paged_attention(torch.randn_like(p["q"]), *pos[1:], **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
