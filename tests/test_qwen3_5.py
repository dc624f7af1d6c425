"""Hybrid Qwen3.5 target against transformers on tiny random configs: dense forward, text and VLM checkpoint
layouts, the paged path with the recurrent-state pool (chunked ragged prefill, decode), and tree verify
through GDN layers with commit by copy (extra_buffer) and by replay (no_buffer)."""

import inspect

import pytest
import torch
from hybrid_fixtures import VOCAB, hf_logits, save_hf_qwen3_5, save_hf_qwen3_5_vlm

from ddtree.engine.memory.state_pool import HybridStatePool, state_bytes_per_request
from ddtree.engine.model_runner import ModelRunner, RunnerConfig
from ddtree.engine.scheduling.request import Req, SamplingParams
from ddtree.models.loader import load_target
from ddtree.models.qwen3_5 import Qwen3_5ForCausalLM
from ddtree.speculative.tree import DraftTree

TOL = dict(rtol=1e-4, atol=1e-4)
from ddtree.engine.config import MAMBA_STRATEGIES as STRATEGIES  # noqa: E402


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_text")
    return save_hf_qwen3_5(path), str(path)


def _seq(seed, n=24):
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(target, strategy, width=12, ssm_dtype="float32"):
    cfg = RunnerConfig(
        page_size=4,
        num_pages=64,
        max_running_requests=4,
        max_context=96,
        max_verify_width=width,
        mamba_strategy=strategy,
        mamba_ssm_dtype=ssm_dtype,
    )
    return ModelRunner(target, None, cfg, "cpu", torch.float32)


def _reqs(runner, seqs, lens):
    runner.bm.allocate(
        Req(prompt_ids=[2], params=SamplingParams(temperature=0)), 1
    )  # pool rows need not start at 0
    return [Req(prompt_ids=s[:n], params=SamplingParams(temperature=0)) for s, n in zip(seqs, lens)]


def _prefill(runner, reqs, chunks):
    last = None
    for q_lens in chunks:
        last = runner.prefill(reqs, q_lens)
    return last


def test_dense_forward_matches_transformers(text_ckpt):
    hf, path = text_ckpt
    ours = load_target(path, torch.float32)
    assert isinstance(ours, Qwen3_5ForCausalLM) and ours.config.is_hybrid
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, taps = ours.forward_train(ids, tap_layers=(0, 2))
    torch.testing.assert_close(logits, ref.logits, **TOL)
    torch.testing.assert_close(
        taps[..., :64], ref.hidden_states[1], **TOL
    )  # output of layer 0 (GDN)
    torch.testing.assert_close(taps[..., 64:], ref.hidden_states[3], **TOL)  # output of layer 2


def test_vlm_checkpoint_loads_and_matches(tmp_path):
    hf = save_hf_qwen3_5_vlm(tmp_path)
    ours = load_target(str(tmp_path), torch.float32)  # vision tower keys are skipped
    assert ours.config.weight_prefix == "model.language_model."
    assert not any("visual" in n for n, _ in ours.named_parameters())
    ids = _seq(5, 30)
    with torch.no_grad():
        got = ours.forward_train(torch.tensor([ids]))[0][0]
    torch.testing.assert_close(got, hf_logits(hf, ids), **TOL)


