"""`studies/counterfactual_rungs.py`: the accepts it infers for the smaller rungs and the chain from
a B=64 round are exactly what the fixed B=16, B=32 and DFLASH servers accept where they start a
round at the same position (T=0, fp32, the embedded pair), and its analysis runs on them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "studies"))

import counterfactual_rungs as cf  # noqa: E402


def test_counterfactual_accepts_equal_the_fixed_servers():
    rows = cf.collect(8, 4, 48)
    assert rows and all(r["accept"][-1] == r["k"] for r in rows)  # B=64: the run's own
    assert all(a <= b for r in rows for a, b in zip(r["accept"], r["accept"][1:]))
    assert all(0 <= r["chain"] <= cf.CHAIN for r in rows)
    # the rungs differ somewhere (else the check below could not fail)
    assert any(r["accept"][0] != r["k"] for r in rows)
    assert any(r["chain"] != r["k"] for r in rows if not r["censored"])
    got = cf.check(rows, 8, 4, 48)
    for name, c in got.items():
        assert c["rounds"] >= 15, (name, c)
        assert c["equal"] == c["rounds"], (name, c)
    res = cf.analyse(rows, 4)
    assert set(res["calibration"]) == {"tree8", "tree16", "tree32", "tree64", "chain"}
    for at in res["decisions_vs_chain"].values():
        assert at["fixed"]["chain"] == 1.0 and {"oracle", "last", "now"} <= set(at)


def test_replayed_policy_reaches_the_best_fixed_rung_on_real_drafts():
    """`studies/replay_policy.py`: auto's policy on the embedded pair's recorded rounds under the
    8B shape's H200 round costs. On the 96-prompt recording it reached 0.992-0.996 of the best
    fixed rung at batch 1-16 (BENCHMARKS); on this short one, at batch 4 (B=32 best there)."""
    import replay_policy as rp

    rows = cf.collect(8, 4, 48)
    assert all(len(r["curve64"]) == 64 for r in rows)
    reqs = rp.requests(rows)
    got = rp.replay(reqs, 4, 200, seed=0)
    assert got["of_best"] >= 0.95, got
    assert sum(got["picks"].values()) == 200
