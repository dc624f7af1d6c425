"""Selector-only DFlash2 training (train/selector_fit.py): the held-out chain metric on hand-built
features, and a run on the toy pair that starts from the DFlash drafter's function exactly and
keeps the best held-out step. ~30 s."""

import pytest
import torch

from ddtree.tools.train.selector_fit import SelectorData, chain_tau

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ZeroSelector(torch.nn.Module):
    """Scores = the unary logits: the greedy pick is candidate 0."""

    def __init__(self):
        super().__init__()
        self.hidden_projection = torch.nn.Linear(2, 1, bias=False)

    def scores(self, hidden, unary, preds, cand):
        return unary.float()


def test_chain_tau_counts_leading_hits_of_complete_blocks():
    # blocks 0 and 1 complete (positions 1..4), block 2 incomplete (its row 2 was masked out)
    block = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    pos = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4, 1, 3, 4])
    target = torch.tensor([0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0])  # block 0 misses at position 3
    served = torch.ones(11, dtype=torch.bool)
    served[7] = False  # block 1: its label at position 4 is not among the candidates
    n = len(block)
    data = SelectorData(
        hidden=torch.zeros(n, 2),
        unary=torch.tensor([[1.0, 0.0]]).expand(n, 2),
        cand=torch.zeros(n, 2, dtype=torch.int64),
        target=target,
        served=served,
        preds=torch.zeros(n, dtype=torch.int64),
        weight=torch.ones(n),
        pos=pos,
        block=block,
    )
    # block 0: positions 1, 2 accepted -> tau 3; block 1: 1..3 -> tau 4; block 2 left out
    assert chain_tau(ZeroSelector(), data) == pytest.approx(3.5)


def test_selector_only_run_on_the_toy_pair(toy_pair, tmp_path):
    from ddtree.models.configs import TargetConfig
    from ddtree.models.loader import load_drafter, load_target
    from ddtree.tools.train.drafter import drafter_config_for
    from ddtree.tools.train.selector_fit import train_selector_only
    from ddtree.tools.train.toy import greedy_data

    t_dir, d_dir = toy_pair
    target = load_target(t_dir, torch.float32)
    src = load_drafter(d_dir, torch.float32).config
    cfg = drafter_config_for(
        TargetConfig.from_path(t_dir),
        src.num_hidden_layers,
        src.block_size,
        src.mask_token_id,
        src.target_layer_ids,
        torch_dtype="float32",
        architecture="DFlash2DraftModel",
        selector_rank=16,
    )
    ids, mask, _ = greedy_data(target, 96, 7)
    history: list = []
    train_selector_only(
        target,
        cfg,
        (ids[:80], mask[:80]),
        d_dir,
        steps=60,
        batch_size=256,
        anchors_per_seq=8,
        progress=False,
        history=history,
        eval_sequences=(ids[80:], mask[80:]),
        features=str(tmp_path / "feat"),
    )
    curve = [h["val_chain_tau"] for h in history if "val_chain_tau" in h]
    best = next(h for h in history if "best_step" in h)
    # step 0 is the DFlash drafter's chain (zero rescoring); the kept step is the best seen
    assert best["best_val_chain_tau"] == max(curve) >= curve[0] > 1
    assert (tmp_path / "feat.train").exists() and (tmp_path / "feat.val").exists()


def test_full_training_warm_start_keeps_the_dflash_function(toy_pair):
    """`train-drafter --architecture dflash2 --init-from` (every weight trained): before any update
    (lr 0) the DFlash2 drafter's chain is the DFlash drafter's, token for token."""
    from ddtree.models.configs import TargetConfig
    from ddtree.models.loader import load_drafter, load_target
    from ddtree.speculative.markov_tree import build_markov_chain
    from ddtree.speculative.tree import build_chain
    from ddtree.tools.train.drafter import block_embeds, drafter_config_for, train_drafter
    from ddtree.tools.train.toy import greedy_data

    t_dir, d_dir = toy_pair
    target = load_target(t_dir, torch.float32)
    dflash = load_drafter(d_dir, torch.float32)
    src = dflash.config
    cfg = drafter_config_for(
        TargetConfig.from_path(t_dir),
        src.num_hidden_layers,
        src.block_size,
        src.mask_token_id,
        src.target_layer_ids,
        torch_dtype="float32",
        architecture="DFlash2DraftModel",
        selector_rank=16,
    )
    ids, mask, _ = greedy_data(target, 8, 3)
    d2 = train_drafter(
        target, cfg, (ids, mask), steps=1, lr=0.0, batch_size=4, anchors_per_seq=4,
        init_from=d_dir, progress=False, device="cpu",
    )  # fmt: skip
    anchors = torch.tensor([[10, 20, 30]] * 2)
    with torch.no_grad():
        _, taps = target.forward_train(ids[:2], src.target_layer_ids)
        emb = block_embeds(target, ids[:2], anchors, src)
        h1 = dflash.forward_train(taps, emb, anchors)[:, :, 1:].flatten(0, 1)
        h2 = d2.forward_train(taps, emb, anchors)[:, :, 1:].flatten(0, 1)
        roots = ids[:2].gather(1, anchors).flatten()
        a = build_chain(roots, dflash.propose(h1, target.lm_head))
        b = build_markov_chain(roots, d2.propose(h2, target.lm_head))
    assert torch.equal(a.tokens, b.tokens)
