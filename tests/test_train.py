"""Training: drafter recipe (loss, export, acceptance, resume), target pretraining (HF parity), data, toy pair."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.loader import load_drafter, load_target
from ddtree.tools.train import data
from ddtree.tools.train.drafter import (
    acceptance_lengths,
    block_acceptance,
    chain_acceptance,
    default_gamma,
    drafter_config_for,
    train_drafter,
)
from ddtree.tools.train.lm import generate, init_weights, qwen3_config, train_lm

P, T = 16, 48


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A briefly pretrained 2-layer target plus its greedy continuations (train / held-out)."""
    cfg = qwen3_config(
        64, hidden_size=64, num_layers=2, intermediate_size=128, max_position_embeddings=256
    )
    target = train_lm(
        cfg,
        data.synthetic_sequences(1024, T, 64, 0),
        steps=120,
        lr=1e-2,
        batch_size=32,
        progress=False,
    )
    ids = torch.tensor(generate(target, data.synthetic_sequences(512, P, 64, 1), T - P))
    held = torch.tensor(generate(target, data.synthetic_sequences(32, P, 64, 2), T - P))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, P:] = True
    dcfg = drafter_config_for(
        TargetConfig.from_dict(cfg),
        num_layers=1,
        block_size=8,
        target_layer_ids=(0, 1),
        torch_dtype="float32",
    )
    return cfg, target, (ids, mask), held, dcfg


def _drafter(tiny, steps, **kw):
    cfg, target, train, held, dcfg = tiny
    kw.setdefault("history", [])
    return train_drafter(
        target,
        dcfg,
        train,
        steps=steps,
        lr=3e-3,
        batch_size=8,
        anchors_per_seq=16,
        progress=False,
        **kw,
    )


def test_drafter_config_for_geometry():
    tcfg = TargetConfig.from_dict(qwen3_config(64, num_layers=36))
    d = drafter_config_for(tcfg, num_layers=5)
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {
        "mask_token_id": data.MASK_ID,
        "target_layer_ids": [1, 9, 17, 25, 33],
        "block_size": 16,
    }
    dc = DrafterConfig.from_dict(d)
    assert (
        dc.hidden_size,
        dc.num_attention_heads,
        dc.num_key_value_heads,
        dc.head_dim,
        dc.vocab_size,
    ) == (
        tcfg.hidden_size,
        tcfg.num_attention_heads,
        tcfg.num_key_value_heads,
        tcfg.head_dim,
        tcfg.vocab_size,
    )
    tiny2 = drafter_config_for(TargetConfig.from_dict(qwen3_config(64, num_layers=2)), num_layers=3)
    assert all(0 <= i < 2 for i in tiny2["dflash_config"]["target_layer_ids"])
    assert default_gamma(16) == 7 and default_gamma(8) == 4
    with pytest.raises(ValueError):
        drafter_config_for(tcfg, mask_token_id=64)


def test_drafter_trains_exports_and_beats_untrained(tiny, tmp_path):
    cfg, target, train, held, dcfg = tiny
    hist: list = []
    drafter = _drafter(
        tiny, 150, out_dir=str(tmp_path), history=hist, eval_sequences=held, eval_start=P
    )
    losses = [h["loss"] for h in hist if "loss" in h]
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:5]) / 5
    loaded = load_drafter(str(tmp_path), torch.float32)
    for (n, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    torch.manual_seed(0)
    untrained = DFlashDrafter(DrafterConfig.from_dict(dcfg))
    init_weights(untrained)
    tau = block_acceptance(loaded, target, held, start=P)
    assert tau > block_acceptance(untrained.eval(), target, held, start=P) + 0.5
    assert hist[-1] == {"step": 150, "tau": pytest.approx(tau)}
    assert 1.0 <= chain_acceptance(acceptance_lengths(loaded, target, held), P) <= 8.0


class _Crash(list):
    def append(self, item):
        if item.get("step") == 25 and "loss" in item:
            raise KeyboardInterrupt
        super().append(item)


def test_resume_continues_exactly(tiny, tmp_path):
    full = _drafter(tiny, 40, seed=3)
    with pytest.raises(KeyboardInterrupt):
        _drafter(tiny, 40, seed=3, out_dir=str(tmp_path), save_every=10, history=_Crash())
    assert torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=False)["step"] == 20
    hist: list = []
    resumed = _drafter(tiny, 40, seed=3, out_dir=str(tmp_path), save_every=10, history=hist)
    assert [h["step"] for h in hist][:2] == [21, 22]
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=n)
    hist2: list = []  # a finished run resumes to "nothing left to do"
    _drafter(tiny, 40, seed=3, out_dir=str(tmp_path), history=hist2)
    assert not [h for h in hist2 if "loss" in h]


