"""Our Qwen3 target against transformers' Qwen3ForCausalLM on tiny random configs: dense forward, sharded
and tied checkpoints, and the paged-KV inference path (chunked prefill, then one-token decode steps)."""

import pytest
import torch
from hf_fixtures import save_hf_qwen3

from ddtree.engine.model_runner import ModelRunner, RunnerConfig
from ddtree.engine.round.data import root_tree
from ddtree.engine.scheduling.request import Req, SamplingParams
from ddtree.models.loader import load_target


@pytest.mark.parametrize(
    "tie,shard", [(False, None), (True, None), (False, "30KB"), (True, "30KB")]
)
def test_dense_logits_match_transformers(tmp_path, tie, shard):
    hf = save_hf_qwen3(tmp_path, tie_word_embeddings=tie, max_shard_size=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_target(str(tmp_path), torch.float32)
    ids = torch.randint(0, 97, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, taps = ours.forward_train(ids, tap_layers=(1, 2))
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        taps[..., :64], ref.hidden_states[2], rtol=1e-5, atol=1e-5
    )  # output of layer 1


def test_bf16_checkpoint_loads_in_its_dtype(tmp_path):
    hf = save_hf_qwen3(tmp_path, dtype=torch.bfloat16)
    ours = load_target(str(tmp_path))  # dtype "auto" -> config dtype
    assert ours.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = ours.forward_train(ids)[0].float()
    assert (got - ref).abs().max() / ref.abs().max() < 0.05


def test_paged_prefill_and_decode_match_transformers(tmp_path):
    hf = save_hf_qwen3(tmp_path, rope_theta=500.0)
    target = load_target(str(tmp_path), torch.float32)
    runner = ModelRunner(
        target,
        None,
        RunnerConfig(
            page_size=4, num_pages=64, max_running_requests=4, max_context=128, max_verify_width=1
        ),
        "cpu",
        torch.float32,
    )
    seqs = [
        torch.randint(2, 97, (21,), generator=torch.Generator().manual_seed(s)).tolist()
        for s in (2, 3)
    ]
    prompt_lens = [9, 14]
    reqs = [
        Req(prompt_ids=s[:n], params=SamplingParams(temperature=0))
        for s, n in zip(seqs, prompt_lens)
    ]
    # chunked prefill: two chunks of uneven sizes in a ragged batch
    runner.prefill(reqs, [4, 6])
    last = runner.prefill(reqs, [5, 8])
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]
    for i, n in enumerate(prompt_lens):
        torch.testing.assert_close(last[i], ref[i][n - 1], rtol=1e-4, atol=1e-4)
    # decode: feed the true next tokens one at a time as one-node trees
    for step in range(5):
        roots = torch.tensor([s[n + step] for s, n in zip(seqs, prompt_lens)])
        rnd = runner.begin(reqs)
        vo = runner.verify(rnd, root_tree(roots))
        logits = vo.logits
        zeros = torch.zeros(2, dtype=torch.int64)
        runner.commit(rnd, vo, zeros[:, None], zeros)
        for i, (r, n) in enumerate(zip(reqs, prompt_lens)):
            torch.testing.assert_close(logits[i, 0], ref[i][n + step], rtol=1e-4, atol=1e-4)
            r.kv_len += 1
