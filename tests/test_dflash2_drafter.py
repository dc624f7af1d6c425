"""The DFlash2 drafter (paged inference path, training path, chain) against a plain-PyTorch reference
written here from the public model code's math (z-lab/dflash `dflash/model.py`: the decoder layer
with its two grouped dynamic convolutions, `compute_logits`, `CandidateSelector.select` at T=0), on
random weights in the public layout. fp32; logits to 1e-4, chain tokens equal. ~3 s."""

import math

import pytest
import torch
import torch.nn.functional as F
from dflash2_fixtures import save_public_dflash2
from hf_fixtures import save_hf_qwen3
from test_dflash_drafter import rms, rope

from ddtree.engine.model_runner import ModelRunner, RunnerConfig
from ddtree.engine.scheduling.request import Req, SamplingParams
from ddtree.models.loader import load_drafter, load_target
from ddtree.speculative.markov_tree import build_markov_chain

BLOCK = 8


def grouped_conv(x, dynamic, base, group_size):
    """z-lab's `_grouped_dynamic_convolve` for one block x [S, H]: taps shifted by zero padding."""
    S, H = x.shape
    groups = H // group_size
    blocks = x.view(S, groups, group_size)
    dynamic = dynamic.view(S, base.shape[0], groups, 1)
    out = torch.zeros_like(blocks)
    for offset in range(base.shape[0]):
        values = blocks if offset == 0 else F.pad(blocks[:-offset], (0, 0, 0, 0, offset, 0))
        out = out + base[offset].view(groups, group_size) * values
        out = torch.addcmul(out, dynamic[:, offset], values)
    return out.view(S, H)


def conv_prepare(W, name, x, cfg):
    k, g = cfg["dflash_config"]["conv_kernel_size"], cfg["dflash_config"]["conv_group_size"]
    dyn = (x @ W[name + ".kernel_projection.weight"].T).view(x.shape[0], 2, -1)
    base = W[name + ".base_kernel"]
    return grouped_conv(x, dyn[:, 0], base[0], g), (dyn[:, 1], base[1], g, k)


def conv_finish(x, state):
    dyn, base, g, _ = state
    return grouped_conv(x, dyn, base, g)


