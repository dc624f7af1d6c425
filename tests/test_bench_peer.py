"""The peer adapter (`ddtree.bench.peer`): the paper's reference code (liranringel/ddtree) runs on our weights.

With a checkout under .peer/ (never committed; a symbolic link to one elsewhere does) the adapter is run on a
tiny fp32 pair on the CPU: positive per-round times, the peer's greedy output equal to our target's greedy AR
(same target tensors), and the peer's drafter forward equal to ours (same drafter tensors). The error for a
bad --peer-checkout path always runs.
"""

from __future__ import annotations

import os

import pytest
import torch

from ddtree.bench.peer import (
    PeerCheckoutError,
    build_peer_models,
    load_peer,
    peer_round_ms,
    random_prompt,
)
from ddtree.bench.random_pair import SMOKE, build_pair, pair_configs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PEER = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".peer")
needs_peer = pytest.mark.skipif(
    not os.path.isdir(PEER),
    reason=f"no liranringel/ddtree checkout at {PEER} "
    "(never committed; unpack the repository's files into .peer/ddtree)",
)
CONTEXT, ROUNDS, BUDGET = 24, 6, 8


def test_wrong_checkout_path_names_the_flag(tmp_path):
    with pytest.raises(PeerCheckoutError, match="--peer-checkout") as e:
        peer_round_ms(str(tmp_path / "missing"), None, None, CONTEXT, BUDGET, ROUNDS, "cpu")
    assert "ddtree.py" in str(e.value)


def test_broken_checkout_names_the_flag_and_the_cause(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "dflash.py").write_text("")
    (tmp_path / "dflash.py").write_text("")
    (tmp_path / "ddtree.py").write_text("import no_such_module_for_the_peer_test\n")
    with pytest.raises(
        PeerCheckoutError, match="--peer-checkout.*no_such_module_for_the_peer_test"
    ):
        load_peer(str(tmp_path))
    import ddtree  # our package is never shadowed by the peer's ddtree.py

    assert hasattr(ddtree, "__path__")


@pytest.fixture(scope="module")
def pair():
    """6-layer target (taps 1 and 3, so no tap is HF's final-normed hidden state) and a 2-layer drafter, with
    weights large enough that greedy margins dwarf fp32 rounding between tree and causal attention."""
    tcfg, dcfg = pair_configs(dict(SMOKE, num_layers=6, vocab_size=256), 2, 8, "float32")
    target, drafter = build_pair(tcfg, dcfg, "cpu", torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in list(target.parameters()) + list(drafter.parameters()):
            if p.dim() > 1:
                p.normal_(0.0, 0.08, generator=gen)
    return target, drafter


@needs_peer
def test_peer_runs_on_our_weights_and_matches_our_ar(pair):
    target, drafter = pair
    res = peer_round_ms(PEER, target, drafter, CONTEXT, BUDGET, ROUNDS, "cpu", warmup=1, seed=5)
    assert res["ms"] > 0 and res["ms_mean"] > 0 and 1 <= res["rounds"] <= ROUNDS
    assert res["stages_ms"]["verify"] > 0 and res["stages_ms"]["draft"] > 0
    assert res["budget"] == BUDGET and res["context"] == CONTEXT and res["target_attn"] == "sdpa"

    mask = drafter.config.mask_token_id
    ids = random_prompt(target.config.vocab_size, CONTEXT, mask, seed=5)[0]
    with torch.no_grad():
        for _ in range(ROUNDS + 1):
            logits, _ = target.forward_train(ids[None])
            ids = torch.cat([ids, logits[0, -1].argmax()[None]])
    ours = [
        t for t in ids[CONTEXT:].tolist() if t != mask
    ]  # the peer drops MASK ids from its output
    assert len(ours) >= ROUNDS and res["output_ids"] == ours

    chain = peer_round_ms(
        PEER, target, drafter, CONTEXT, 0, 3, "cpu", algorithm="DFLASH", warmup=0, seed=5
    )
    assert chain["ms"] > 0 and chain["budget"] is None and chain["output_ids"] == ours[:4]


@needs_peer
def test_peer_drafter_is_ours(pair):
    target, drafter = pair
    _, peer_drafter = build_peer_models(load_peer(PEER), target, drafter, "cpu", "sdpa")
    assert peer_drafter.fc.weight.data_ptr() == drafter.fc.weight.data_ptr()  # shared, not copied
    assert peer_drafter.target_layer_ids == list(drafter.config.target_layer_ids)
    gen = torch.Generator().manual_seed(6)
    T, S, H = 10, drafter.config.block_size, drafter.config.hidden_size
    feats = torch.randn(1, T, len(drafter.config.target_layer_ids) * H, generator=gen)
    block = torch.randn(1, 1, S, H, generator=gen)
    with torch.no_grad():
        ours = drafter.forward_train(feats, block, torch.tensor([[T]]))[0, 0]
        theirs = peer_drafter(
            position_ids=torch.arange(T + S)[None],
            noise_embedding=block[0],
            target_hidden=feats,
            is_causal=False,
        )[0]
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
