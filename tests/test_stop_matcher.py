"""Stop strings checked incrementally: the same cut as a brute-force scan, at a per-token cost
bounded by the stop bounds (server/limits.py) and independent of how long the output already is."""

import random
import time

from ddtree.engine.detokenizer import StopMatcher, find_stop, stop_holdback
from ddtree.server.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS


def brute_find(text: str, new_len: int, stops) -> int:
    hits = [
        i
        for s in stops
        for i in range(len(text) - len(s) + 1)
        if text.startswith(s, i) and i + len(s) > len(text) - new_len
    ]
    return min(hits, default=-1)


def brute_holdback(text: str, stops) -> int:
    return max(
        [
            k
            for s in stops
            for k in range(1, min(len(s) - 1, len(text)) + 1)
            if text.endswith(s[:k])
        ],
        default=0,
    )


def test_matches_brute_force_on_random_text():
    rng = random.Random(0)
    for _ in range(300):
        stops = tuple(
            "".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        )
        text = ""
        while True:
            new = "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
            text += new
            want = brute_find(text, len(new), stops)
            assert find_stop(text, len(new), stops) == want, (text, new, stops)
            if want >= 0 or len(text) > 40:
                break
            assert stop_holdback(text, stops) == brute_holdback(text, stops), (text, stops)


def test_old_cases():
    assert stop_holdback("abcab", ("abd",)) == 2 and stop_holdback("xyz", ("zz", "yzq")) == 2
    assert (
        find_stop("hello world", 7, ("wor", "o w")) == 4
    )  # earliest start wins, not the first stop listed
    assert find_stop("xxSTOP", 1, ("STOP",)) == 2 and find_stop("xxSTOPy", 1, ("STOP",)) == -1


def per_token_us(matcher: StopMatcher, prefix_len: int) -> float:
    """Microseconds per appended character for find + holdback, after a prefix of prefix_len
    characters."""
    text = "q" * prefix_len
    t0 = time.perf_counter()
    for i in range(500):
        text += "xy"[i % 2]
        assert matcher.find(text, 1) == -1
        matcher.holdback(text)
    return (time.perf_counter() - t0) / 500 * 1e6


def test_per_token_cost_is_bounded_and_independent_of_output_length():
    # the worst case the limits allow: every stop is max length and shares a long prefix with the
    # output
    stops = tuple(
        ("xy" * MAX_STOP_CHARS)[: MAX_STOP_CHARS - 1] + str(i % 10) + chr(65 + i)
        for i in range(MAX_STOP_STRINGS)
    )
    m = StopMatcher(tuple(s[:MAX_STOP_CHARS] for s in stops))
    short, long = per_token_us(m, 100), per_token_us(m, 200_000)
    # generous for a loaded 2-core CI box; the old per-stop loop took ~50x this with 10k stops
    assert short < 2000 and long < 2000, (short, long)
    assert long < 5 * short + 200, (short, long)
