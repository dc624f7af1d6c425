#!/usr/bin/env bash
# The no_buffer tree verify's Triton kernel (kernels/gdn/tree_chunk_triton.py) in one H200 device
# run (~9 min), from the repository root (carry `.whl` for fla-core, as h200_hybrid_kernels.sh):
#   scripts/h200_tree_chunk.sh [OUT_DIR]
# 1. its GPU checks: kernel vs reference at the 27B head shape (B=64, batch 1 / 8, bf16 / fp32, its
#    launch options, CUDA graph replay), the hybrid graphs vs eager / AR (no_buffer included);
# 2. bench/gpu_gdn_tree.py (e): one layer, the kernel vs the PyTorch chunk form vs the extra_buffer
#    recurrence, B=64, batch 1 / 8, launch options swept;
# 3. bench/gpu_profile_round.py at the 27B shape: DDTREE B=64 no_buffer with the kernel, with the
#    PyTorch chunk form (DDTREE_GDN_TREE_CHUNK=torch: the code before), the kernel's column tile
#    at 64 and its dots in tf32, extra_buffer; batch 8 no_buffer (kernel, PyTorch form); AR for
#    reference; one table at the end (wall ms/round, x floor, launches).
set -uo pipefail
OUT=${1:-${OUT:-tree_chunk_out}}
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/device_env.sh"  # the carried wheels, PYTHONPATH
mkdir -p "$OUT"
status=0
timeout 170 python3 -m pytest -m gpu tests/gpu/test_gdn_gpu.py tests/gpu/test_hybrid_graphs_gpu.py \
  -q -x 2>&1 | tail -15 | tee "$OUT/gpu_tests.log" || status=1
OUT="$OUT" timeout 90 python3 bench/gpu_gdn_tree.py --only e --deadline-s 80 2>&1 \
  | tee "$OUT/gpu_gdn_tree.log" || status=1
CASES=NONE:0:1,DDTREE:64:1:no_buffer,DDTREE:64:1:no_buffer@DDTREE_GDN_TREE_CHUNK=torch
CASES+=,DDTREE:64:1:no_buffer@DDTREE_GDN_TREE_CHUNK_BV=64
CASES+=,DDTREE:64:1:no_buffer@DDTREE_GDN_TREE_CHUNK_PRECISION=tf32,DDTREE:64:1:extra_buffer
CASES+=,DDTREE:64:8:no_buffer,DDTREE:64:8:no_buffer@DDTREE_GDN_TREE_CHUNK=torch
timeout 300 python3 bench/gpu_profile_round.py --shape qwen3.6-27b --skip-gemm-chain --rounds 5 \
  --top 8 --cases "$CASES" 2>&1 | tee "$OUT/profile.log" || status=1
exit $status
