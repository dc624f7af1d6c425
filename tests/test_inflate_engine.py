"""The inflated pair through the engine (`ddtree.LLM`, fp32, CPU): T=0 tokens equal the small pair's
for DFLASH and DDTREE, and at T > 0 no padded-vocabulary token is ever emitted."""

from __future__ import annotations

import pytest
import torch
from inflate_fixtures import PROMPTS, SRC_VOCAB, shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY_KW = dict(temperature=0, max_tokens=24, ignore_eos=True)
# a small KV pool: the CPU default (2 GiB) takes longer to allocate than these runs take
POOL = dict(max_total_tokens=1024, max_running_requests=4)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{"small": (target, drafter), "dense": ..., "hybrid": ...} as model directories."""
    from ddtree.assets import default_model_paths
    from ddtree.tools.inflate import inflate_pair, write_pair

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
    llm = LLM(target, speculative_algorithm=algorithm, dtype="float32", device="cpu", **POOL, **kw)
    return llm.generate(list(PROMPTS), params)


ALGOS = {"DFLASH": {}, "DDTREE": {"speculative_ddtree_budget": 16}}


@pytest.fixture(scope="module")
def small_outputs(pairs):
    from ddtree import SamplingParams

    return {
        a: generate(pairs["small"], a, SamplingParams(**GREEDY_KW), **kw) for a, kw in ALGOS.items()
    }


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("algorithm", list(ALGOS))
def test_t0_tokens_equal_small_pair(pairs, small_outputs, kind, algorithm):
    from ddtree import SamplingParams

    small = small_outputs[algorithm]
    big = generate(pairs[kind], algorithm, SamplingParams(**GREEDY_KW), **ALGOS[algorithm])
    assert [o.token_ids for o in big] == [o.token_ids for o in small]
    # the drafts really are accepted, and as often as the small pair's
    acc = [
        sum(n for o in outs for n in o.accept_lengths) / sum(len(o.accept_lengths) for o in outs)
        for outs in (small, big)
    ]
    assert acc[0] > 2 and acc[1] == pytest.approx(acc[0])


def test_no_padded_token_is_sampled(pairs):
    from ddtree import SamplingParams

    params = SamplingParams(temperature=1.5, max_tokens=32, ignore_eos=True, seed=7)
    outs = generate(pairs["dense"], "DDTREE", params, speculative_ddtree_budget=16)
    ids = [t for o in outs for t in o.token_ids]
    assert len(ids) == 32 * len(PROMPTS)
    assert max(ids) < SRC_VOCAB
