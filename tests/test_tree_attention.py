"""Split-KV paged tree attention (Triton) vs the plain PyTorch oracle, and through the backend seam.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before the kernel
module is imported). Skips when triton is not installed.
"""

import pytest
import torch
from triton_utils import DEV, load_kernel_module, rel

kernel_module = load_kernel_module("ddtree.kernels.tree_attention.launch")

from ddtree import envs  # noqa: E402
from ddtree.attention.backend import AttentionMetadata, DraftAttentionMetadata, get_backend  # noqa: E402
from ddtree.kernels.tree_attention import paged_attention_reference  # noqa: E402
from ddtree.kernels.tree_attention.tuning import KernelConfig, choose_num_splits, ctas_per_sm  # noqa: E402

paged_attention = kernel_module.paged_attention

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def random_tree_mask(n, gen):
    """Random parent array (parent index < child, root 0) -> [n, n] ancestors-and-self mask."""
    mask = torch.eye(n, dtype=torch.bool)
    for c in range(1, n):
        p = int(torch.randint(0, c, (1,), generator=gen))
        mask[c] |= mask[p]
    return mask


def paged_inputs(q_lens, kv_lens, page, hq, hkv, d, dtype, gen, tree=False):
    """Random q and K/V pools, each request's pages scattered at random; mask padded to max q_len."""
    b = len(q_lens)
    pages = [-(-kv // page) for kv in kv_lens]
    max_pages = max(pages) + 1
    total = sum(pages) + 5
    perm = torch.randperm(total, generator=gen)
    block_table = torch.full(
        (b, max_pages), total + 7, dtype=torch.int64
    )  # unused entries: out of range
    o = 0
    for i, p in enumerate(pages):
        block_table[i, :p] = perm[o : o + p]
        o += p
    k_pool = torch.randn(total * page, hkv, d, generator=gen).to(dtype)
    v_pool = torch.randn(total * page, hkv, d, generator=gen).to(dtype)
    q = (torch.randn(sum(q_lens), hq, d, generator=gen) * 2).to(dtype)
    qo_indptr = torch.zeros(b + 1, dtype=torch.int64)
    qo_indptr[1:] = torch.tensor(q_lens).cumsum(0)
    mask = None
    if tree:
        n = max(q_lens)
        mask = torch.stack([random_tree_mask(n, gen) for _ in range(b)])
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return (
        to(q),
        to(k_pool),
        to(v_pool),
        to(block_table),
        to(qo_indptr),
        torch.tensor(kv_lens, device=DEV),
        to(mask),
    )


def check(
    q_lens,
    kv_lens,
    page,
    dtype,
    tree,
    num_splits=None,
    hq=4,
    hkv=2,
    d=32,
    seed=0,
    config=None,
    **kw,
):
    gen = torch.Generator().manual_seed(seed)
    q, kp, vp, bt, indptr, kvl, mask = paged_inputs(
        q_lens, kv_lens, page, hq, hkv, d, dtype, gen, tree
    )
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    _, plan = kernel_module.paged_attention_plan(
        q,
        kp,
        vp,
        bt,
        indptr,
        kvl,
        page,
        scale,
        max_q_len=max(q_lens),
        max_kv_len=max(kv_lens),
        tree_mask=mask,
        num_splits=num_splits,
        config=config,
        out=out,
        **kw,
    )
    ref = paged_attention_reference(
        q.double(),
        kp.double(),
        vp.double(),
        bt,
        indptr,
        kvl,
        page,
        scale,
        tree_mask=mask,
        acc_dtype=torch.float64,
    )
    assert torch.isfinite(out).all(), "unwritten or NaN output rows"
    err = rel(out, ref)
    print(
        f"q_lens={q_lens} kv_lens={kv_lens} page={page} {dtype} tree={tree} splits={num_splits}: rel {err:.2e}"
    )
    assert err < TOL[dtype], err
    return plan
    return err


# (q_lens, kv_lens, page, tree, num_splits): decode, ragged decode, chain, tree verify (1..B+1 nodes, B = 16
# plus one 65-node tree), empty splits, causal ragged extend, page sizes 1 and 16, contexts up to ~2k.
CASES = [
    ([1], [1], 16, False, None),
    ([1, 1, 1], [5, 700, 33], 16, False, 4),
    ([1, 1], [2048, 17], 1, False, 8),
    ([1, 1], [129, 3], 16, True, 2),
    ([2, 2], [40, 2], 16, True, 1),
    ([9, 9], [300, 9], 16, True, 3),
    ([17, 17, 17], [1200, 17, 500], 16, True, 5),
    ([17, 17], [200, 64], 1, True, 2),
    ([65], [1100], 16, True, 2),
    ([5, 5], [20, 300], 16, True, 8),
    ([4, 4], [70, 2000], 16, False, 3),
    ([37, 1, 0, 12], [37, 900, 50, 300], 16, False, None),
    ([100], [260], 1, False, 1),
]


@pytest.mark.parametrize("q_lens,kv_lens,page,tree,splits", CASES)
def test_kernel_fp32(q_lens, kv_lens, page, tree, splits):
    check(q_lens, kv_lens, page, torch.float32, tree, splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "q_lens,kv_lens,page,tree,splits", [CASES[2], CASES[6], CASES[8], CASES[11]]
)
def test_kernel_half(q_lens, kv_lens, page, tree, splits, dtype):
    check(q_lens, kv_lens, page, dtype, tree, splits)


@pytest.mark.parametrize("seed", range(3))
def test_random_tree_sizes(seed):
    """Trees of 1..B+1 nodes (B = 16) with random parents, two requests of different context lengths."""
    gen = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 18, (1,), generator=gen))
    kv = [n + int(torch.randint(0, 600, (1,), generator=gen)) for _ in range(2)]
    check(
        [n, n],
        kv,
        16,
        torch.float32,
        True,
        num_splits=int(torch.randint(1, 5, (1,), generator=gen)),
        hq=8,
        hkv=2,
        d=16,
        seed=seed,
    )


