#!/usr/bin/env python3
"""Launch the split-KV tree-attention kernel a few times on one shape, for Nsight Compute (issue 7).

    ncu --clock-control none --kernel-name regex:_split_kv_attn --launch-skip 2 --launch-count 1 --set full \
        -o $OUT/tree16k python3 bench/ncu_tree_attention.py tree16k

Shapes (32 query heads, 8 KV heads, head dim 128, bf16, page 16, random data): tree16k (b=1, 65-node tree,
16k context), rows256 (b=1, 64-node tree), decode16k (b=1, one query), b8tree8k (b=8, 65 nodes, 8k).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from gpu_tree_attention import Problem  # noqa: E402

SHAPES = {
    "tree16k": (1, 65, 16384),
    "rows256": (1, 64, 16384),
    "decode16k": (1, 1, 16384),
    "b8tree8k": (8, 65, 8192),
    "tree32k": (1, 65, 32768),
}

if __name__ == "__main__":
    b, n, ctx = SHAPES[sys.argv[1]]
    p = Problem([n] * b, [ctx + n] * b, copies=2, tree=n > 1)
    for i in range(4):
        p.ours(i % 2)
    torch.cuda.synchronize()
    print(sys.argv[1], "ok")
