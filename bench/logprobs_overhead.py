"""What reporting log-probs costs: generation throughput on the embedded pair with none, `logprobs`
and `top_logprobs=K` requests (every request asks, the worst case), per algorithm, greedy.

    python3 bench/logprobs_overhead.py                        # CUDA (graphs on) when available
    python3 bench/logprobs_overhead.py --device cpu --batch 2 --tokens 32
Prints one row per (algorithm, mode): tokens/s and the ratio to the no-logprobs run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ddtree import LLM, SamplingParams  # noqa: E402

PROMPT = "import json\n\n\ndef dumps(obj, *, indent=None):\n    "


def throughput(llm: LLM, batch: int, tokens: int, **lp) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, **lp)
    llm.generate([PROMPT] * batch, params)  # warm-up (graph capture, allocator)
    t0 = time.perf_counter()
    outs = llm.generate([PROMPT] * batch, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    ap.add_argument("--batch", type=int, default=8, help="concurrent requests (default: 8)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per request (default: 256)")
    ap.add_argument("--top", type=int, default=5, help="top_logprobs of mode 3 (default: 5)")
    ap.add_argument("--algorithms", default="NONE,DFLASH,DDTREE", help="comma-separated")
    a = ap.parse_args()
    print("algorithm  mode            tok/s   vs none")
    for algo in a.algorithms.split(","):
        llm = LLM(None, speculative_algorithm=algo, device=a.device, max_running_requests=a.batch)
        base = None
        for mode, lp in (
            ("none", {}),
            ("logprobs", {"logprobs": True}),
            (f"top_logprobs={a.top}", {"top_logprobs": a.top}),
        ):
            tps = throughput(llm, a.batch, a.tokens, **lp)
            base = base or tps
            print(f"{algo:<10} {mode:<15} {tps:8.1f}   {tps / base:5.3f}")


if __name__ == "__main__":
    main()