def test_gqa_group_one_and_head_dim_64():
    check([3, 3], [50, 130], 16, torch.float32, True, num_splits=2, hq=2, hkv=2, d=64)


@pytest.mark.parametrize(
    "cfg",
    [
        KernelConfig(64, 32, 4, 3, tail_m=0),
        KernelConfig(32, 128, 4, 2),
        KernelConfig(16, 64, 4, 3),
        KernelConfig(128, 64, 8, 3, tail_m=32),
        KernelConfig(64, 64, 4, 3, tree_n=64, tail_split=False),
        KernelConfig(256, 32, 16, 2, tree_n=32),
        KernelConfig(64, 64, 4, 5),
        KernelConfig(16, 128, 4, 5, tail_split=False),
    ],
)
def test_tile_configs(cfg):
    """Tile shapes and the small-tail path (65 nodes x GQA 2 = 2 x 64 + 2 rows) agree with the oracle."""
    check([65, 65], [260, 65], 16, torch.float32, True, num_splits=2, config=cfg)
    check([40, 3], [150, 90], 16, torch.float32, False, num_splits=2, config=cfg)


@pytest.mark.parametrize("tail_split", [False, True])
def test_split_edges(tail_split):
    """Tree tiles past a context that is / is not a multiple of the tile, more splits than context tiles (empty
    splits), and the new tokens alone (no context)."""
    cfg = KernelConfig(32, 32, 4, 2, tail_m=0, tree_n=16, tail_split=tail_split)
    check([9, 9, 9], [9 + 64, 9 + 70, 9], 16, torch.float32, True, num_splits=2, config=cfg)
    check([9, 9, 9], [9 + 64, 9 + 70, 9], 16, torch.float32, True, num_splits=6, config=cfg)
    check([20, 1], [20 + 33, 1 + 31], 1, torch.float32, False, num_splits=3, config=cfg)


def test_num_splits_fill_the_gpu():
    # b = 1, 65-node tree, 8 KV heads, GQA 4 -> 5 row blocks per KV head: 40 programs per split, 2 per SM
    s = choose_num_splits(40, 16384, 64, 264)
    assert 0.85 * 264 <= 40 * s <= 264
    assert choose_num_splits(320, 8192, 64, 264) == 3  # b = 8: 960 programs, 3.6 waves
    assert 0.85 * 396 <= 8 * choose_num_splits(8, 16384, 64, 396) <= 396  # AR decode, 3 per SM
    assert choose_num_splits(8, 100, 64, 396) == 1  # two tiles: nothing to split
    assert choose_num_splits(5000, 16384, 64, 264) == 1
    assert ctas_per_sm(255, 98816, 4) == 2 and ctas_per_sm(162, 39424, 4) == 3
    # tail split: the count is chosen for the context tiles, plus one split for the masked tail
    assert (
        choose_num_splits(40, 16384, 64, 264, tail_split=True)
        == choose_num_splits(40, 16384, 64, 264) + 1
    )
    assert choose_num_splits(5000, 16384, 64, 264, tail_split=True) == 1


