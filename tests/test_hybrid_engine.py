"""End to end through the real engine on a trained hybrid pair (Qwen3.5 target: 3 Gated DeltaNet layers + 1
gated full-attention layer; fp32 CPU). At T=0, DFLASH and DDTREE emit exactly the AR tokens under both
recurrent-state commit strategies while drafts are really accepted, including rounds whose accepted path
leaves the first branch (so each node must see its parent chain's state, not the flat order's) and rounds
where the whole tree is rejected. At T>0 DDTREE keeps the target's distribution. Preemption stays lossless
and the KV and state pools drain clean."""

import collections

import pytest
import torch
from engine_utils import GREEDY, biased_sample_nodes, make_llm, mean_accept, run, toy_prompts
from test_engine_sampling import PROMPT, same_distribution

from ddtree import SamplingParams

STRATEGIES = ("extra_buffer", "no_buffer")
PROMPTS = toy_prompts(8)  # lengths 5..33
N_SAMPLES = (
    1000  # per distribution of the first 3 tokens at T=1 (~800 distinct outcomes, rare ones pooled)
)


def _run(pair, algorithm="NONE", strategy="extra_buffer", prompts=PROMPTS, **kw):
    return run(pair, prompts, algorithm=algorithm, mamba_scheduler_strategy=strategy, **kw)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ar_tokens(toy_hybrid_pair):
    return [o.token_ids for o in _run(toy_hybrid_pair)]


def test_target_exports_for_transformers_and_ar_matches_training_generate(
    toy_hybrid_pair, ar_tokens
):
    from transformers import Qwen3_5ForCausalLM as HFQwen3_5

    from ddtree.models.loader import load_target
    from ddtree.models.qwen3_5 import Qwen3_5ForCausalLM
    from ddtree.tools.train.lm import generate

    ours = load_target(toy_hybrid_pair[0], torch.float32)
    assert isinstance(ours, Qwen3_5ForCausalLM) and ours.config.is_hybrid
    assert len(ours.config.linear_layer_ids) == 3 and ours.config.attention_layer_ids == (3,)
    hf = HFQwen3_5.from_pretrained(toy_hybrid_pair[0], dtype=torch.float32).eval()
    ids = torch.tensor([list(PROMPTS[5])])
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_train(ids)[0], hf(ids).logits, rtol=1e-4, atol=1e-4)
    # the training side's cached generation (how the drafter's data was made) agrees with the engine
    new = len(ar_tokens[0])
    assert [g[len(p) :] for p, g in zip(PROMPTS, generate(ours, PROMPTS, new))] == ar_tokens
    assert [o.token_ids for o in _run(toy_hybrid_pair, strategy="no_buffer")] == ar_tokens


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dflash_is_lossless_and_accepts(toy_hybrid_pair, ar_tokens, strategy):
    outs = _run(toy_hybrid_pair, "DFLASH", strategy)
    assert [o.token_ids for o in outs] == ar_tokens
    assert mean_accept(outs) > 2


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shadow", [False, True])
@pytest.mark.parametrize("budget", [4, 16, 48])
def test_ddtree_is_lossless_and_accepts(toy_hybrid_pair, ar_tokens, budget, shadow, strategy):
    outs = _run(
        toy_hybrid_pair,
        "DDTREE",
        strategy,
        speculative_ddtree_budget=budget,
        speculative_ddtree_topk_cap=budget,
        speculative_ddtree_shadow_linear=shadow,
    )
    assert [o.token_ids for o in outs] == ar_tokens
    assert mean_accept(outs) > 2


@pytest.mark.parametrize(
    "algorithm,strategy",
    [
        ("NONE", "extra_buffer"),
        ("DFLASH", "no_buffer"),
        ("DDTREE", "extra_buffer"),
        ("DDTREE", "no_buffer"),
    ],
)
def test_batch_equals_batch_of_one(toy_hybrid_pair, algorithm, strategy):
    llm = make_llm(
        toy_hybrid_pair, algorithm, speculative_ddtree_budget=16, mamba_scheduler_strategy=strategy
    )
    batched = llm.generate([list(p) for p in PROMPTS], GREEDY)
    for p, o in zip(PROMPTS, batched):
        assert llm.generate([list(p)], GREEDY)[0].token_ids == o.token_ids
    if algorithm != "NONE":
        assert mean_accept(batched) > 2


