"""The inflated pair through the engine (`ddtree.LLM`, fp32, CPU): T=0 tokens equal the small pair's for
DFLASH and DDTREE, and at T > 0 no padded-vocabulary token is ever emitted."""

from __future__ import annotations

import pytest
import torch

from inflate_fixtures import PROMPTS, SRC_VOCAB, shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY_KW = dict(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{"small": (target, drafter), "dense": ..., "hybrid": ...} as model directories."""
    from ddtree.assets import default_model_paths
    from ddtree.inflate import inflate_pair, write_pair

    t, d = default_model_paths()
    out = {"small": (t, d)}
    for kind in ("dense", "hybrid"):
        pair = inflate_pair(t, d, shape(kind), dtype=torch.float32)
        out[kind] = write_pair(pair, str(tmp_path_factory.mktemp(f"inflated_{kind}")))
    return out


def generate(pair, algorithm, params, **kw):
    from ddtree import LLM

    target, drafter = pair
    if algorithm != "NONE":
        kw["speculative_draft_model_path"] = drafter
    llm = LLM(target, speculative_algorithm=algorithm, dtype="float32", device="cpu", **kw)
    return llm.generate(list(PROMPTS), params)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("algorithm,kw", [("DFLASH", {}), ("DDTREE", {"speculative_ddtree_budget": 16})])
def test_t0_tokens_equal_small_pair(pairs, kind, algorithm, kw):
    from ddtree import SamplingParams

    params = SamplingParams(**GREEDY_KW)
    small = generate(pairs["small"], algorithm, params, **kw)
    big = generate(pairs[kind], algorithm, params, **kw)
    assert [o.token_ids for o in big] == [o.token_ids for o in small]
    # the drafts really are accepted, and as often as the small pair's
    acc = [sum(n for o in outs for n in o.accept_lengths) / sum(len(o.accept_lengths) for o in outs)
           for outs in (small, big)]
    assert acc[0] > 1.5 and acc[1] == pytest.approx(acc[0])


def test_no_padded_token_is_sampled(pairs):
    from ddtree import SamplingParams

    params = SamplingParams(temperature=1.5, max_tokens=48, ignore_eos=True, seed=7)
    outs = generate(pairs["dense"], "DDTREE", params, speculative_ddtree_budget=16)
    ids = [t for o in outs for t in o.token_ids]
    assert len(ids) == 48 * len(PROMPTS)
    assert max(ids) < SRC_VOCAB
