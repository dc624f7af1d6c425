"""Stop strings checked incrementally: the same cut as a brute-force scan, at a per-token cost
bounded by the stop bounds (server/limits.py) and independent of how long the output already is."""

import random

from ddtree.engine.outputs.detokenizer import StopMatcher, find_stop, stop_holdback
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


class Window:
    """The matcher's regex, recording how many characters each search scans."""

    def __init__(self, pattern):
        self.pattern, self.scanned = pattern, []

    def search(self, text, pos):
        self.scanned.append(len(text) - pos)
        return self.pattern.search(text, pos)


class Lookups(frozenset):
    """The matcher's prefix hashes, counting the lookups."""

    def __contains__(self, item):
        self.count = getattr(self, "count", 0) + 1
        return frozenset.__contains__(self, item)


def work_per_token(stops: tuple[str, ...], prefix_len: int) -> tuple[int, float]:
    """(most characters one find scans, hash lookups per holdback) over 500 appended characters
    after a prefix of prefix_len: the matcher's work, counted instead of timed."""
    m = StopMatcher(stops)
    m.pattern, m.prefix_hashes = Window(m.pattern), Lookups(m.prefix_hashes)
    text = "q" * prefix_len
    for i in range(500):
        text += "xy"[i % 2]
        assert m.find(text, 1) == -1
        m.holdback(text)
    return max(m.pattern.scanned), m.prefix_hashes.count / 500


def test_per_token_work_is_bounded_and_independent_of_output_length():
    # the worst case the limits allow: every stop is max length and shares a long prefix with the
    # output
    stops = tuple(
        ("xy" * MAX_STOP_CHARS)[: MAX_STOP_CHARS - 2] + str(i % 10) + chr(65 + i)
        for i in range(MAX_STOP_STRINGS)
    )
    short, long = work_per_token(stops, 1_000), work_per_token(stops, 200_000)
    assert short == long, (short, long)
    scanned, lookups = long
    # a find scans the new character and the max_len - 1 before it; a holdback looks up at most
    # max_len - 1 suffixes (the old per-stop loop scanned the whole output for each of 10k stops)
    assert scanned == MAX_STOP_CHARS and lookups <= MAX_STOP_CHARS - 1, (scanned, lookups)
