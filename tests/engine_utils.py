"""Shared helpers for end-to-end engine tests on the toy pair."""

from __future__ import annotations

import functools

from ddtree import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def toy_prompts(n: int = 6, seed: int = 123) -> tuple[tuple[int, ...], ...]:
    """Prompts of different lengths cut from the synthetic corpus the toy pair was trained on."""
    from ddtree.tools.train.data import synthetic_sequences

    seqs = synthetic_sequences(n, 48, 64, seed)
    lengths = [5, 9, 14, 20, 27, 33, 11, 17]
    return tuple(tuple(int(t) for t in seqs[i][: lengths[i % len(lengths)]]) for i in range(n))


def toy_pattern(kind: str, start: int, n: int, stride: int = 1) -> list[int]:
    """`n` tokens of one clean segment of the synthetic corpus (no noise): an arithmetic progression
    mod the regular range ("prog", `stride`) or a walk of the fixed successor permutation ("walk").
    The toy drafters are accepted on these (mean accepted length 3-7 after ~8 tokens of context)."""
    from ddtree.tools.train.data import NUM_SPECIAL, successor_table
    from ddtree.tools.train.toy import VOCAB

    regular = VOCAB - NUM_SPECIAL
    if kind == "prog":
        return [NUM_SPECIAL + (start + i * stride) % regular for i in range(n)]
    succ = successor_table(VOCAB)
    out = [NUM_SPECIAL + start % regular]
    while len(out) < n:
        out.append(int(succ[out[-1]]))
    return out


# (kind, start, stride) of the accepted prompts, in order; mixed kinds and strides
_PATTERNS = (("prog", 3, 2), ("walk", 30, 1), ("prog", 17, -3), ("walk", 9, 1), ("prog", 50, 1))
_PATTERNS += (("prog", 40, -2), ("walk", 44, 1), ("prog", 25, 3))


@functools.lru_cache(maxsize=None)
def accepted_prompts(n: int = 6, lengths: tuple[int, ...] = (9, 14, 20, 27, 33, 11, 17, 24)):
    """Ragged prompts the toy drafters are really accepted on: `<|bos|>` + a clean corpus segment
    (`toy_pattern`). For the lossless tests, whose comparisons only exercise speculation when drafts
    are accepted (`mean_accept(outs) > 2`); `toy_prompts`' short noisy cuts accept ~1.1-2.4."""
    from ddtree.tools.train.data import BOS_ID

    return tuple(
        tuple([BOS_ID] + toy_pattern(k, s, lengths[i % len(lengths)] - 1, d))
        for i, (k, s, d) in zip(range(n), _PATTERNS * (1 + n // len(_PATTERNS)))
    )


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
    """Tokens per decode round over all `outs` (RequestOutput.accept_lengths: 1 + accepted drafts)."""
    lengths = [n for o in outs for n in o.accept_lengths]
    return sum(lengths) / len(lengths)


def biased_sample_nodes(real):
    """A deliberately biased per-node sampler: half the nodes take the target's second choice. Used to show
    the distribution tests can fail."""
    import torch

    def biased(logits, params, seeds, positions, greedy=None):
        out = real(logits, params, seeds, positions, greedy)
        top2 = logits.topk(2, -1).indices[..., 1]
        flip = torch.rand(out.shape, generator=torch.Generator().manual_seed(0)) < 0.5
        return torch.where(flip, top2, out)

    return biased
