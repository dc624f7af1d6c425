"""Grammars inside speculation, on the toy pairs: DFLASH / DDTREE (fixed and auto) == AR under the
same grammar token for token at T=0 (fp32) on prompts whose drafts are accepted, the grammar
really changes the output, a mixed batch leaves the other requests alone, the distribution at
T>0 matches AR's (chi-square), a grammar's dead end ends the request, and a vocabulary padded past
the tokenizer with padding rows that would win decodes, in every mode, what the unpadded pair
decodes. ~60 s on one thread."""

import collections
import os

import pytest
from engine_utils import accepted_prompts, make_llm, mean_accept
from test_engine_sampling import same_distribution

from ddtree import SamplingParams
from ddtree.grammar import GrammarSpec

# toy tokens are the numbers 4..63 as text: this forbids the ones with a 0 (10, 20, ... 60), which
# the clean corpus segments run through, so the grammar bites while drafts stay accepted
NO_ZERO = GrammarSpec.regex(r"[1-9]*")
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, grammar=NO_ZERO)
FREE = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def tokens(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    return [list(p) for p in accepted_prompts(6)]


@pytest.fixture(scope="module")
def ar(toy_pair, prompts, one_torch_thread):
    llm = make_llm(toy_pair, "NONE")
    return tokens(llm.generate(prompts, GREEDY)), tokens(llm.generate(prompts, FREE))


@pytest.mark.parametrize(
    "algorithm,kw",
    [
        ("DFLASH", {}),
        ("DDTREE", {"speculative_ddtree_budget": 16}),
        ("DDTREE", {"speculative_ddtree_budget": "auto"}),
    ],
    ids=["dflash", "ddtree16", "auto"],
)
def test_speculative_equals_ar_under_grammar(toy_pair, prompts, ar, algorithm, kw):
    constrained, free = ar
    assert sum(a != b for a, b in zip(constrained, free)) >= 3, "the grammar must bite"
    assert all(all("0" not in str(t) for t in seq) for seq in constrained)
    outs = make_llm(toy_pair, algorithm, **kw).generate(prompts, GREEDY)
    assert tokens(outs) == constrained
    assert mean_accept(outs) > 2


def test_hybrid_ddtree_equals_ar_under_grammar(toy_hybrid_pair, prompts, one_torch_thread):
    ar = make_llm(toy_hybrid_pair, "NONE").generate(prompts[:3], GREEDY)
    outs = make_llm(toy_hybrid_pair, "DDTREE", speculative_ddtree_budget=16).generate(
        prompts[:3], GREEDY
    )
    assert tokens(outs) == tokens(ar)
    assert mean_accept(outs) > 2


def test_mixed_batch(toy_pair, prompts, ar):
    """Grammar and plain requests in one batch: each gets what it gets alone."""
    constrained, free = ar
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16)
    params = [GREEDY if i % 2 else FREE for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    want = [constrained[i] if i % 2 else free[i] for i in range(len(prompts))]
    assert tokens(outs) == want
    assert mean_accept(outs) > 2


def test_dead_end_finishes_the_request(toy_pair, prompts):
    """No toy token spells a letter: the grammar's start state allows nothing."""
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16)
    sp = SamplingParams(temperature=0, max_tokens=20, grammar=GrammarSpec.regex("[a-z]+"))
    out = llm.generate(prompts[:2] + prompts[:1], [sp, FREE, sp])
    assert [o.finish_reason for o in out] == ["grammar", "length", "grammar"]
    assert out[0].token_ids == [] and len(out[1].token_ids) == 40


def test_grammar_end_is_a_stop(toy_pair, prompts):
    """A grammar that ends after two tokens: its mask then allows only EOS (the stop token)."""
    llm = make_llm(toy_pair, "DFLASH")
    sp = SamplingParams(temperature=0, max_tokens=20, grammar=GrammarSpec.regex(r"[1-9]{2,4}"))
    (out,) = llm.generate(prompts[:1], sp)
    assert out.finish_reason == "stop" and out.token_ids[-1] == 1
    text = "".join(str(t) for t in out.token_ids[:-1])
    assert 2 <= len(text) <= 4 and "0" not in text


def first_tokens(llm, seed0, n, k=2):
    sp = [
        SamplingParams(
            temperature=1.5, max_tokens=k, ignore_eos=True, seed=seed0 + i, grammar=NO_ZERO
        )
        for i in range(n)
    ]
    outs = llm.generate([list(accepted_prompts(1)[0][:6])] * n, sp)
    return collections.Counter(tuple(o.token_ids[:k]) for o in outs)


def test_sampling_distribution_matches_ar(toy_pair, one_torch_thread):
    n = 600
    ar = first_tokens(make_llm(toy_pair, "NONE", max_running_requests=128), 1000, n)
    dd = first_tokens(
        make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16, max_running_requests=128),
        100_000,
        n,
    )
    assert len(ar) > 5, "the test needs a spread-out distribution"
    assert all("0" not in str(t) for key in ar | dd for t in key)
    assert same_distribution(ar, dd) > 1e-3