def _record_walks(monkeypatch):
    """Wrap the decoder's accept walk; per request and round: (accepted drafts k, the walk left the first
    branch, the tree had drafted nodes)."""
    import ddtree.engine.round.decoder as dec

    real, rounds = dec.accept_tree, []

    def recording(tree, target_tokens):
        res = real(tree, target_tokens)
        parents, valid = tree.parents.cpu(), tree.valid.cpu()
        node = torch.arange(tree.num_nodes)
        for b, k in enumerate(res.accept_length.tolist()):
            path = res.path[b, 1 : k + 1].tolist()
            # siblings are ordered by draft score, so an accepted node with an earlier valid sibling is off the
            # first branch, and flat order puts non-ancestors between it and its parent
            off = any(
                bool((valid[b] & (parents[b] == parents[b, n]) & (node < n)).any()) for n in path
            )
            rounds.append((k, off, bool(valid[b, 1:].any())))
        return res

    monkeypatch.setattr(dec, "accept_tree", recording)
    return rounds


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_off_first_branch_and_rejected_trees_stay_lossless(
    toy_hybrid_pair, ar_tokens, strategy, monkeypatch
):
    rounds = _record_walks(monkeypatch)
    outs = _run(toy_hybrid_pair, "DDTREE", strategy, speculative_ddtree_budget=16)
    assert [o.token_ids for o in outs] == ar_tokens and mean_accept(outs) > 2
    off_first = [k for k, off, _ in rounds if off]
    rejected = [k for k, _, drafted in rounds if drafted and k == 0]
    assert off_first and rejected, (len(rounds), len(off_first), len(rejected))
    assert max(off_first) >= 2  # also deeper accepted paths through a non-first branch


def sample_first_tokens(llm, seed0: int, n: int = N_SAMPLES, k: int = 3):
    """(Counter of the first k tokens, outputs). Seeds are disjoint from the AR run's: with equal seeds a tree
    round's root draw is AR's draw, so the two samples would be coupled and the chi-square test vacuous."""
    sp = [
        SamplingParams(temperature=1.0, max_tokens=k, ignore_eos=True, seed=seed0 + i)
        for i in range(n)
    ]
    outs = llm.generate([PROMPT] * n, sp)
    return collections.Counter(tuple(o.token_ids[:k]) for o in outs), outs


@pytest.fixture(scope="module")
def ar_counts(toy_hybrid_pair):
    return sample_first_tokens(
        make_llm(toy_hybrid_pair, "NONE", max_running_requests=256), seed0=1000
    )[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ddtree_sampling_matches_ar(toy_hybrid_pair, ar_counts, strategy):
    llm = make_llm(
        toy_hybrid_pair,
        "DDTREE",
        speculative_ddtree_budget=16,
        max_running_requests=256,
        mamba_scheduler_strategy=strategy,
    )
    dd, outs = sample_first_tokens(llm, seed0=100_000)
    assert len(ar_counts) > 5, "the test needs a spread-out distribution"
    assert same_distribution(ar_counts, dd) > 1e-3
    assert mean_accept(outs) > 1.2  # drafts are accepted at T>0 too, so the walk is exercised
    assert "verify" in llm.engine.decoder.times.seconds


def test_biased_acceptance_is_detected(toy_hybrid_pair, ar_counts, monkeypatch):
    """The same chi-square test notices a walk biased toward the target's second choice (so it can fail)."""
    import ddtree.engine.round.decoder as dec

    monkeypatch.setattr(dec, "sample_nodes", biased_sample_nodes(dec.sample_nodes))
    llm = make_llm(
        toy_hybrid_pair, "DDTREE", speculative_ddtree_budget=16, max_running_requests=256
    )
    assert same_distribution(ar_counts, sample_first_tokens(llm, seed0=100_000)[0]) < 1e-3


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_preemption_is_lossless_and_pools_drain_clean(toy_hybrid_pair, ar_tokens, strategy):
    # a KV pool too small for all requests at once forces preempt-and-recompute (from a fresh recurrent
    # state); small prefill chunks carry the recurrent state across chunks
    llm = make_llm(
        toy_hybrid_pair,
        "DDTREE",
        speculative_ddtree_budget=16,
        mamba_scheduler_strategy=strategy,
        max_total_tokens=256,
        page_size=8,
        chunked_prefill_size=16,
    )
    outs = llm.generate([list(p) for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in outs] == ar_tokens and mean_accept(outs) > 2
    assert llm.engine.scheduler.num_preemptions > 0
    runner = llm.engine.runner
    bm = runner.bm
    bm.check_integrity()
    assert bm.num_available_pages == bm.num_pages  # all cached pages unreferenced
    assert bm.num_free_slots == runner.cfg.max_running_requests
    assert runner.state_pool is not None and runner.state_pool.strategy == strategy
    # state rows are reused dirty: a second pass must not see the first pass's recurrent state
    assert [o.token_ids for o in llm.generate([list(p) for p in PROMPTS], GREEDY)] == ar_tokens
