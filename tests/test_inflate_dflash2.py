"""`ddtree inflate` of a DFlash2 drafter: the widened drafter proposes what the small one proposes
(unary logits over the real vocabulary, the selector's rescored candidates, so the chain and the
path-conditioned tree), dense and hybrid shapes, fp32. The source is the embedded pair with its
DFlash drafter carried into DFlash2 (`warm_start`) and random, non-trivial convolutions and
selector. Relative error <= 5e-5: fp32 rounding, which the random convolutions amplify (the DFlash
test holds 1e-5); one perturbed weight moves it past 1e-3. ~25 s."""

from __future__ import annotations

import json

import pytest
import torch
from inflate_fixtures import SRC_VOCAB, shape
from test_inflate import max_rel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from ddtree.assets import default_model_paths
    from ddtree.models.configs import TargetConfig
    from ddtree.models.drafters import build_drafter
    from ddtree.models.loader import load_drafter, load_target, save_model
    from ddtree.tools.train.drafter import drafter_config_for
    from ddtree.tools.train.selector import warm_start

    t, d = default_model_paths()
    src = json.loads(open(f"{d}/config.json").read())
    cfg = drafter_config_for(
        TargetConfig.from_path(t),
        src["num_hidden_layers"],
        src["block_size"],
        src["dflash_config"]["mask_token_id"],
        tuple(src["dflash_config"]["target_layer_ids"]),
        torch_dtype="float32",
        architecture="DFlash2DraftModel",
        selector_rank=32,
    )
    from ddtree.models.configs import DrafterConfig

    drafter = build_drafter(DrafterConfig.from_dict(cfg))
    warm_start(drafter, d)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("dflash2_src")
    save_model(drafter, str(out), cfg)
    return t, str(out), load_target(t, torch.float32), load_drafter(str(out), torch.float32)


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def pair(request, small):
    from ddtree.tools.inflate import inflate_pair

    return inflate_pair(small[0], small[1], shape(request.param), dtype=torch.float32)


def _proposals(target, drafter, ids, anchors):
    _, taps = target.forward_train(ids, drafter.config.target_layer_ids)
    S = drafter.config.block_size
    block = torch.full((1, anchors.shape[1], S), drafter.config.mask_token_id)
    block[..., 0] = ids[0, anchors[0]]
    hidden = drafter.forward_train(taps, target.embed_tokens(block), anchors)[0, :, 1:]
    return drafter.propose(hidden, target.lm_head)


@torch.no_grad()
def test_widened_dflash2_proposes_what_the_small_one_does(small, pair):
    from ddtree.speculative.markov_tree import build_markov_chain, build_markov_tree, child_scores

    cfg = pair.drafter.config
    assert (
        cfg.is_dflash2
        and cfg.selector_rank == 256
        and cfg.hidden_size > small[3].config.hidden_size
    )
    ids = torch.randint(3, SRC_VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[5, 17, 30]])
    ref = _proposals(small[2], small[3], ids, anchors)
    big = _proposals(pair.target, pair.drafter, ids, anchors)
    assert max_rel(big.logits[..., :SRC_VOCAB], ref.logits) <= 5e-5
    assert torch.equal(big.cand, ref.cand)
    roots = ids[0, anchors[0]]
    # the selector's scores under any predecessor, so every chain and tree built from them
    for d in range(ref.unary.shape[1]):
        parents = ref.cand[:, d, :4]
        assert max_rel(child_scores(big, d, parents), child_scores(ref, d, parents)) <= 5e-5
    for build in (
        lambda x: build_markov_chain(roots, x),
        lambda x: build_markov_tree(roots, x, 32, 32, False),
    ):
        a, b = build(ref), build(big)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    # the selector really rescored: the chain is not the unary argmax
    assert (build_markov_chain(roots, ref).tokens[:, 1:] != ref.logits.argmax(-1)).any()


@torch.no_grad()
def test_the_check_can_fail(small, pair):
    """One flipped weight of a widened convolution is seen in the logits."""
    ids = torch.randint(3, SRC_VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[5, 17, 30]])
    ref = _proposals(small[2], small[3], ids, anchors)
    w = pair.drafter.layers[0].mlp_conv.base_kernel
    saved = w[1, 1, 0].item()
    w[1, 1, 0] += 0.5
    try:
        big = _proposals(pair.target, pair.drafter, ids, anchors)
        assert max_rel(big.logits[..., :SRC_VOCAB], ref.logits) > 1e-3
    finally:
        w[1, 1, 0] = saved
