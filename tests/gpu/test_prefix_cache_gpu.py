"""The prefix cache on the device with CUDA graphs and the Triton kernels, on the embedded pair (fp32):
two-turn conversations over a shared system prompt that ends mid-page give the same tokens with the
cache as with --disable-radix-cache (AR / DFLASH / DDTREE), the second turn really hits the cache
and the graphs really replay; the pools drain clean."""

import pytest
import torch
from engine_utils import mean_accept, toy_pattern

pytestmark = pytest.mark.gpu

ALGOS = [("NONE", None), ("DFLASH", None), ("DDTREE", 16)]
PATTERNS = [("prog", 3, 2), ("walk", 30, 1), ("prog", 17, -3), ("walk", 9, 1)]


def _chat(llm, params):
    import inspect
    import textwrap

    src = inspect.getsource(textwrap)
    system = llm.tokenizer.encode(src[:4000], add_special_tokens=False)[:70]  # 4 pages + 6
    users = [
        llm.tokenizer.encode(src[4000 + 300 * i :], add_special_tokens=False)[:9] for i in range(4)
    ]
    convs = [system + u for u in users]
    outs = []
    for turn in range(2):
        got = llm.generate([list(c) for c in convs], params)
        outs += got
        convs = [
            c + o.token_ids + users[(i + 1) % 4][:5] for i, (c, o) in enumerate(zip(convs, got))
        ]
    return outs


@pytest.mark.parametrize("algo,budget", ALGOS)
def test_cache_matches_no_cache_under_graphs(pair, algo, budget):
    from ddtree import LLM, SamplingParams

    pytest.importorskip("triton")
    target, drafter = pair
    kw = dict(
        dtype="float32",
        device="cuda",
        attention_backend="triton",
        cuda_graph_max_bs=8,
        max_running_requests=8,
        context_length=1024,
        page_size=16,
        speculative_algorithm=algo,
    )
    if algo != "NONE":
        kw["speculative_draft_model_path"] = drafter
    if budget:
        kw["speculative_ddtree_budget"] = budget
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for cache in (False, True):
        llm = LLM(target, disable_radix_cache=not cache, **kw)
        graphs = llm.engine.runner.graphs
        assert graphs is not None, "CUDA graphs were not enabled (see the log)"
        replays = []
        verify = graphs.verify
        graphs.verify = lambda *a, _v=verify: replays.append(1) or _v(*a)
        outs = _chat(llm, params)
        tokens[cache] = [o.token_ids for o in outs]
        assert replays, "no verify replay"
        if algo != "NONE":  # held-out stdlib code: the drafts are really accepted
            assert mean_accept(outs) > 2, [o.accept_lengths for o in outs]
        if cache:
            assert all(o.cached_tokens >= 64 for o in outs[4:]), [o.cached_tokens for o in outs]
            bm = llm.engine.runner.bm
            bm.check_integrity()
            assert bm.num_available_pages == bm.num_pages and bm.num_cached_pages > 0
        del llm, graphs
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("strategy", ["extra_buffer", "no_buffer"])
def test_hybrid_cache_matches_no_cache_on_the_device(toy_hybrid_pair, strategy):
    """The toy hybrid pair on CUDA (fp32, the device GDN kernels): state checkpoints restore the
    exact recurrent state, so cache on == cache off, and the second turn hits."""
    from ddtree import LLM, SamplingParams
    from ddtree.tools.train.data import synthetic_sequences

    target, drafter = toy_hybrid_pair
    seqs = synthetic_sequences(4, 48, 64, 7)
    system = [int(t) for t in seqs[0][:21]]
    # user turns: clean corpus segments, which the toy drafter accepts (tests/test_prefix_cache_engine
    # .py's conversations; cuts of unrelated rows accepted ~1.3 a round); turn 2 continues each
    topics = [toy_pattern(k, s, 64, d) for k, s, d in PATTERNS]
    users = [t[:8] for t in topics]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for cache in (False, True):
        llm = LLM(
            target,
            dtype="float32",
            device="cuda",
            page_size=4,
            speculative_algorithm="DDTREE",
            speculative_draft_model_path=drafter,
            speculative_ddtree_budget=8,
            mamba_scheduler_strategy=strategy,
            disable_radix_cache=not cache,
        )
        convs = [system + u for u in users]
        outs = []
        for _ in range(2):
            got = llm.generate([list(c) for c in convs], params)
            outs += got
            convs = [c + o.token_ids + t[20:24] for c, o, t in zip(convs, got, topics)]
        tokens[cache] = [o.token_ids for o in outs]
        assert mean_accept(outs) > 2, [o.accept_lengths for o in outs]
        if cache:
            assert all(o.cached_tokens > 0 for o in outs[4:]), [o.cached_tokens for o in outs]
            llm.engine.runner.bm.check_integrity()
        del llm
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]
