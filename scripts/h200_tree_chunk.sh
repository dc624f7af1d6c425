#!/usr/bin/env bash
# The no_buffer tree verify's Triton kernel (kernels/gdn/tree_chunk_triton.py) in one H200 device
# run (~9 min), from the repository root (carry `.whl` for fla-core, as h200_hybrid_kernels.sh):
#   scripts/h200_tree_chunk.sh [OUT_DIR]
# 1. its GPU checks vs reference at the 27B head shape (B=64, batch 1 / 8, bf16 / fp32, launch
#    options, CUDA graph replay);
# 2. studies/gpu_gdn_tree.py (e): one layer, the kernel vs the PyTorch chunk form vs the extra_buffer
#    recurrence, B=64, batch 1 / 8, launch options swept;
# 3. studies/gpu_profile_round.py at the 27B shape: AR, DFLASH, DDTREE B=64 no_buffer at batch 1 and 8,
#    and at 16k context; one table at the end (wall ms/round, x floor, launches). (The one-launch
#    form it once A/B'd is gone; issue 43's A/B: scripts/device/tree_cost.sh.)
set -uo pipefail
OUT=${1:-${OUT:-tree_chunk_out}}
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/device_env.sh"  # the carried wheels, PYTHONPATH
mkdir -p "$OUT"
status=0
timeout 110 python3 -m pytest -m gpu tests/gpu/test_gdn_gpu.py -k chunk -q -x 2>&1 | tail -15 \
  | tee "$OUT/gpu_tests.log" || status=1
OUT="$OUT" timeout 130 python3 studies/gpu_gdn_tree.py --only e --deadline-s 120 2>&1 \
  | tee "$OUT/gpu_gdn_tree.log" || status=1
CASES=NONE:0:1,DFLASH:0:1,DDTREE:64:1:no_buffer,DDTREE:64:8:no_buffer,DDTREE:64:1:no_buffer:16384
timeout 300 python3 studies/gpu_profile_round.py --shape qwen3.6-27b --skip-gemm-chain --rounds 5 \
  --top 12 --cases "$CASES" 2>&1 | tee "$OUT/profile.log" || status=1
exit $status
