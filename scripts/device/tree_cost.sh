#!/usr/bin/env bash
# Issue 43 (a tree round against a chain round) in one H200 device run, from the repository root:
#   bash scripts/device/tree_cost.sh [OUT_DIR]          # ~4-5 minutes with a warm Triton cache
# `.toycache` (holding a copy of $DDTREE_CACHE/toy_hybrid_pair) skips the toy pair's build there;
# `.tcache` (the parts step 4 writes) skips most Triton compiles. No wheels needed.
# 1. GPU checks: the no_buffer tree verify kernel (the gate inside, the outputs overlapping the
#    solve) against the PyTorch reference at the 27B head shape, alone and behind the tree conv in
#    a CUDA graph; the hybrid engine's graphs == eager == AR on the toy hybrid pair (fp32, both
#    strategies: the kernel in the loop is lossless);
# 2. studies/gpu_tree_cost.py at the 27B shape: the GEMMs alone at the rows each verify runs (chain
#    16 / tree 65 at batch 1; 128 / 136 / 264 at batch 8: B=16 / B=32), then DFLASH against
#    DDTREE B=64 at batch 1 and B=16 / B=32 at batch 8, per kernel family and phase; AR (NONE) for
#    "nothing else slower";
# 3. the same at the 8B shape (dense: DFLASH, DDTREE B=64, batch 1);
# 4. the Triton cache packed into OUT for the next run.
# What to read: the last table ("x first": each case's round over the first case of its batch:
# the targets are DDTREE B=64 <= 1.03x DFLASH at 27B batch 1, B=16 <= 1.02x and B=32 <= 1.10x at
# batch 8, B=64 <= 1.02x at 8B batch 1), the "minus" blocks (what the tree adds per kernel family:
# kernels, launch gaps, launches) and the GEMMs' rows line. BUDGET_S (default 300) bounds steps 2-3
# (cases past it are skipped, named in the output). FULL=1 adds the GDN kernel's launch variants
# (one layer, CUDA graph us) and more GEMM rows; CHECKS=kernel runs only the kernel's checks in
# step 1 (CHECKS=none: none), CHECKS_S (default 170) bounds them; C27=... replaces step 2's cases.
set -uo pipefail
OUT=${1:-${OUT:-tree_cost_out}}
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"  # PYTHONPATH, the Triton cache
mkdir -p "$OUT"
[ -d .toycache ] && export DDTREE_CACHE="$PWD/.toycache"
T0=$(date +%s)
status=0
PYTEST=(python3 -m pytest -m gpu -q -p no:cacheprovider)
CHECKS=${CHECKS:-all}
TESTS=(tests/gpu/test_gdn_gpu.py -k tree_chunk_kernel)
[ "$CHECKS" = all ] && TESTS=(tests/gpu/test_gdn_gpu.py tests/gpu/test_hybrid_graphs_gpu.py
  -k "tree_chunk_kernel or hybrid_graphs_match_eager")
if [ "$CHECKS" != none ]; then
  timeout "${CHECKS_S:-170}" "${PYTEST[@]}" "${TESTS[@]}" >"$OUT/gpu_tests.log" 2>&1 || status=1
  tail -3 "$OUT/gpu_tests.log"
fi
echo "checks: $(($(date +%s) - T0)) s"
DEFAULT27=DFLASH:0:1,DDTREE:64:1,NONE:0:1,DFLASH:0:8,DDTREE:16:8,DDTREE:32:8
C27=${C27:-$DEFAULT27}
ROWS=16,65,128,136,264
EXTRA=()
if [ -n "${FULL:-}" ]; then
  ROWS=16,17,64,65,72,128,136,144,256,264,272
  EXTRA=(--gdn --gemm-lt-rows 65,136,264)
fi
timeout "$((${BUDGET_S:-300} + 60))" python3 studies/gpu_tree_cost.py --time-budget-s "${BUDGET_S:-300}" \
  --shape qwen3.6-27b --cases "$C27" --gemm-rows "$ROWS" "${EXTRA[@]}" \
  --shape qwen3-8b --cases DFLASH:0:1,DDTREE:64:1 \
  --json "$OUT/tree_cost.json" >"$OUT/tree_cost.txt" 2>&1 || status=1
grep -v "^CUDA graphs" "$OUT/tree_cost.txt" | tail -120
pack_triton_cache "$OUT"
echo "total $(($(date +%s) - T0)) s"
exit $status
