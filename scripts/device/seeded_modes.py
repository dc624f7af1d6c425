"""Seeded sampling on the GPU (issue 54): the embedded pair in fp32 with CUDA graphs, a batch of
seeded sampled requests beside greedy ones, in AR, DFLASH, DDTREE 16 and auto: every seeded
request's tokens must equal AR's (randomness keyed by (seed, position)), and a second auto run
must repeat the first. Prints one line per mode and exits 1 on a difference.
    python3 scripts/device/seeded_modes.py
"""

import sys

from ddtree import LLM, SamplingParams

PROMPTS = ["def fib(n):\n", "class Stack:\n", "import os\n\ndef walk(", "for i in range(", "x = ["]
MODES = {
    "AR": {},
    "DFLASH": {"speculative_algorithm": "DFLASH"},
    "DDTREE16": {"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 16},
    "auto": {"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": "auto"},
}


def run(kw) -> tuple[list[list[int]], float]:
    llm = LLM(device="cuda", dtype="float32", **kw)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i, max_tokens=80, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    outs = llm.generate(PROMPTS, params)
    tau = sum(len(o.token_ids) for o in outs) / max(sum(o.rounds for o in outs), 1)
    del llm
    return [list(o.token_ids) for o in outs], tau


ref, _ = run(MODES["AR"])
bad = 0
for name, kw in MODES.items():
    got, tau = run(kw)
    same = [a == b for a, b in zip(got, ref)]
    bad += not all(same)
    print(f"{name}: tau {tau:.2f}, equal to AR {sum(same)}/{len(same)}")
again, _ = run(MODES["auto"])
print(f"auto twice: equal {again == got}")
sys.exit(1 if bad or again != got else 0)
