"""The differential fuzzer in CI (issue 39; tests/fuzz_engine.py): CI_SEEDS cases through the engine,
four per config kind, each ~24 requests + n copies and twins, integrity checked after every step and
every output against AR cut by the stop-rule oracle (a fifth of the cases served in block FP8, against
FP8 AR; a third of the cases with one request whose
round, prefill or emission raises: it must fail alone); the seeds that ever failed; and the fuzzer
shown able to fail (a broken emitter, a release that caches a page it never wrote, a leaked slot).
About 60-90 s on 2 cores (~1 s per case + the references); `--long` mode: the CLI in
tests/fuzz_engine.py."""

from collections import Counter

import pytest
from fuzz_engine import KINDS, run_case, summarize
from fuzz_oracle import References

CI_SEEDS = tuple(range(4 * len(KINDS)))
# every case that ever failed: (seed, requests) -> what it found (fixed in the commit that added it)
REGRESSION_SEEDS = {
    (6, 24): "stop_hit was the text from the stop string on, not the stop string (SGLang's "
    "`matched`)",
    (9, 24): "a chunked prefill's later chunk found its pages taken by requests admitted after it",
    (226, 24): "a lone request at the context's end was one page short (the pool rounded down), "
    "preempted, never readmitted; its detokenizer outlived it",
    (468, 24): "a prompt needing the whole pool was refused while a cached page started like its "
    "own",
    (5101, 32): "a request failed in its emission kept the round's log-probs past its tokens",
    (5112, 32): "the same, failed at its first token",
    (439, 24): "a hybrid FP8 case's cached V moved 0.112 by an e4m3 rounding flip carried in the "
    "recurrent state (the check's bound, not the engine: FP8 K / V bounds are relative too)",
}


@pytest.fixture(scope="module")
def refs(toy_pair, toy_hybrid_pair, toy_dflash2_pair, toy_hybrid_dflash2_pair):
    return References(
        {"dense": toy_pair, "hybrid": toy_hybrid_pair},
        dflash2={"dense": toy_dflash2_pair[1], "hybrid": toy_hybrid_dflash2_pair[1]},
    )


@pytest.fixture(scope="module")
def ci_results(refs, one_torch_thread):
    return {seed: run_case(seed, refs) for seed in CI_SEEDS}


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_fuzz_case(ci_results, seed):
    r = ci_results[seed]
    assert r.ok, r.line()


def test_fuzz_covers_what_it_is_for(ci_results):
    """The generator really produces the combinations issue 39 is about, and speculation really
    happens (mean accepted length > 2 over the greedy speculative requests)."""
    results = list(ci_results.values())
    print(summarize(results))
    s = sum((r.stats for r in results), Counter())
    for what in (
        "preemptions",
        "evicted_pages",
        "cache_hit_tokens",
        "cut_in_block_string",
        "cut_in_block_id",
        "abort_running",
        "abort_waiting",
        "finish_length",
        "finish_stop",
        "fault_victims_failed",
    ):
        assert s[what] > 0, f"no {what} in {len(results)} cases: {dict(s)}"
    assert s["near_tie"] <= 0.01 * sum(r.requests for r in results), dict(s)
    # seeded samples against AR's run of their seed, and seeded twins under `auto` (issue 54)
    assert s["seeded_sampled"] >= 30, dict(s)
    auto = [r for r in results if "speculative_ddtree_budget=auto" in r.config]
    assert sum(r.stats["seeded_twins"] for r in auto) >= 4, [r.stats for r in auto]
    # grammar requests under speculation that finished every way a grammar request can
    grammar = {k: v for k, v in s.items() if k.startswith("grammar_")}
    assert sum(grammar.values()) >= 20 and grammar.get("grammar_stop", 0) > 0, grammar
    assert grammar.get("grammar_length", 0) > 0, grammar
    assert (
        sum("drafter=dflash2" in r.config for r in results) >= 4
    )  # DFlash2 drafters, dense + hybrid
    fp8 = [r.config.split()[0] for r in results if "quantization=fp8" in r.config]
    assert {"dense:fp8", "hybrid:fp8"} <= set(fp8) and len(fp8) >= 4, fp8  # block FP8 at load
    assert any("speculative_draft_quantization=fp8" in r.config for r in results)
    # batch-wide budgets (issue 57): packed rounds with a root-only share beside a deep tree
    assert sum("packing=random" in r.config for r in results) >= 2, [r.config for r in results]
    assert s["packed_rounds"] >= 10 and s["packed_root_beside_deep"] > 0, dict(s)
    assert s["packed_grammar_rows"] > 0 and s["packed_sampled_rows"] > 0, dict(s)
    # the CUDA graphs' static path (uncaptured), the packed verify's graphs among it
    assert s["graphed_rounds"] >= 100 and s["packed_graphed"] > 0, dict(s)
    acc = [n for r in results for n in r.accept]
    assert sum(acc) / len(acc) > 2, sum(acc) / len(acc)
    for kind in set(KINDS):
        kinds = [r for seed, r in ci_results.items() if KINDS[seed % len(KINDS)] == kind]
        assert sum(r.requests for r in kinds) >= 4 * 24, kind