def test_bf16_forward_close(tmp_path):
    hf = save_hf_qwen3_5(tmp_path, dtype=torch.bfloat16)
    ours = load_target(str(tmp_path))
    assert ours.lm_head.weight.dtype == torch.bfloat16
    ids = torch.tensor([_seq(6, 20)])
    with torch.no_grad():
        ref, got = hf(ids).logits.float(), ours.forward_train(ids)[0].float()
    assert (got - ref).abs().max() / ref.abs().max() < 0.05


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_paged_prefill_and_decode_match_transformers(text_ckpt, strategy):
    hf, path = text_ckpt
    runner = _runner(load_target(path, torch.float32), strategy)
    seqs, lens = [_seq(2), _seq(3)], [9, 14]
    reqs = _reqs(runner, seqs, lens)
    # ragged chunks, one request idle in a chunk
    last = _prefill(runner, reqs, [[4, 6], [0, 3], [5, 5]])
    ref = [hf_logits(hf, s) for s in seqs]
    for i, n in enumerate(lens):
        torch.testing.assert_close(last[i], ref[i][n - 1], **TOL)
    for step in range(6):  # AR decode = one-node tree + commit(path [[0]], accept 0)
        roots = torch.tensor([s[n + step] for s, n in zip(seqs, lens)])
        tree = DraftTree.from_parents(roots[:, None], torch.full((2, 1), -1), num_depths=0)
        rnd = runner.begin(reqs)
        vo = runner.verify(rnd, tree)
        logits = vo.logits
        zeros = torch.zeros(2, dtype=torch.int64)
        runner.commit(rnd, vo, zeros[:, None], zeros)
        for i, (r, n) in enumerate(zip(reqs, lens)):
            torch.testing.assert_close(logits[i, 0], ref[i][n + step], **TOL)
            r.kv_len += 1


def test_decode_matches_transformers_cache(text_ckpt):
    """Our state carried through the pool == transformers' own cached decode (not only its full forward)."""
    hf, path = text_ckpt
    runner = _runner(load_target(path, torch.float32), "extra_buffer")
    seq = _seq(4)
    reqs = _reqs(runner, [seq], [10])
    _prefill(runner, reqs, [[10]])
    # transformers renamed past_key_values -> cache (5.2x); accept either spelling
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf(torch.tensor([seq[:10]]), use_cache=True)
        cache = getattr(out, key)
        for step in range(4):
            tok = seq[10 + step]
            ref = hf(torch.tensor([[tok]]), use_cache=True, **{key: cache}).logits[0, -1]
            tree = DraftTree.from_parents(
                torch.tensor([[tok]]), torch.full((1, 1), -1), num_depths=0
            )
            rnd = runner.begin(reqs)
            vo = runner.verify(rnd, tree)
            got = vo.logits
            zero = torch.zeros(1, dtype=torch.int64)
            runner.commit(rnd, vo, zero[:, None], zero)
            reqs[0].kv_len += 1
            torch.testing.assert_close(got[0, 0], ref, **TOL)


# Request 0: a depth-4 tree whose accepted path 0 -> 2 -> 5 -> 7 -> 9 is not the first branch, so shallow nodes'
# conv windows reach into the committed state and deep ones lie wholly inside the tree.
PARENTS = [
    [-1, 0, 0, 1, 1, 2, 3, 5, 6, 7],
    [-1, 0, 1, 0, 3, 4, -1, -1, -1, -1],  # padding nodes after a chain and a branch
]
PATHS = [[0, 2, 5, 7, 9], [0, 0, 0, 0, 0]]
ACCEPT = [4, 0]  # request 1: the whole tree is rejected