@pytest.mark.parametrize(
    "algorithm,kw", [("DFLASH", {}), ("DDTREE", {"speculative_ddtree_budget": 16})]
)
def test_seeded_sampling_under_a_grammar_is_ar_token_for_token(toy_pair, prompts, algorithm, kw):
    """The grammar masks the logits before the keyed argmax (engine/round/sampler.py): a seeded request
    under a grammar draws AR's tokens in every mode, beside an unconstrained seeded one."""
    sp = [
        SamplingParams(
            temperature=t, max_tokens=30, ignore_eos=True, seed=5 + i, grammar=g, top_p=0.95
        )
        for i, (t, g) in enumerate([(0.8, NO_ZERO), (1.5, NO_ZERO), (0.8, None), (1.2, NO_ZERO)])
    ]
    ar = tokens(make_llm(toy_pair, "NONE").generate(prompts[:4], sp))
    outs = make_llm(toy_pair, algorithm, **kw).generate(prompts[:4], sp)
    assert tokens(outs) == ar and mean_accept(outs[:1]) > 1.5
    assert all("0" not in str(t) for i in (0, 1, 3) for t in ar[i])


def test_a_rolled_back_batch_resyncs_the_matchers(toy_pair, prompts, ar, monkeypatch):
    """A batched step that fails after the matchers took its tokens is rolled back (engine/
    faults.py): each request keeps only what it had emitted, so its matcher must go back too, and
    the requests, run again, produce what they would have."""
    from ddtree.engine.round import grammar as grammar_round

    constrained, _ = ar
    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16)
    real, state = grammar_round.GrammarBatch.advance, {"fails": 0}

    def advance(self, emitted):
        out = real(self, emitted)
        if len(self.rows) > 1 and state["fails"] == 0 and self.reqs[0].num_output_tokens >= 4:
            state["fails"] += 1
            raise RuntimeError("injected failure after the grammar advanced")
        return out

    real_init, behind = grammar_round.GrammarBatch.__init__, []

    def init(self, reqs, *args):  # every round starts at the kept tokens' state
        real_init(self, reqs, *args)
        behind.extend(r.grammar.accepted - r.num_output_tokens for r in reqs)

    monkeypatch.setattr(grammar_round.GrammarBatch, "advance", advance)
    monkeypatch.setattr(grammar_round.GrammarBatch, "__init__", init)
    outs = llm.generate(prompts[:4], GREEDY)
    assert state["fails"] == 1 and behind and set(behind) == {0}
    assert tokens(outs) == constrained[:4] and all(o.finish_reason == "length" for o in outs)


# the toy tokenizer's 64 ids, then padding rows (64 ends a 32-bit mask word; 90 does not)
PADDED = 90


@pytest.fixture(scope="module")
def padded_pair(toy_pair, tmp_path_factory):
    """The toy pair with its vocabulary padded past the tokenizer, as the inflated benchmark pairs
    and Qwen's checkpoints are, but with padding rows that would win: each LM-head padding row is
    twice a real word's row, so wherever that word's logit is positive its padding twin's is
    higher. Under a grammar the padding must never be allowed, so every mode must decode exactly
    what the unpadded pair decodes under the same grammar."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("padded_pair")
    target, drafter = (str(root / "target"), str(root / "drafter"))
    shutil.copytree(toy_pair[0], target)
    shutil.copytree(toy_pair[1], drafter)
    path = os.path.join(target, "model.safetensors")
    w = load_file(path)
    real = w["lm_head.weight"].shape[0]
    twins = torch.arange(4, 4 + PADDED - real)  # the words "4" .. "29"
    w["lm_head.weight"] = torch.cat([w["lm_head.weight"], 2 * w["lm_head.weight"][twins]])
    emb = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = torch.cat([emb, emb[twins]])
    save_file(w, path)
    for d in (target, drafter):
        cfg_path = os.path.join(d, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["vocab_size"] = PADDED
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    return target, drafter


@pytest.mark.parametrize(
    "algorithm,kw",
    [
        ("NONE", {}),
        ("DFLASH", {}),
        ("DDTREE", {"speculative_ddtree_budget": 16}),
        ("DDTREE", {"speculative_ddtree_budget": "auto"}),
    ],
    ids=["ar", "dflash", "ddtree16", "auto"],
)
def test_padded_vocab_under_grammar(padded_pair, prompts, ar, algorithm, kw):
    constrained, _ = ar
    llm = make_llm(padded_pair, algorithm, max_running_requests=3, **kw)
    free = tokens(llm.generate(prompts[:2], FREE))
    assert any(t >= 64 for seq in free for t in seq), "the padding rows must win unmasked"
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == constrained
    if algorithm != "NONE":
        assert mean_accept(outs) > 2
