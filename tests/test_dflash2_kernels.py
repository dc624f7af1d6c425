"""DFlash2's kernels against their PyTorch references (Triton's CPU interpreter without a GPU; the
same tests run on the device there): the grouped dynamic convolution (strided tap offsets, bf16 and
fp32, kernel sizes 1-3, blocks of 8 and 16) and the greedy selector chain's walk (bit for bit: both
walk one transition table); the dispatch's switch; a decode of the toy DFlash2 pair with both
kernels in the loop equals AR. ~25 s."""

import pytest
import torch
from triton_utils import DEV

pytest.importorskip("triton")

from ddtree import envs  # noqa: E402
from ddtree.kernels import dynamic_conv as conv_mod  # noqa: E402
from ddtree.kernels import selector  # noqa: E402
from ddtree.kernels.dynamic_conv import dynamic_conv_reference  # noqa: E402
from ddtree.speculative.markov_tree import MarkovDraft, greedy_chain, transitions  # noqa: E402


@pytest.fixture
def interpreted(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,S", [(1, 8), (2, 16), (3, 8)])
def test_dynamic_conv_matches_reference(interpreted, dtype, k, S):
    g = torch.Generator().manual_seed(k * 10 + S)
    H, group, blocks = 96, 16, 3
    x = torch.randn(2, blocks * S, H, generator=g).to(dtype).to(DEV)
    proj = torch.randn(2, blocks * S, 2 * k * H // group, generator=g).to(dtype).to(DEV)
    dyn = proj[..., k * H // group :]  # a strided view, as `prepare` hands `finish`
    base = torch.randn(k, H, generator=g).to(dtype).to(DEV)
    got = conv_mod._triton().dynamic_conv(x, dyn, base, group, S)
    ref = dynamic_conv_reference(x, dyn, base, group, S)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    # block boundaries: row 0 of every block sees only its own input
    first = x[:, ::S].float() * (
        base[0].float() + dyn[:, ::S, : H // group].float().repeat_interleave(group, -1)
    )
    torch.testing.assert_close(got[:, ::S].float(), first, rtol=tol, atol=tol)


def random_draft(b, D, K, r, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, D, V, generator=g) * 2
    unary, cand = logits.topk(K, dim=-1)
    edge = torch.randn(b, D, K, r, generator=g)
    book = torch.randn(V, r, generator=g).to(torch.bfloat16)
    return MarkovDraft(*(x.to(DEV) for x in (logits, unary, cand, edge, book)))


@pytest.mark.parametrize("b,D,K,r", [(1, 7, 16, 32), (5, 15, 16, 24), (3, 4, 6, 8)])
def test_selector_chain_matches_reference(interpreted, b, D, K, r):
    draft = random_draft(b, D, K, r, seed=b + D)
    roots = torch.arange(b, device=DEV) + 3
    t = transitions(roots, draft)
    tok, logq = selector._triton().selector_chain(t.logq[..., 0], t.child[..., 0], draft.cand)
    ref_tok, ref_logq = greedy_chain(roots, draft)
    assert torch.equal(tok, ref_tok) and torch.equal(logq, ref_logq)  # one table, walked twice


def test_dispatch_and_switch(interpreted, monkeypatch):
    draft = random_draft(2, 5, 16, 8)
    roots = torch.tensor([1, 2], device=DEV)
    ran = []
    real = selector._triton().selector_chain
    monkeypatch.setattr(selector._triton(), "selector_chain", lambda *a: ran.append(1) or real(*a))
    selector.selector_chain(roots, draft)
    assert ran == [1]
    monkeypatch.setenv(envs.REFERENCE.name, "kernels")
    assert not selector.use_kernel(draft.unary)
    selector.selector_chain(roots, draft)
    assert ran == [1]


def test_toy_decode_with_the_kernels_equals_ar(interpreted, toy_dflash2_pair, one_torch_thread):
    """The toy DFlash2 pair's DFLASH decode with the conv and chain kernels in the loop."""
    from engine_utils import accepted_prompts, mean_accept, run

    from ddtree import SamplingParams

    if DEV == "cuda":
        pytest.skip("tests/gpu covers the device")
    # every fused kernel of the target runs interpreted too: one prompt, a few rounds
    prompts, sp = accepted_prompts(2)[1:], SamplingParams(temperature=0, max_tokens=14)
    with pytest.MonkeyPatch.context() as m:
        m.setenv(envs.REFERENCE.name, "kernels")
        ar = [o.token_ids for o in run(toy_dflash2_pair, prompts, sp)]
    calls = {"conv": 0, "chain": 0}
    conv, chain = conv_mod._triton().dynamic_conv, selector._triton().selector_chain

    def counted(name, fn):
        def wrapped(*a):
            calls[name] += 1
            return fn(*a)

        return wrapped

    with pytest.MonkeyPatch.context() as m:
        m.setattr(conv_mod._triton(), "dynamic_conv", counted("conv", conv))
        m.setattr(selector._triton(), "selector_chain", counted("chain", chain))
        outs = run(toy_dflash2_pair, prompts, sp, algorithm="DFLASH")
    assert calls["conv"] and calls["chain"], calls
    assert [o.token_ids for o in outs] == ar and mean_accept(outs) > 2


TREE_FIELDS = ("tokens", "parents", "depths", "valid", "tree_mask", "path_probs", "chain_probs")


@pytest.mark.parametrize(
    "b,D,K,budget,cap,shadow",
    [
        (3, 7, 16, 16, 16, False),
        (2, 15, 16, 64, 16, True),
        (4, 5, 6, 20, 3, False),
        (1, 4, 8, 2, 8, True),
    ],
)
def test_markov_tree_kernel_is_bit_equal(interpreted, b, D, K, budget, cap, shadow):
    """The path-conditioned tree with the beams from the kernel == the PyTorch selection, every
    field bit for bit (exact ties included: bf16-rounded scores), depth limits and budget cuts."""
    from ddtree.speculative.markov_tree import build_markov_tree

    draft = random_draft(b, D, K, 8, seed=budget)
    # exact ties: unary logits, edges and codebook on coarse grids (scores are multiples of 1/16)
    draft = draft._replace(
        unary=(draft.unary * 4).round() / 4,
        edge=(draft.edge * 2).round().clamp(-2, 2) / 4,
        codebook=(draft.codebook.float() * 2).round().clamp(-2, 2).to(draft.codebook.dtype) / 2,
    )
    logq = transitions(roots_of(b), draft).logq
    assert (logq[..., 1:] == logq[..., :-1]).any(), "no tie: the test would not see tie-breaking"
    roots = roots_of(b)
    limits = torch.tensor([D, 0, 2, D - 1][:b], device=DEV)
    cut = torch.tensor([budget, 1, budget // 2, 0][:b], device=DEV)
    ran = []
    real = selector._triton().markov_beams

    def counted(*a):
        ran.append(1)
        return real(*a)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(selector._triton(), "markov_beams", counted)
        got = build_markov_tree(
            roots, draft, budget, cap, shadow, limits, cut, select=selector.select_markov_nodes
        )
    ref = build_markov_tree(roots, draft, budget, cap, shadow, limits, cut)
    assert ran == [1]
    for f in TREE_FIELDS:
        x, y = getattr(got, f), getattr(ref, f)
        if x.is_floating_point():
            x, y = x.view(torch.int32), y.view(torch.int32)
        assert torch.equal(x, y), f


def roots_of(b):
    return torch.arange(b, device=DEV) + 5
