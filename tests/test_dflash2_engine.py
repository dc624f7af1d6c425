"""DFlash2 drafters through the real engine (toy targets with DFlash2 drafters trained by
`train/toy.py`'s recipe plus the selector loss): at T=0 DFLASH (the selector's chain) and DDTREE
(the path-conditioned tree; fixed budgets with top-k caps and shadow-linear, and `auto`) emit
exactly the AR tokens, dense and hybrid, eager and on the (capture-off) static graph path, with the
mean accepted length > 2 asserted on the outputs compared; T > 0 keeps the target's distribution
(chi-square, dense and hybrid). ~2.5 min on one core (most of it the chi-square samples)."""

import pytest
from engine_utils import GREEDY, accepted_prompts, make_llm, mean_accept, run
from test_engine_sampling import first_tokens, same_distribution

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUTO = dict(speculative_ddtree_budget="auto", speculative_ddtree_max_budget=16)


@pytest.fixture(scope="module")
def ar_tokens(toy_pair):
    return [o.token_ids for o in run(toy_pair, accepted_prompts())]


def test_the_pair_is_dflash2(toy_dflash2_pair):
    from ddtree.models.dflash2 import DFlash2Drafter

    llm = make_llm(toy_dflash2_pair, "DFLASH")
    assert isinstance(llm.engine.runner.drafter, DFlash2Drafter)


def test_dflash_chain_is_lossless_and_accepts(toy_dflash2_pair, ar_tokens):
    outs = run(toy_dflash2_pair, accepted_prompts(), algorithm="DFLASH")
    assert [o.token_ids for o in outs] == ar_tokens
    assert mean_accept(outs) > 2


@pytest.mark.parametrize(
    "budget,shadow,cap",
    [(4, True, None), (16, False, None), (16, True, 4), (64, False, 1), (64, True, None)],
)
def test_ddtree_is_lossless_and_accepts(toy_dflash2_pair, ar_tokens, budget, shadow, cap):
    outs = run(
        toy_dflash2_pair,
        accepted_prompts(),
        algorithm="DDTREE",
        speculative_ddtree_budget=budget,
        speculative_ddtree_topk_cap=cap or budget,
        speculative_ddtree_shadow_linear=shadow,
    )
    assert [o.token_ids for o in outs] == ar_tokens
    assert mean_accept(outs) > 2


def test_auto_budget_is_lossless_and_accepts(toy_dflash2_pair, ar_tokens):
    llm = make_llm(toy_dflash2_pair, "DDTREE", **AUTO)
    outs = llm.generate([list(p) for p in accepted_prompts()], GREEDY)
    assert [o.token_ids for o in outs] == ar_tokens and mean_accept(outs) > 2
    # the policy learnt from the path-conditioned trees' own path probabilities
    assert llm.engine.decoder.budgets.policy.prior_chain > 1


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
def test_static_graph_path_equals_eager(toy_dflash2_pair, ar_tokens, algorithm):
    """The draft graph's forward (static buffers, padded rows: capture off on the CPU) builds the
    same chain / tree: tokens == AR with drafts accepted."""
    from test_cuda_graph import attach_graphs

    llm = make_llm(toy_dflash2_pair, algorithm, speculative_ddtree_budget=16)
    g = attach_graphs(llm, 8)
    ran = []
    for gs in g.draft_sets.values():
        real = gs.run
        gs.run = lambda b, lens, real=real: ran.append(b) or real(b, lens)
    outs = llm.generate([list(p) for p in accepted_prompts()], GREEDY)
    assert ran, "the draft graph path never ran"
    assert [o.token_ids for o in outs] == ar_tokens and mean_accept(outs) > 2


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
def test_lowered_block_size_is_lossless(toy_dflash2_pair, ar_tokens, algorithm):
    """--speculative-dflash-block-size below the drafter's (8 -> 4): the convolutions run within
    the engine's block, whatever the drafter was trained at."""
    outs = run(
        toy_dflash2_pair,
        accepted_prompts(),
        algorithm=algorithm,
        speculative_ddtree_budget=16,
        speculative_dflash_block_size=4,
    )
    assert [o.token_ids for o in outs] == ar_tokens
    assert mean_accept(outs) > 2 and max(n for o in outs for n in o.accept_lengths) <= 4