def _meta(q_lens, kv_lens, bt, page, mask):
    indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    indptr[1:] = torch.tensor(q_lens).cumsum(0)
    lpos = torch.cat([torch.arange(kv - q, kv) for q, kv in zip(q_lens, kv_lens)])
    ridx = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    btc = bt.cpu()
    slots = btc[ridx, lpos // page] * page + lpos % page
    return AttentionMetadata(
        q_lens=list(q_lens),
        kv_lens=list(kv_lens),
        qo_indptr=indptr.to(DEV),
        kv_lens_t=torch.tensor(kv_lens, device=DEV),
        block_table=bt,
        slot_mapping=slots.to(DEV),
        page_size=page,
        tree_mask=mask,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["prefill", "decode", "tree", "chain"])
def test_backend_extend_matches_torch(kind, dtype):
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, page = 8, 2, 32, 16
    q_lens = {
        "prefill": [30, 7, 64],
        "decode": [1, 1, 1],
        "tree": [13, 13, 13],
        "chain": [6, 6, 6],
    }[kind]
    kv_lens = [q + c for q, c in zip(q_lens, [0, 400, 95])]
    q, kp, vp, bt, _, _, mask = paged_inputs(
        q_lens, kv_lens, page, hq, hkv, d, dtype, gen, kind == "tree"
    )
    k_new = torch.randn(q.shape[0], hkv, d, generator=gen).to(dtype).to(DEV)
    v_new = torch.randn(q.shape[0], hkv, d, generator=gen).to(dtype).to(DEV)
    meta = _meta(q_lens, kv_lens, bt, page, mask)
    cache_a, cache_b = (kp.clone(), vp.clone()), (kp.clone(), vp.clone())
    ours = get_backend("triton").extend(q, k_new, v_new, cache_a, meta, d**-0.5)
    ref = get_backend("torch").extend(q, k_new, v_new, cache_b, meta, d**-0.5)
    assert torch.equal(cache_a[0], cache_b[0]) and torch.equal(cache_a[1], cache_b[1])
    err = rel(ours, ref)
    print(f"backend {kind} {dtype}: rel {err:.2e}")
    assert err < TOL[dtype], err


def test_force_reference_switch(monkeypatch):
    monkeypatch.setenv("DDTREE_REFERENCE", "attention")
    backend = get_backend("triton")
    assert backend.force_reference and backend._use_reference(torch.empty(1, 1, 32, device=DEV))
    gen = torch.Generator().manual_seed(3)
    q, kp, vp, bt, _, _, mask = paged_inputs([5], [50], 16, 4, 2, 32, torch.float32, gen, True)
    meta = _meta([5], [50], bt, 16, mask)
    k_new, v_new = torch.randn(5, 2, 32, device=DEV), torch.randn(5, 2, 32, device=DEV)
    a = backend.extend(q, k_new, v_new, (kp.clone(), vp.clone()), meta, 0.2)
    b = get_backend("torch").extend(q, k_new, v_new, (kp.clone(), vp.clone()), meta, 0.2)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "causal,window", [(False, None), (True, None), (True, 5), (True, 40), (False, 3)]
)
def test_backend_draft_block_matches_torch(causal, window):
    """Drafter block attention: cached context (paged) + the block's own K/V, ragged context lengths."""
    gen = torch.Generator().manual_seed(11)
    b, S, hq, hkv, d, page = 3, 8, 8, 2, 32, 16
    ctx = [0, 45, 300]
    q, kp, vp, bt, _, _, _ = paged_inputs(
        [1] * b, [c + 1 for c in ctx], page, hq, hkv, d, torch.float32, gen
    )
    q = torch.randn(b, S, hq, d, generator=gen).to(DEV)
    k, v = (torch.randn(b, S, hkv, d, generator=gen).to(DEV) for _ in range(2))
    lens = torch.tensor(ctx, device=DEV)
    meta = DraftAttentionMetadata(
        ctx_lens=ctx,
        ctx_lens_t=lens,
        block_table=bt,
        block_positions=lens[:, None] + torch.arange(S, device=DEV),
        page_size=page,
    )
    ours = get_backend("triton").draft_block(q, k, v, (kp, vp), meta, d**-0.5, causal, window)
    ref = get_backend("torch").draft_block(q, k, v, (kp, vp), meta, d**-0.5, causal, window)
    err = rel(ours, ref)
    print(f"draft_block causal={causal} window={window}: rel {err:.2e}")
    assert err < TOL[torch.float32], err