def test_kd_loss_trains(tiny):
    hist: list = []
    _drafter(tiny, 20, kd=True, history=hist)
    losses = [h["loss"] for h in hist]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_train_lm_export_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = qwen3_config(
        80,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    )
    hist: list = []
    ours = train_lm(
        cfg,
        data.synthetic_sequences(256, 32, 80, 0),
        steps=30,
        batch_size=16,
        lr=1e-2,
        out_dir=str(tmp_path),
        progress=False,
        history=hist,
    )
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert not any(k.startswith("lm_head") for k in _safetensor_keys(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    ids = data.synthetic_sequences(3, 32, 80, 5)
    with torch.no_grad():
        ref = hf(ids).logits
        mine, _ = ours.forward_train(ids)
        again, _ = load_target(str(tmp_path), torch.float32).forward_train(ids)
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, mine, rtol=0, atol=0)


def _safetensor_keys(path):
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def test_synthetic_corpus_is_deterministic_and_regular():
    a, b = data.synthetic_sequences(64, 64, 64, 7), data.synthetic_sequences(64, 64, 64, 7)
    assert torch.equal(a, b) and not torch.equal(a, data.synthetic_sequences(64, 64, 64, 8))
    assert (
        (a[:, 0] == data.BOS_ID).all() and (a[:, 1:] >= data.NUM_SPECIAL).all() and (a < 64).all()
    )
    # regular but not trivial: most tokens follow from a successor / stride / period rule, few repeat
    n, regular = a.shape[1], 64 - data.NUM_SPECIAL
    x, prev, prev2 = a[:, 6:], a[:, 5:-1], a[:, 4:-2]
    explained = (x == data.successor_table(64)[prev]) | (
        (x - prev) % regular == (prev - prev2) % regular
    )
    for p in range(2, 6):
        explained |= x == a[:, 6 - p : n - p]
    assert 0.8 < explained.float().mean() < 0.97
    assert (a[:, 1:] == a[:, :-1]).float().mean() < 0.2


def test_word_tokenizer_roundtrip(tmp_path):
    from transformers import AutoTokenizer

    data.word_tokenizer(64, str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok("12 15 18").input_ids
    assert ids == [data.BOS_ID, 12, 15, 18]
    assert tok.decode(ids, skip_special_tokens=True) == "12 15 18"
    assert tok.mask_token_id == data.MASK_ID and tok.eos_token_id == data.EOS_ID


def test_bpe_tokenizer_and_packing(tmp_path):
    from transformers import AutoTokenizer

    train_files, held = data.stdlib_files()
    assert train_files and held and not set(train_files) & set(held)
    small = [
        f for f in train_files if os.path.basename(f) in ("bisect.py", "colorsys.py", "keyword.py")
    ]
    data.train_bpe_tokenizer(small, 400, str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert [tok.convert_tokens_to_ids(t) for t in data.SPECIAL_TOKENS] == [0, 1, 2, 3]
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    docs = data.tokenize_texts(tok, data.read_texts(small))
    packed = data.pack_documents(docs, 64)
    assert packed.shape[1] == 64 and packed.shape[0] == (sum(len(d) + 2 for d in docs)) // 64
    path = str(tmp_path / "toks.pt")
    data.save_tokens(path, packed)
    assert torch.equal(data.load_tokens(path)[0], packed)


def test_cli_train_target_and_drafter(tmp_path):
    from ddtree.tools.train.cli import main

    tgt, drf = str(tmp_path / "t"), str(tmp_path / "d")
    assert (
        main(
            [
                "train-target",
                "--corpus",
                "synthetic",
                "--num-sequences",
                "256",
                "--seq-len",
                "32",
                "--hidden-size",
                "32",
                "--num-layers",
                "2",
                "--head-dim",
                "8",
                "--steps",
                "20",
                "--batch-size",
                "16",
                "--device",
                "cpu",
                "--no-progress",
                "--out",
                tgt,
            ]
        )
        == 0
    )
    with open(tmp_path / "prompts.jsonl", "w") as f:
        f.write(
            json.dumps({"prompt": "4 5 6 7"})
            + "\n"
            + json.dumps({"input_ids": [0, 9, 11, 13, 15]})
            + "\n"
        )
    assert (
        main(
            [
                "train-drafter",
                "--model-path",
                tgt,
                "--data",
                str(tmp_path / "prompts.jsonl"),
                "--regenerate",
                "16",
                "--gen-len",
                "24",
                "--temperature",
                "1.0",
                "--num-layers",
                "1",
                "--block-size",
                "8",
                "--anchors",
                "8",
                "--steps",
                "10",
                "--device",
                "cpu",
                "--no-progress",
                "--out",
                drf,
            ]
        )
        == 0
    )
    d = load_drafter(drf, torch.float32)
    assert d.config.mask_token_id == data.MASK_ID and d.config.block_size == 8
    assert json.load(open(os.path.join(drf, "train_metrics.json")))["summary"]["tau"] >= 1.0


def test_toy_pair_accepts_and_caches(toy_pair):
    """On the session's pair (one build per suite): its recorded acceptance, a cache hit on a second
    call, and the same acceptance re-measured from the saved weights."""
    from ddtree.tools.train.toy import MARKER, build_toy_pair, evaluate_pair

    target_dir, drafter_dir = toy_pair
    root = os.path.dirname(target_dir)
    info = json.load(open(os.path.join(root, MARKER)))
    assert info["tau"] > 3 and info["chain_tau"] > 2.5, info
    from ddtree.tools.train import toy

    def no_training(*a, **k):
        raise AssertionError("the cached pair was trained again")

    real, toy._train_pair = toy._train_pair, no_training  # a hit trains nothing (not: is fast)
    try:
        assert build_toy_pair(root) == (target_dir, drafter_dir)
    finally:
        toy._train_pair = real
    assert info["seconds"]["total"] > 0
    target, drafter = (
        load_target(target_dir, torch.float32),
        load_drafter(drafter_dir, torch.float32),
    )
    again = evaluate_pair(target, drafter, info["seed"] + 2)
    assert again["tau"] == pytest.approx(info["tau"]) and again["chain_tau"] == pytest.approx(
        info["chain_tau"]
    )


def test_block_loss_uses_same_position_labels_and_chunks(tiny):
    from ddtree.tools.train.drafter import anchor_valid, block_embeds, block_loss, sample_anchors

    cfg, target, (ids, mask), held, dcfg = tiny
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.from_dict(dcfg))
    init_weights(drafter, 0.2)
    ids, mask = ids[:3], mask[:3]
    anchors, keep = sample_anchors(anchor_valid(ids, mask), 6, torch.Generator().manual_seed(1))
    loss, accepted = block_loss(drafter, target, ids, mask, anchors, keep, gamma=4.0)
    chunked, acc2 = block_loss(
        drafter, target, ids, mask, anchors, keep, gamma=4.0, chunk_elems=64 * 7
    )
    torch.testing.assert_close(chunked, loss)
    assert torch.equal(accepted, acc2)
    _, feats = target.forward_train(ids, drafter.config.target_layer_ids)
    with torch.no_grad():
        hidden = drafter.forward_train(
            feats, block_embeds(target, ids, anchors, drafter.config), anchors
        )
        logits = drafter.logits(hidden, target.lm_head)
    num = den = 0.0
    for b in range(3):
        for j in range(anchors.shape[1]):
            a = int(anchors[b, j])
            # block row k is trained on x_{a+k}: same position, no extra shift
            for k in range(1, 8):
                if a + k < ids.shape[1] and mask[b, a + k]:
                    w = float(torch.exp(torch.tensor(-(k - 1) / 4.0)))
                    num += w * float(
                        torch.nn.functional.cross_entropy(logits[b, j, k], ids[b, a + k])
                    )
                    den += w
    assert loss.item() == pytest.approx(num / den, rel=1e-5)
