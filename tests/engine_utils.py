"""Shared helpers for end-to-end engine tests on the toy pair."""

from __future__ import annotations

import functools

from ddtree import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def toy_prompts(n: int = 6, seed: int = 123) -> tuple[tuple[int, ...], ...]:
    """Prompts of different lengths cut from the synthetic corpus the toy pair was trained on."""
    from ddtree.train.data import synthetic_sequences

    seqs = synthetic_sequences(n, 48, 64, seed)
    lengths = [5, 9, 14, 20, 27, 33, 11, 17]
    return tuple(tuple(int(t) for t in seqs[i][: lengths[i % len(lengths)]]) for i in range(n))


def make_llm(pair, algorithm="NONE", **kw):
    target, drafter = pair
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    if algorithm != "NONE":
        kw.setdefault("speculative_draft_model_path", drafter)
    return LLM(target, speculative_algorithm=algorithm, **kw)


def run(pair, prompts, params=GREEDY, algorithm="NONE", **kw):
    llm = make_llm(pair, algorithm, **kw)
    return llm.generate([list(p) for p in prompts], params)


def mean_accept(outs) -> float:
    lengths = [n for o in outs for n in o.accept_lengths]
    return sum(lengths) / len(lengths)


def biased_sample_nodes(real):
    """A deliberately biased per-node sampler: half the nodes take the target's second choice. Used to show
    the distribution tests can fail."""
    import torch

    def biased(logits, params, gens, greedy=None):
        out = real(logits, params, gens, greedy)
        top2 = logits.topk(2, -1).indices[..., 1]
        flip = torch.rand(out.shape, generator=torch.Generator().manual_seed(0)) < 0.5
        return torch.where(flip, top2, out)

    return biased