@pytest.mark.parametrize("seed,requests", sorted(REGRESSION_SEEDS))
def test_fuzz_regression_seed(refs, one_torch_thread, seed, requests):
    r = run_case(seed, refs, requests, extras=False)
    assert r.ok, f"{REGRESSION_SEEDS[seed, requests]}\n{r.line()}"


# ---- the fuzzer can fail ---------------------------------------------------------------------
# seeds of kinds where each injected fault shows (speculative dense / hybrid, cache on)
META_SEEDS = (2, 4, 5, 11)


def _any_failure(refs, seeds, needle: str) -> list[str]:
    found = []
    for seed in seeds:
        r = run_case(seed, refs, n_requests=16)
        found += [f for f in r.failures if needle in f]
        if found:
            assert "tests/fuzz_engine.py --seed" in r.line()  # a one-line reproduction
            break
    return found


def test_fuzzer_catches_a_stop_id_checked_only_at_the_block_end(
    refs, one_torch_thread, monkeypatch
):
    """An emitter that checks stop ids on a round's last token only: a stop id inside an
    accepted block is missed, the output runs past it."""
    import dataclasses

    from ddtree.engine.outputs.emitter import TokenEmitter

    real = TokenEmitter.emit

    def emit(self, req, tokens):
        params = req.params
        req.params = dataclasses.replace(params, stop_token_ids=())
        try:
            real(self, req, tokens[:-1])
        finally:
            req.params = params
        if req.finish_reason is None and tokens:
            real(self, req, tokens[-1:])

    monkeypatch.setattr(TokenEmitter, "emit", emit)
    assert _any_failure(refs, META_SEEDS, "AR cut by its stop rule")


def test_fuzzer_catches_a_release_that_caches_an_unwritten_slot(
    refs, one_torch_thread, monkeypatch
):
    """A release that hands the cache one token more than the request committed (its pending
    token, whose KV no round wrote): cached pages whose last slot is wrong."""
    from ddtree.engine.model_runner import ModelRunner

    def release(self, req, keep_tokens=None):
        if keep_tokens is not None:
            return self.bm.trim(req, keep_tokens)
        n = min(req.kv_len + 1, req.seq_len)
        tokens = req.token_slice(0, n) if self.bm.cache is not None else None
        self.bm.free(req, tokens, n)
        req.kv_len = 0

    monkeypatch.setattr(ModelRunner, "release", release)
    assert _any_failure(refs, META_SEEDS, "differs from a fresh prefill")


def test_fuzzer_catches_a_leaked_slot(refs, one_torch_thread, monkeypatch):
    """A finish that forgets to free the request's slot and pages after a stop string."""
    from ddtree.engine.scheduling.scheduler import Scheduler

    real = Scheduler.finish

    def finish(self, req):
        if req.stop_hit is not None:
            self.running.remove(req)
            req.status = type(req.status).FINISHED
            return
        real(self, req)

    monkeypatch.setattr(Scheduler, "finish", finish)
    assert _any_failure(refs, META_SEEDS, "slot")


def test_fuzzer_catches_a_grammar_round_that_emits_past_its_stop_token(
    refs, one_torch_thread, monkeypatch
):
    """A grammar round that keeps the tokens of an accepted path after the grammar's stop token
    (with ignore_eos the emitter would pass them on): a speculative grammar request runs past
    where AR under the same grammar ends."""
    from ddtree.engine.round.grammar import GrammarBatch

    real = GrammarBatch.advance

    def advance(self, emitted):
        kept = [list(e) for e in emitted]
        cut = real(self, emitted)
        return [k if c and c != k and c == k[: len(c)] else c for c, k in zip(cut, kept)]

    monkeypatch.setattr(GrammarBatch, "advance", advance)
    assert _any_failure(refs, META_SEEDS + (3, 12, 13, 20), "grammar:")


def test_fuzzer_catches_sampling_noise_keyed_by_node_not_position(
    refs, one_torch_thread, monkeypatch
):
    """Noise keyed by a tree node's index instead of its token's position (the tree's shape then
    decides the sample again, as the stream sampler's did): seeded requests leave AR's tokens for
    their seed."""
    import torch

    from ddtree.engine.round.sampler import NodePositions

    def of_tree(cls, kv_lens, depths, bound):
        n = depths.shape[1]
        return cls(kv_lens + 1, torch.arange(n, device=depths.device).expand_as(depths), n - 1)

    monkeypatch.setattr(NodePositions, "of_tree", classmethod(of_tree))
    assert _any_failure(refs, (3, 12) + META_SEEDS, "seeded")