def test_kernel_new_kv_full_visibility():
    """new_kv (K/V of the new tokens passed alongside, not in the pools) with non-causal visibility."""
    gen = torch.Generator().manual_seed(5)
    q_lens, kv_lens = [6, 16, 1], [6, 200, 70]
    q, kp, vp, bt, indptr, kvl, _ = paged_inputs(q_lens, kv_lens, 16, 4, 2, 32, torch.float32, gen)
    k_new, v_new = (torch.randn(q.shape[0], 2, 32, generator=gen).to(DEV) for _ in range(2))
    for causal in (False, True):
        kw = dict(causal=causal, new_kv=(k_new, v_new))
        out = paged_attention(
            q, kp, vp, bt, indptr, kvl, 16, 0.3, max_q_len=16, max_kv_len=200, num_splits=3, **kw
        )
        ref = paged_attention_reference(
            q.double(),
            kp.double(),
            vp.double(),
            bt,
            indptr,
            kvl,
            16,
            0.3,
            acc_dtype=torch.float64,
            causal=causal,
            new_kv=(k_new.double(), v_new.double()),
        )
        assert rel(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize(
    "causal,new_kv,splits", [(True, False, 3), (True, True, 1), (False, True, 4)]
)
def test_kernel_sliding_window(causal, new_kv, splits):
    """A sliding window applied in the kernel == the reference's window mask: decode, causal extend and
    drafter-style blocks (new_kv), windows of one token, shorter than a tile, and wider than the context
    (== no window); a short window changes the result, so the comparison can fail."""
    gen = torch.Generator().manual_seed(21)
    q_lens, kv_lens = [1, 6, 16], [300, 90, 200]
    q, kp, vp, bt, indptr, kvl, _ = paged_inputs(q_lens, kv_lens, 16, 4, 2, 32, torch.float32, gen)
    ext = tuple(torch.randn(q.shape[0], 2, 32, generator=gen).to(DEV) for _ in range(2))
    pos = (bt, indptr, kvl, 16, 0.3)

    def ref(window):
        kv = tuple(t.double() for t in ext) if new_kv else None
        qkv = (q.double(), kp.double(), vp.double())
        return paged_attention_reference(
            *qkv, *pos, causal=causal, new_kv=kv, window=window, acc_dtype=torch.float64
        )

    for window in (1, 3, 37, 1000):
        kw = dict(causal=causal, new_kv=ext if new_kv else None, num_splits=splits)
        out = paged_attention(q, kp, vp, *pos, max_q_len=16, max_kv_len=300, window=window, **kw)
        assert torch.isfinite(out).all()
        assert rel(out, ref(window)) < TOL[torch.float32], (window, rel(out, ref(window)))
    assert rel(ref(1000), ref(None)) < 1e-12 and rel(ref(37), ref(None)) > 0.05
    with pytest.raises(ValueError, match="tree mask"):
        mask = torch.ones(3, 16, 16, dtype=torch.bool, device=DEV)
        paged_attention_reference(q, kp, vp, *pos, window=4, tree_mask=mask)


def test_engine_tokens_match_torch_backend(toy_pair, monkeypatch):
    """DDTREE generation on the toy pair (tree verify + drafter block through the kernel) gives the torch
    backend's tokens."""
    from engine_utils import run, toy_prompts

    import ddtree.config.args as server_args
    from ddtree import SamplingParams

    if "triton" not in server_args.IMPLEMENTED_ATTENTION_BACKENDS:
        monkeypatch.setattr(
            server_args,
            "IMPLEMENTED_ATTENTION_BACKENDS",
            server_args.IMPLEMENTED_ATTENTION_BACKENDS + ("triton",),
        )
    prompts = toy_prompts(2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = run(toy_pair, prompts, params, algorithm="DDTREE", attention_backend="torch")
    ours = run(toy_pair, prompts, params, algorithm="DDTREE", attention_backend="triton")
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref]


@pytest.mark.parametrize("cfg", ["default", "pingpong"])
@pytest.mark.parametrize(
    "q_lens,kv_lens,tree,splits",
    [
        (
            [64, 17],
            [3000, 300],
            True,
            5,
        ),  # GQA 2: 128 rows (one full 128-row block) beside 34 (one mostly empty)
        (
            [96, 1],
            [700, 90],
            False,
            3,
        ),  # a causal chain whose second warpgroup's rows start mid-chain, decode
        ([65, 17], [700, 300], True, 3),  # 130 + 34 rows (GQA 2): two 64-row blocks and a 2-row one
        (
            [40, 33],
            [900, 500],
            False,
            5,
        ),  # causal chains: each row block's full tiles end at its first token
        (
            [65],
            [65 + 64 * 5],
            True,
            4,
        ),  # context a whole number of tiles: no partial tile in the last split
        ([65, 20], [100, 20], True, 2),  # a context shorter than one tile: empty context splits
        (
            [1, 1, 1],
            [700, 5, 1],
            False,
            3,
        ),  # decode (one swapped block per request), a context of 0
        ([2, 1], [300, 64], False, 4),  # a 2-token chain beside decode
    ],
)
def test_hopper_context_handoff(monkeypatch, q_lens, kv_lens, tree, splits, cfg):
    """The Gluon kernel's contract (hopper.py), without a GPU: with its PyTorch oracle standing in for it, the
    combine gives the full attention; with PINGPONG's 128-row blocks too (a warpgroup with no rows only keeps
    the slot protocol)."""
    from ddtree.kernels.tree_attention import reference

    hop = kernel_module.hopper
    monkeypatch.setattr(hop, "launch_splits", reference.split_partials_reference)
    cfg = {"default": hop.DEFAULT, "pingpong": hop.PINGPONG}[cfg]
    plan = check(q_lens, kv_lens, 16, torch.float32, tree, num_splits=splits, hopper_ctx=cfg)
    assert plan.kernel == "hopper" and plan.hopper == cfg and plan.num_splits == splits


def test_default_path_takes_the_hopper_kernel_for_decode_and_trees(monkeypatch):
    """Where dispatch.gluon_unsupported gives no reason (sm_90, bf16, head dim 128, 16-token pages),
    the default dispatch sends tree
    rows and decode rows to the Gluon kernel, and 4-8 token chains (16-32 rows at GQA 4) to Triton."""
    from ddtree.kernels.tree_attention import reference

    hop = kernel_module.hopper
    monkeypatch.setattr(hop, "launch_splits", reference.split_partials_reference)
    from ddtree.kernels.tree_attention import dispatch

    monkeypatch.setattr(
        dispatch,
        "gluon_unsupported",
        lambda shape, device: (
            None if dispatch.gluon_rows_supported(shape.rows, shape.group) else "rows"
        ),
    )
    monkeypatch.setattr(hop, "sm_count", lambda device: 132)
    for q_lens, kv_lens, tree, used in (
        ([1, 1], [900, 40], False, True),
        ([17], [400], True, True),
        ([6], [300], False, False),
    ):
        plan = check(q_lens, kv_lens, 16, torch.float32, tree, hq=8, hkv=2)
        want = dispatch.gluon_config_for(max(q_lens) * 4) if used else None
        assert plan.hopper == want and (plan.kernel == "hopper") == used, (q_lens, plan)
        assert (plan.fallback is None) == used
    # 64-node trees (256 rows) take the two-warpgroup kernel; 65 nodes (4 rows past 256) and decode the 64-row one
    config_for = dispatch.gluon_config_for
    assert config_for(256) == hop.PINGPONG and config_for(68) == hop.PINGPONG
    assert config_for(260) == hop.DEFAULT and config_for(4) == hop.DEFAULT


def test_hopper_config_rules():
    from ddtree.kernels.tree_attention.hopper import HopperConfig

    assert HopperConfig().programs_per_sm(128) == 2  # 3 x 32 KB ring + 16 KB Q: two fit in 228 KB
    assert HopperConfig(128, 64, 3).programs_per_sm(128) == 1
    assert HopperConfig(128, 128, 3).programs_per_sm(128) == 1  # 224 KB: Q 32 + 3 x (K 32 + V 32)
    with pytest.raises(AssertionError):
        # 128-wide tiles only with two warpgroups: one would not fit two per SM
        HopperConfig(64, 128, 3)


def test_hopper_kernel_failure_falls_back(monkeypatch, caplog):
    """A Gluon kernel that cannot build here (another Triton's Gluon API) costs a warning, not the request: the
    call reruns on the Triton kernel and later calls skip the Hopper kernel."""
    from ddtree.kernels.tree_attention.hopper import HopperConfig

    hop = kernel_module.hopper
    monkeypatch.setattr(hop, "_disabled", [])

    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise TypeError("warp_specialize() got an unexpected keyword argument")

    monkeypatch.setattr(hop, "launch_splits", broken)
    with caplog.at_level("WARNING", logger="ddtree"):
        plan = check(
            [65, 17], [700, 300], 16, torch.float32, True, num_splits=3, hopper_ctx=HopperConfig()
        )
    assert calls == [1] and plan.kernel == "triton" and plan.hopper is None and plan.num_splits == 3
    assert "Gluon kernel failed" in plan.fallback
    assert len(hop._disabled) == 1 and "unavailable" in caplog.text


def test_pdl_gate(monkeypatch):
    """The split merge launches as a programmatic dependent only where griddepcontrol exists (CUDA sm_90+, not
    the interpreter) and DDTREE_DISABLE is unset."""
    from ddtree.kernels.tree_attention import merge

    cuda = torch.device("cuda", 0)
    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    monkeypatch.setattr(merge.triton.knobs.runtime, "interpret", False)
    monkeypatch.delenv(envs.DISABLE.name, raising=False)
    assert merge.pdl_ok(cuda) == merge.HAVE_GDC
    monkeypatch.setenv(envs.DISABLE.name, "pdl")
    assert not merge.pdl_ok(cuda)
    monkeypatch.delenv(envs.DISABLE.name)
    cap[0] = (8, 0)
    assert not merge.pdl_ok(cuda)
    assert not merge.pdl_ok(torch.device("cpu"))


def test_hopper_row_gate():
    """The Gluon kernel takes trees / chains (> 32 rows per request: 64-row blocks, a one-node tail swapped) and
    decode (one token's GQA group <= tail_n: a single swapped block); 17..32 rows stay with Triton's 32-row
    blocks, and so do groups wider than the swapped block."""
    from ddtree.kernels.tree_attention import hopper
    from ddtree.kernels.tree_attention.dispatch import gluon_rows_supported as rows_supported

    assert rows_supported(4, 4) and rows_supported(8, 8)  # decode, GQA 4 and 8
    assert rows_supported(65 * 4, 4) and rows_supported(33, 1)
    assert not rows_supported(16, 4) and not rows_supported(32, 4)  # 4-8 token chains
    assert not rows_supported(16, 16)  # GQA 16: a token's group is wider than tail_n
    assert not rows_supported(0, 4)
    assert hopper.tail_n(hopper.HopperConfig(tail_n=0), 4) == 0 and not rows_supported(12, 4)


def test_dispatch_plan_is_frozen_and_names_its_fallback(monkeypatch):
    """The dispatcher's plan: hashable (graphs key on it), the Gluon kernel refused with a reason for the
    drafter block, one split, the env switch and the device; no launch needed."""
    import dataclasses

    from ddtree.kernels.tree_attention import dispatch

    hop = kernel_module.hopper
    monkeypatch.setattr(hop, "_disabled", [])  # as where Gluon imports
    # as on the Triton the Gluon kernel is gated for, so the device is the reason checked here
    monkeypatch.setattr(dispatch, "GLUON_TRITON_VERSIONS", (kernel_module.triton.__version__,))
    cpu = torch.device("cpu")
    tree = dispatch.AttentionShape(
        2, 65, 4096, 32, 8, 128, 16, torch.bfloat16, dispatch.MODES["tree"]
    )
    p = dispatch.plan(tree, cpu, triton_slots=lambda cfg: 264)
    assert p.kernel == "triton" and p.fallback == "not sm_90" and p.num_splits > 1 and not p.pdl
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_splits = 3
    assert {p: 1}[
        dispatch.plan(tree, cpu, triton_slots=lambda cfg: 264)
    ] == 1  # equal plans, one key
    block = dataclasses.replace(tree, new_kv=True)
    assert "alongside" in dispatch.plan(block, cpu, triton_slots=lambda cfg: 264).fallback
    assert dispatch.plan(tree, cpu, num_splits=1).fallback == "one split asked for"
    monkeypatch.setenv(envs.DISABLE.name, "hopper_attention")
    assert "hopper_attention" in dispatch.gluon_unsupported(tree, cpu)
    monkeypatch.delenv(envs.DISABLE.name)
    monkeypatch.setattr(dispatch, "gluon_unsupported", lambda shape, device: None)
    monkeypatch.setattr(hop, "sm_count", lambda device: 132)
    g = dispatch.plan(tree, cpu)
    assert (
        g.kernel == "hopper"
        and g.hopper == dispatch.gluon_config_for(tree.rows)
        and g.fallback is None
    )
    assert g.capture_key == (g.num_splits, True) and g.num_splits >= 2
    assert (
        dispatch.plan(tree, cpu, num_splits=1).kernel == "triton"
    )  # one split: no partials, no Gluon