def reference_block(W, cfg, embed, lm_head, features, block_ids, start):
    """-> (final hidden [S-1, H], unary logits [S-1, V]) of one block at positions start.."""
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = cfg["rope_parameters"]["rope_theta"]
    eps = cfg["rms_norm_eps"]
    L, S = features.shape[0], block_ids.shape[0]
    ctx = rms(features @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    x = embed[block_ids]
    kpos = torch.cat([torch.arange(L), start + torch.arange(S)])
    qpos = start + torch.arange(S)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"], eps)
        h, state = conv_prepare(W, p + "attention_conv", h, cfg)
        q = rms(
            (h @ W[p + "self_attn.q_proj.weight"].T).view(S, nh, hd),
            W[p + "self_attn.q_norm.weight"],
            eps,
        )
        both = torch.cat([ctx, h])
        k = rms(
            (both @ W[p + "self_attn.k_proj.weight"].T).view(L + S, nkv, hd),
            W[p + "self_attn.k_norm.weight"],
            eps,
        )
        v = (both @ W[p + "self_attn.v_proj.weight"].T).view(L + S, nkv, hd)
        q, k = rope(q, qpos, theta), rope(k, kpos, theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        diff = qpos[:, None] - kpos[None, :]
        window = cfg["sliding_window"]  # sliding layers, is_causal false: window on both sides
        vis = (diff < window) & (-diff < window)
        scores = scores.masked_fill(~vis[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(S, nh * hd)
        x = x + conv_finish(out @ W[p + "self_attn.o_proj.weight"].T, state)
        h = rms(x, W[p + "post_attention_layernorm.weight"], eps)
        h, state = conv_prepare(W, p + "mlp_conv", h, cfg)
        g, u = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
        x = x + conv_finish((F.silu(g) * u) @ W[p + "mlp.down_proj.weight"].T, state)
    hidden = rms(x, W["norm.weight"], eps)[1:]
    dcfg = cfg["dflash_config"]
    logits = (hidden @ lm_head.T) * dcfg["output_multiplier"]
    cap = dcfg["final_logit_softcapping"]
    return hidden, torch.tanh(logits / cap) * cap


def reference_select(W, cfg, hidden, logits, anchor):
    """`CandidateSelector.select` at temperature 0: (chain tokens [S-1], the rescored scores of
    each position's candidates given the chosen predecessor [S-1, K], candidates [S-1, K])."""
    K = cfg["dflash_config"]["selector_top_k"]
    unary, cand = torch.topk(logits, K, dim=-1, sorted=False)
    wh = hidden @ W["candidate_selector.hidden_projection.weight"].T
    P, Sc = W["candidate_selector.predecessor_codebook"], W["candidate_selector.successor_codebook"]
    pred, path, rows = anchor, [], []
    for pos in range(hidden.shape[0]):
        scores = unary[pos] + torch.einsum("r,kr->k", P[pred] * wh[pos], Sc[cand[pos]])
        pred = int(cand[pos, scores.argmax()])
        path.append(pred)
        rows.append(scores)
    return torch.tensor(path), torch.stack(rows), cand


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2_parity")
    save_hf_qwen3(root / "t", num_hidden_layers=3)
    cfg = save_public_dflash2(root / "t", root / "d", block_size=BLOCK, taps=[0, 2])
    cfg["sliding_window"] = 2048
    return root / "t", root / "d", cfg


def test_drafter_and_chain_match_reference(pair):
    t_dir, d_dir, cfg = pair
    target = load_target(str(t_dir), torch.float32)
    drafter = load_drafter(str(d_dir), torch.float32)
    W = {k: v.detach() for k, v in drafter.state_dict().items()}
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    runner = ModelRunner(
        target,
        drafter,
        RunnerConfig(
            page_size=4,
            num_pages=64,
            max_running_requests=4,
            max_context=128,
            block_size=BLOCK,
            max_verify_width=BLOCK,
        ),
        "cpu",
        torch.float32,
    )
    prompts = [
        list(range(3, 14)),
        [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    ]
    reqs = [Req(prompt_ids=p, params=SamplingParams(temperature=0)) for p in prompts]
    runner.prefill(reqs, [len(p) for p in prompts])
    roots = torch.tensor([40, 41])
    rnd = runner.begin(reqs)
    rnd.roots = roots
    draft = runner.propose(rnd, BLOCK)
    chain = build_markov_chain(roots, draft)
    mask = cfg["dflash_config"]["mask_token_id"]
    rescored = 0
    for i, p in enumerate(prompts):
        _, taps = target.forward_train(torch.tensor([p]), tap_layers=(0, 2))
        block = torch.tensor([int(roots[i])] + [mask] * (BLOCK - 1))
        hidden, logits = reference_block(W, cfg, embed, lm_head, taps[0], block, len(p))
        torch.testing.assert_close(draft.logits[i], logits, rtol=1e-4, atol=1e-4)
        tokens, scores, cand = reference_select(W, cfg, hidden, logits, int(roots[i]))
        assert chain.tokens[i, 1:].tolist() == tokens.tolist()
        # the chain's path probabilities: softmax of the reference's rescored candidates, times
        # the candidates' unary softmax mass (the calibration of markov_tree.Transitions)
        q = scores.softmax(-1).gather(1, (cand == tokens[:, None]).int().argmax(1, keepdim=True))
        mass = logits.softmax(-1).gather(1, cand).sum(-1)
        want = (q[:, 0] * mass).cumprod(0)
        torch.testing.assert_close(chain.chain_probs[i], want, rtol=1e-4, atol=1e-6)
        rescored += int((tokens != logits.argmax(-1)).sum())

        # training path: one block anchored at len(p) sees exactly the same context
        seq = torch.tensor([p + [int(roots[i])] + [0] * BLOCK])
        _, taps_full = target.forward_train(seq, tap_layers=(0, 2))
        hid = drafter.forward_train(
            taps_full, target.embed_tokens(block)[None, None], torch.tensor([[len(p)]])
        )
        torch.testing.assert_close(hid[0, 0, 1:], hidden, rtol=1e-4, atol=1e-4)
    assert rescored > 0, "the selector never changed the unary argmax: the test would not see it"
