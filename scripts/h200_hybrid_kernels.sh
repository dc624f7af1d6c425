#!/usr/bin/env bash
# Issue 19's kernel cuts and tree-GDN switches in one H200 device run (~9 min), from the repository
# root (carry `.whl` for fla-core as studies/gpu_gdn_tree.py does):
#   scripts/h200_hybrid_kernels.sh [OUT_DIR]
# 1. the GDN / fused / hybrid-graph GPU checks (kernels vs references, graphs vs eager);
# 2. studies/gpu_gdn_tree.py (b): the tree kernel alone at the 27B head shape, B=64, batch 1 / 8, over
#    tile x warps x prefetch x stash dtype;
# 3. studies/gpu_profile_round.py at the 27B shape (one random pair): AR / DFLASH / DDTREE B=64 batch 1
#    with the default kernels, DDTREE B=64 with each switch, batch 8 (no_buffer; extra_buffer with the
#    bf16 stash, which now fits), 16k batch 1; one table at the end (wall ms/round, x floor, launches).
# "Before" for the always-on cuts (one GEMM in_proj, row-indexed conv, fused gate) is main's code:
#   mkdir -p .old && git archive 4938d7d ddtree bench | tar -x -C .old
# then BEFORE=1 scripts/h200_hybrid_kernels.sh runs step 3's first three cases there first.
set -uo pipefail
OUT=${1:-${OUT:-hybrid_kernels_out}}
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/device_env.sh"  # the carried wheels, PYTHONPATH
mkdir -p "$OUT"
status=0
timeout 170 python3 -m pytest -m gpu tests/gpu/test_gdn_gpu.py tests/gpu/test_fused_kernels_gpu.py \
  tests/gpu/test_hybrid_graphs_gpu.py -q -x 2>&1 | tail -15 | tee "$OUT/gpu_tests.log" || status=1
OUT="$OUT" timeout 80 python3 studies/gpu_gdn_tree.py --only b --deadline-s 70 2>&1 \
  | tee "$OUT/gpu_gdn_tree.log" || status=1
PROFILE=(--shape qwen3.6-27b --skip-gemm-chain --rounds 5 --top 6)
if [ "${BEFORE:-0}" = 1 ] && [ -d .old/ddtree ]; then
  (cd .old && PYTHONPATH="/tmp/site:$PWD" timeout 150 python3 studies/gpu_profile_round.py \
    "${PROFILE[@]}" --cases NONE:0:1,DFLASH:0:1,DDTREE:64:1 2>&1 | tail -40) \
    | tee "$OUT/profile_before.log" || status=1
fi
CASES=NONE:0:1,DFLASH:0:1,DDTREE:64:1,DDTREE:64:8:no_buffer,DDTREE:64:1::16384
timeout 280 python3 studies/gpu_profile_round.py "${PROFILE[@]}" --cases "$CASES" 2>&1 \
  | tee "$OUT/profile.log" || status=1
exit $status