def _chain(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _verify_round(path, strategy, ssm_dtype="float32"):
    runner = _runner(load_target(path, torch.float32), strategy, ssm_dtype=ssm_dtype)
    seqs, lens = [_seq(7), _seq(8)], [11, 6]
    reqs = _reqs(runner, seqs, lens)
    _prefill(runner, reqs, [[7, 6], [4, 0]])
    gen = torch.Generator().manual_seed(9)
    tokens = torch.randint(2, VOCAB, (2, 10), generator=gen)
    tree = DraftTree.from_parents(tokens, torch.tensor(PARENTS), num_depths=4)
    pool = runner.state_pool
    before = (pool.conv.clone(), pool.ssm.clone())
    rnd = runner.begin(reqs)
    vo = runner.verify(rnd, tree)
    logits = vo.logits
    # verify never commits
    assert torch.equal(pool.conv, before[0]) and torch.equal(pool.ssm, before[1])
    runner.commit(rnd, vo, torch.tensor(PATHS), torch.tensor(ACCEPT))
    return runner, reqs, seqs, lens, tokens, tree, logits


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tree_verify_node_logits_equal_sequential_chains(text_ckpt, strategy):
    hf, path = text_ckpt
    _, _, seqs, lens, tokens, tree, logits = _verify_round(path, strategy)
    for b in range(2):
        prompt = seqs[b][: lens[b]]
        for node in range(10):
            if not tree.valid[b, node]:
                continue
            chain = [int(tokens[b, i]) for i in _chain(PARENTS[b], node)]
            torch.testing.assert_close(logits[b, node], hf_logits(hf, prompt + chain)[-1], **TOL)


def _sequential_state(path, reqs_tokens):
    """Pool rows after prefilling each request's prompt + accepted chain from scratch."""
    runner = _runner(load_target(path, torch.float32), "extra_buffer")
    reqs = _reqs(runner, reqs_tokens, [len(t) for t in reqs_tokens])
    _prefill(runner, reqs, [[len(t) for t in reqs_tokens]])
    return runner.state_pool


def test_commit_copy_equals_replay_equals_sequential(text_ckpt):
    hf, path = text_ckpt
    pools, runs = {}, {}
    for strategy in STRATEGIES:
        run = _verify_round(path, strategy)
        pools[strategy], runs[strategy] = run[0].state_pool, run
    _, reqs, seqs, lens, tokens, _, _ = runs["extra_buffer"]
    accepted = [
        seqs[b][: lens[b]] + [int(tokens[b, i]) for i in PATHS[b][: ACCEPT[b] + 1]]
        for b in range(2)
    ]
    seq_pool = _sequential_state(path, accepted)
    rows = torch.tensor([r.slot for r in reqs])
    for name in ("conv", "ssm"):
        copy, replay, ref = (
            getattr(p, name)[:, rows] for p in (pools["extra_buffer"], pools["no_buffer"], seq_pool)
        )
        torch.testing.assert_close(copy, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(replay, ref, rtol=1e-5, atol=1e-5)
    # after the commit both strategies keep decoding in lockstep with transformers
    for strategy, (runner, reqs, *_rest) in runs.items():
        for r, acc in zip(reqs, ACCEPT):
            r.kv_len += acc + 1
        nxt = torch.tensor([3, 4])
        tree = DraftTree.from_parents(nxt[:, None], torch.full((2, 1), -1), num_depths=0)
        logits = runner.verify(runner.begin(reqs), tree).logits
        for b in range(2):
            torch.testing.assert_close(
                logits[b, 0], hf_logits(hf, accepted[b] + [int(nxt[b])])[-1], **TOL
            )


def test_bf16_ssm_state_close(text_ckpt):
    _, path = text_ckpt
    ref = _verify_round(path, "extra_buffer")[6]
    for strategy in STRATEGIES:
        runner, *_rest, logits = _verify_round(path, strategy, ssm_dtype="bfloat16")
        assert runner.state_pool.ssm.dtype == torch.bfloat16
        assert (logits - ref).abs().max() < 2e-2


def test_pool_bytes_and_shapes(text_ckpt):
    _, path = text_ckpt
    target = load_target(path, torch.float32)
    for strategy in STRATEGIES:
        pool = HybridStatePool.for_config(
            target.config, 3, 5, "cpu", strategy, "float32", torch.float32
        )
        assert isinstance(pool, HybridStatePool)
        state, stash = state_bytes_per_request(target.config, 5, strategy, "float32", torch.float32)
        assert pool.state_bytes == 3 * state and pool.stash_bytes == 3 * stash
        assert pool.bytes == pool.state_bytes + pool.stash_bytes
        assert pool.conv.shape == (3, 3, 2 * 2 * 8 + 4 * 8, 3) and pool.ssm.shape == (3, 3, 4, 8, 8)
    with pytest.raises(ValueError, match="mamba-scheduler-strategy"):
        HybridStatePool.for_config(target.config, 1, 1, "cpu", "lazy", "float32")
