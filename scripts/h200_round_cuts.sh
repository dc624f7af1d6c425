#!/usr/bin/env bash
# Issue 19's round cuts of 2026-12-02 in one H200 device run (~9.5 min), from the repository root,
# `.whl` carried (fla-core), `.tcache` if a session packed one, `.toycache` (the toy hybrid pair,
# built on the CPU: `mkdir .toycache; cp -r ~/.cache/ddtree/toy_hybrid_pair .toycache/`) to skip its build there:
#   scripts/h200_round_cuts.sh [OUT_DIR]
# 1. GPU checks of this session's kernels against their references (the in-place GDN decode step
#    and conv, the one-launch tree build, the fused and GDN kernels now launched with PDL) and the
#    dense graphs-vs-eager test;
# 2. studies/gpu_profile_round.py at the 27B shape: AR / DFLASH / DDTREE B=64 (batch 1 and 8, 1k and
#    16k), with A/B cases for PDL (DDTREE_DISABLE=pdl); one table (the in-place decode and the
#    attention tile A/Bs it ran on 2026-12-02 are decided: their switches are gone);
# 3. studies/gpu_tree_build.py (the tree build alone, torch vs the kernel);
# 4. the hybrid graphs-vs-eager GPU test (toy hybrid pair, fp32, both strategies);
# then the Triton cache packed into OUT. BUDGET_S (default 560) bounds the whole run.
set -uo pipefail
OUT=${1:-${OUT:-round_cuts_out}}
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/device_env.sh"  # the carried wheels, PYTHONPATH, the Triton cache
mkdir -p "$OUT"
[ -d .toycache ] && export DDTREE_CACHE="$PWD/.toycache"
T0=$(date +%s)
left() { echo $((${BUDGET_S:-560} - ($(date +%s) - T0))); }
status=0
PYTEST=(python3 -m pytest -m gpu -q -p no:cacheprovider)
# 1. this session's kernels (+ PDL on every fused / GDN kernel) against their references, and the
#    dense graphs-vs-eager check (PDL edges inside captured graphs)
K="not test_gdn_gpu or decode or in_place or commit_kernel or strided or tree_conv or fused_gating"
K+=" or (chunk_kernel_matches_reference and split and bfloat16)"
timeout 170 "${PYTEST[@]}" tests/gpu/test_fused_kernels_gpu.py tests/gpu/test_tree_build_gpu.py \
  tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_gdn_gpu.py -k "$K" \
  >"$OUT/gpu_tests.log" 2>&1 || status=1
tail -4 "$OUT/gpu_tests.log"
# 2. the rounds
P=DDTREE_DISABLE=pdl
CASES=NONE:0:1:no_buffer,NONE:0:1:no_buffer@$P,DFLASH:0:1:no_buffer
CASES+=,DDTREE:64:1:no_buffer,DDTREE:64:1:no_buffer@$P
CASES+=,DDTREE:64:8:no_buffer,DDTREE:64:1:no_buffer:16384
timeout "$(($(left) - 170))" python3 studies/gpu_profile_round.py --shape qwen3.6-27b \
  --skip-gemm-chain --rounds 5 --top 40 --cases "$CASES" >"$OUT/profile.txt" 2>&1 || status=1
grep "^| " "$OUT/profile.txt"
# 3. the tree build alone
OUT="$OUT" timeout 40 python3 studies/gpu_tree_build.py --budgets 64 --batches 1,8 --warps 1,4 \
  >"$OUT/tree_build.log" 2>&1 || status=1
tail -8 "$OUT/tree_build.log"
# 4. hybrid graphs vs eager vs AR (toy hybrid pair, fp32)
timeout "$(($(left) - 20))" "${PYTEST[@]}" tests/gpu/test_hybrid_graphs_gpu.py \
  >"$OUT/hybrid_graphs.log" 2>&1 || status=1
tail -3 "$OUT/hybrid_graphs.log"
pack_triton_cache "$OUT"
echo "total $(($(date +%s) - T0)) s"
exit $status
