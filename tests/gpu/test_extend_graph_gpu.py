"""The graphed short extend on the device (captured CUDA graphs, fp32): multi-turn conversations
over a cached system prompt give the same tokens with the extend graphs as with
every prefill eager (no extend widths; every other graph on in both), and the extend graphs really replay, in more
than one pass for a long turn and at batch > 1. The embedded pair (AR / DFLASH / DDTREE) and the
toy hybrid pair (extra_buffer and no_buffer).

    python3 -m pytest -q -m gpu tests/gpu/test_extend_graph_gpu.py
"""

import os

import pytest
import torch
from engine_utils import accepted_prompts, mean_accept

from ddtree import envs

pytestmark = pytest.mark.gpu

ALGOS = [("NONE", None), ("DFLASH", None), ("DDTREE", 16)]


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    from ddtree.tools.train.toy import build_toy_hybrid_pair

    out = (
        os.path.join(envs.CACHE.get(), "toy_hybrid_pair")
        if envs.CACHE.get()
        else str(tmp_path_factory.mktemp("toy_hybrid_pair"))
    )
    return build_toy_hybrid_pair(out)


def _llm(target, drafter, algo, budget, **kw):
    from ddtree import LLM

    if algo != "NONE":
        kw["speculative_draft_model_path"] = drafter
    if budget:
        kw["speculative_ddtree_budget"] = budget
    return LLM(
        target,
        speculative_algorithm=algo,
        dtype="float32",
        device="cuda",
        attention_backend="triton",
        cuda_graph_max_bs=8,
        max_running_requests=8,
        **kw,
    )


def _run(make, convs_of, monkeypatch, eager: bool):
    """(outputs, extend passes [(width, live rows)]) of one engine's conversation."""
    import ddtree.engine.config as engine_config

    # every prefill eager: no extend widths to capture (the graphs of the other steps stay)
    real = engine_config.extend_widths
    monkeypatch.setattr(engine_config, "extend_widths", (lambda longest: ()) if eager else real)
    llm = make()
    monkeypatch.setattr(engine_config, "extend_widths", real)
    graphs = llm.engine.runner.graphs
    assert graphs is not None, "CUDA graphs were not enabled (see the log)"
    assert (graphs.extend is None) == eager, "the extend graphs failed to capture (see the log)"
    passes = []
    if graphs.extend is not None:
        run = graphs.extend.run
        graphs.extend.run = lambda w, h, lens: passes.append((w, h.shape[0])) or run(w, h, lens)
    outs = convs_of(llm)
    llm.engine.runner.bm.check_integrity()
    del llm, graphs
    torch.cuda.empty_cache()
    return outs, passes


def _dense_chat(llm):
    """Turn 1: system (70 tokens, ends mid-page) + 9 user tokens, batch 4; turn 2: + the reply +
    5 tokens, and one conversation + 300 held-out tokens (two passes at width 256)."""
    import inspect
    import textwrap

    from ddtree import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    src = inspect.getsource(textwrap)
    enc = llm.tokenizer.encode
    system = enc(src[:4000], add_special_tokens=False)[:70]
    users = [enc(src[4000 + 300 * i :], add_special_tokens=False)[:9] for i in range(4)]
    long = enc(src[6000:], add_special_tokens=False)[:300]
    convs = [system + u for u in users]
    outs = llm.generate([list(c) for c in convs], params)
    convs = [c + o.token_ids + users[(i + 1) % 4][:5] for i, (c, o) in enumerate(zip(convs, outs))]
    return outs + llm.generate([list(c) for c in convs] + [convs[0] + long], params)


@pytest.mark.parametrize("algo,budget", ALGOS)
def test_graphed_extend_matches_eager_dense(pair, monkeypatch, algo, budget):
    pytest.importorskip("triton")

    def make():
        return _llm(*pair, algo, budget, page_size=16, context_length=2048)

    ref, _ = _run(make, _dense_chat, monkeypatch, eager=True)
    outs, passes = _run(make, _dense_chat, monkeypatch, eager=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert any(b > 1 for _, b in passes) and any(w == 256 for w, _ in passes), passes
    assert all(o.cached_tokens >= 64 for o in outs[4:]), [o.cached_tokens for o in outs]
    if algo != "NONE":
        assert mean_accept(outs) > 2


@pytest.mark.parametrize("algo,budget", ALGOS)
@pytest.mark.parametrize("strategy", ["extra_buffer", "no_buffer"])
def test_graphed_extend_matches_eager_hybrid(hybrid_pair, monkeypatch, algo, budget, strategy):
    from ddtree import SamplingParams

    pytest.importorskip("triton")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [list(p) for p in accepted_prompts(5)]

    def chat(llm):
        outs = llm.generate(prompts, params)
        turn2 = [p + o.token_ids + p[1:6] for p, o in zip(prompts, outs)]
        return outs + llm.generate(turn2, params) + llm.generate(turn2[:1], params)

    def make():
        kw = dict(mamba_scheduler_strategy=strategy, page_size=4, max_total_tokens=4096)
        return _llm(*hybrid_pair, algo, budget, **kw)

    ref, _ = _run(make, chat, monkeypatch, eager=True)
    outs, passes = _run(make, chat, monkeypatch, eager=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert passes and any(b > 1 for _, b in passes), passes
    assert any(o.cached_tokens for o in outs[5:])
    if algo != "NONE":
        assert mean_accept(outs) > 2
