"""`studies/trajectory_rungs.py`: a table of every rung's accept at every position (B=64 rounds cut
to the bonus token) walks each fixed rung's own trajectory exactly as the engine runs it (T=0,
fp32, the embedded pair), and the policy replayed over it reaches the best fixed rung."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "studies"))

import trajectory_rungs as tr  # noqa: E402

MAX_TOKENS = 48


def test_walked_trajectories_equal_the_engines_fixed_runs():
    reqs = tr.record(4, MAX_TOKENS, "heldout")
    assert len(reqs) == 4
    for r in reqs:
        assert len(r["positions"]) == MAX_TOKENS - 1  # a round at every position after the first
        acc = tr.accepts(r)
        assert (np.diff(acc[:, [1, 3, 4, 5]], axis=1) >= 0).all()  # a bigger tree holds a smaller
        assert ((acc[:, 2] >= 0) & (acc[:, 2] <= tr.CHAIN)).all()
    every = np.concatenate([tr.accepts(r) for r in reqs])
    # the rungs differ somewhere (else the check below could not fail)
    assert (every[:, 2] != every[:, 5]).any() and (every[:, 4] != every[:, 5]).any()
    got = tr.check(reqs, "heldout", MAX_TOKENS)
    for name, c in got.items():
        assert c["same_rounds"] == c["requests"] == 4, (name, c)
    # a rung's own trajectory is not its mean over every position (why the table walks them)
    own = np.mean([n for r in reqs for n in tr.walk_fixed(r, tr.RUNG_NAMES.index("chain"), 48)])
    assert own < every[:, 2].mean() + 1


def test_policy_over_the_trajectories_reaches_the_best_fixed_rung():
    reqs = tr.record(4, MAX_TOKENS, "heldout")
    fixed = {
        n: tr.simulate(reqs, 4, 200, MAX_TOKENS, tr.RUNG_NAMES.index(n))["tok_per_s"]
        for n in tr.RUNG_NAMES[1:]
    }
    got = tr.simulate(reqs, 4, 200, MAX_TOKENS)
    assert sum(got["picks"].values()) == 200
    assert got["tok_per_s"] >= 0.95 * max(fixed.values()), (got["picks"], fixed)