def test_batch_equals_batch_of_one(toy_dflash2_pair):
    prompts = accepted_prompts()
    batched = run(toy_dflash2_pair, prompts, algorithm="DDTREE", speculative_ddtree_budget=16)
    for p, o in zip(prompts[:3], batched):
        alone = run(toy_dflash2_pair, [p], algorithm="DDTREE", speculative_ddtree_budget=16)[0]
        assert alone.token_ids == o.token_ids
    assert mean_accept(batched) > 2


@pytest.fixture(scope="module")
def hybrid_ar_tokens(toy_hybrid_pair):
    return [o.token_ids for o in run(toy_hybrid_pair, accepted_prompts())]


@pytest.mark.parametrize(
    "algorithm,kw",
    [
        ("DFLASH", {}),
        ("DDTREE", dict(speculative_ddtree_budget=16)),
        ("DDTREE", dict(speculative_ddtree_budget=32, mamba_scheduler_strategy="no_buffer")),
        ("DDTREE", AUTO),
    ],
)
def test_hybrid_target_is_lossless(toy_hybrid_dflash2_pair, hybrid_ar_tokens, algorithm, kw):
    outs = run(toy_hybrid_dflash2_pair, accepted_prompts(), algorithm=algorithm, **kw)
    assert [o.token_ids for o in outs] == hybrid_ar_tokens
    assert mean_accept(outs) > 2


@pytest.fixture(scope="module")
def ar_counts(toy_pair):
    return first_tokens(make_llm(toy_pair, "NONE", max_running_requests=256), seed0=1000)


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
def test_sampling_matches_ar(toy_dflash2_pair, ar_counts, algorithm):
    """T > 0: the target draws at every node of the (deterministic) DFlash2 chain / tree and the
    walk follows the draws, so the output distribution is the target's whatever was drafted."""
    llm = make_llm(
        toy_dflash2_pair, algorithm, speculative_ddtree_budget=16, max_running_requests=256
    )
    counts = first_tokens(llm, seed0=100_000)
    assert len(ar_counts) > 5, "the test needs a spread-out distribution"
    assert same_distribution(ar_counts, counts) > 1e-3


@pytest.fixture(scope="module")
def hybrid_ar_counts(toy_hybrid_pair):
    from test_hybrid_engine import sample_first_tokens

    return sample_first_tokens(
        make_llm(toy_hybrid_pair, "NONE", max_running_requests=256), seed0=1000
    )[0]


def test_hybrid_sampling_matches_ar(toy_hybrid_dflash2_pair, hybrid_ar_counts):
    from test_hybrid_engine import sample_first_tokens

    llm = make_llm(
        toy_hybrid_dflash2_pair, "DDTREE", speculative_ddtree_budget=16, max_running_requests=256
    )
    counts, outs = sample_first_tokens(llm, seed0=100_000)
    assert len(hybrid_ar_counts) > 5, "the test needs a spread-out distribution"
    assert same_distribution(hybrid_ar_counts, counts) > 1e-3
    assert mean_accept(outs) > 1.2  # drafts are accepted at T > 0 too: the walk is exercised


def test_marginal_tree_flag_acts_and_is_lossless(toy_dflash2_pair, ar_tokens):
    """--speculative-ddtree-dflash2-tree marginal reaches the drafter's constructor (DDTree over
    the unary marginals: the bench's A/B) and stays lossless; path (the default) keeps the
    path-conditioned tree."""
    for tree, marginal in ((None, False), ("path", False), ("marginal", True)):
        llm = make_llm(
            toy_dflash2_pair,
            "DDTREE",
            speculative_ddtree_budget=16,
            speculative_ddtree_dflash2_tree=tree,
        )
        assert llm.engine.runner.drafter.marginal_tree is marginal
    outs = llm.generate([list(p) for p in accepted_prompts()], GREEDY)
    assert [o.token_ids for o in outs] == ar_tokens and mean_accept(outs) > 2
