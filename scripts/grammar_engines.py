"""xgrammar against llguidance on what a draft-tree walk does per node: a next-token mask fill, and
roll back + accept along a path; plus compile time. On a synthetic 151k-token vocabulary (frequent
substrings of the stdlib's source, Qwen3's size) so it runs without a model hub; one CPU thread.
The numbers ddtree/grammar/backend.py cites (both installed: `pip install xgrammar llguidance`):
  OMP_NUM_THREADS=1 PYTHONPATH=. python3 scripts/grammar_engines.py
"""

from __future__ import annotations

import collections
import glob
import json
import os
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "temp": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "meta": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "note": {"type": "string"}},
            "required": ["ok"],
        },
    },
    "required": ["city", "temp", "meta"],
}
SAMPLE = {
    "city": "Paris",
    "temp": 21.5,
    "tags": ["alpha", "beta"],
    "meta": {"ok": True, "note": "self.assert the value"},
}


def vocab(size: int = 151_000) -> list[str]:
    lib = os.path.dirname(os.__file__)
    text = "".join(open(f, errors="ignore").read() for f in sorted(glob.glob(lib + "/*.py"))[:150])
    cnt = collections.Counter(
        text[i : i + n] for n in range(2, 9) for i in range(0, min(len(text), 3_000_000) - n, 3)
    )
    out = [chr(i) for i in range(32, 127)] + ["\n", "\t"]
    out += [s for s, _ in cnt.most_common(size - len(out) - 1)]
    return list(dict.fromkeys(out)) + ["<eos>"]


def greedy_ids(text: str, index: dict[str, int]) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        for n in range(8, 0, -1):
            if text[i : i + n] in index:
                ids.append(index[text[i : i + n]])
                i += n
                break
        else:
            i += 1
    return ids


def stats(ts: list[float]) -> str:
    us = np.array(ts) * 1e6
    return f"median {np.median(us):.1f} us, p90 {np.percentile(us, 90):.1f} us"


def main() -> None:
    v = vocab()
    eos, index = len(v) - 1, {s: i for i, s in enumerate(v)}
    ids = greedy_ids(json.dumps(SAMPLE), index)
    print(f"vocab {len(v)}, sample {len(ids)} tokens")

    import xgrammar as xgr

    info = xgr.TokenizerInfo(v, vocab_type=xgr.VocabType.RAW, stop_token_ids=[eos])
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA))
    print(f"xgrammar compile {1e3 * (time.perf_counter() - t):.1f} ms")
    m, bm, ts = xgr.GrammarMatcher(cg), xgr.allocate_token_bitmask(1, len(v)), []
    for i in ids:
        t = time.perf_counter()
        m.fill_next_token_bitmask(bm)
        ts.append(time.perf_counter() - t)
        assert m.accept_token(i)
    t = time.perf_counter()
    for _ in range(200):
        m.rollback(3)
        for i in ids[-3:]:
            m.accept_token(i)
    walk = (time.perf_counter() - t) / 200 * 1e6
    print(f"xgrammar mask fill {stats(ts)}; rollback(3) + 3 accepts {walk:.1f} us")

    import llguidance as lg
    import llguidance.numpy as lgn

    class Wrapped:
        eos_token_id, bos_token_id, special_token_ids = eos, None, [eos]
        tokens = [s.encode() for s in v[:-1]] + [b"\xff<eos>"]

        def __call__(self, text):
            return greedy_ids(
                text.decode(errors="ignore") if isinstance(text, bytes) else text, index
            )

    lt = lg.LLTokenizer(lg.TokenizerWrapper(Wrapped()))
    t = time.perf_counter()
    mm = lg.LLMatcher(lt, lg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    print(f"llguidance matcher {1e3 * (time.perf_counter() - t):.1f} ms (lazy)")
    bm2 = lgn.allocate_token_bitmask(1, lt.vocab_size)
    for rep in ("first", "second"):
        mm.reset()
        ts = []
        for i in ids:
            t = time.perf_counter()
            lgn.fill_next_token_bitmask(mm, bm2, 0)
            ts.append(time.perf_counter() - t)
            assert mm.consume_token(i)
        print(f"llguidance mask fill ({rep} pass) {stats(ts)}")
    t = time.perf_counter()
    for _ in range(200):
        mm.rollback(3)
        mm.consume_tokens(ids[-3:])
    print(f"llguidance rollback(3) + consume 3: {(time.perf_counter() - t) / 200 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
