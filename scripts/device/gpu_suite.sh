#!/usr/bin/env bash
# The whole GPU suite (tests/gpu, -m gpu) on the one GPU in four parallel groups, with the CUDA
# graph pool measured against the memory plan's line (studies/gpu_graph_memory.py) beside it (issue
# 56). From the repository root, `.whl` and `.fp8dev` carried:
#   run: bash scripts/device/gpu_suite.sh      (carry: [".whl", ".fp8dev"])
# GRAPH_CASES overrides the measured cases (shape:ALGORITHM:budget:max_bs, comma-separated; none: no
# study). RESUME / SPLIT / ONLY / TEST_S: see below.
# Results in $OUT: tests_*.log (each group's pytest tail), graph_memory.{log,json}, device.txt.
set -uo pipefail
OUT=${OUT:-gpu_suite_out}
mkdir -p "$OUT"
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"
if [ -f .fp8dev/deep_gemm.tgz ]; then  # DeepGEMM built for the device's torch (scripts/build_deep_gemm.sh)
  mkdir -p /tmp/dglib && tar xzf .fp8dev/deep_gemm.tgz -C /tmp/dglib && export PYTHONPATH="/tmp/dglib:$PYTHONPATH"
  CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
  export CUDA_HOME DG_JIT_CACHE_DIR=/tmp/dgcache
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
CASES=${GRAPH_CASES:-qwen3-8b:NONE:-:256,qwen3-8b:DFLASH:-:64,qwen3-8b:DFLASH:-:256,qwen3-8b:DDTREE:16:64,qwen3-8b:DDTREE:auto:64}
# the study's engines take a bounded share of the GPU: the test groups run beside it
[ "${GRAPH_CASES:-}" != none ] && (timeout 300 python3 studies/gpu_graph_memory.py --cases "$CASES" \
  --mem-fraction-static 0.5 --out "$OUT/graph_memory.json" 2>&1 | grep -v "^\[ddtree\]" \
  > "$OUT/graph_memory.log") &
G=tests/gpu
declare -A FILES=(
  [a]="$G/test_cuda_graphs_gpu.py $G/test_hybrid_graphs_gpu.py $G/test_tree_attention_gpu.py $G/test_tree_build_gpu.py"
  [b]="$G/test_budget_gpu.py $G/test_budget_rungs_gpu.py $G/test_logprobs_cuda.py $G/test_prompt_logprobs_cuda.py $G/test_gdn_gpu.py"
  [c]="$G/test_engine_config_gpu.py $G/test_prefix_cache_gpu.py $G/test_first_request_gpu.py $G/test_fp8_gpu.py $G/test_fp8_lib_gpu.py"
  [d]="$G/test_extend_graph_gpu.py $G/test_dflash2_gpu.py $G/test_fused_kernels_gpu.py $G/test_dp_gpu.py $G/test_tp_gpu.py $G/test_inflate_production.py"
)
# RESUME="a:51,c:18": a cut run's groups go on after the tests it passed (collection order), each
# remainder split in SPLIT parts run in parallel; ONLY="b": just those groups
declare -A SKIP=()
for kv in ${RESUME//,/ }; do SKIP[${kv%%:*}]=${kv##*:}; done
t() { timeout "${TEST_S:-480}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 "$@" 2>&1 | tail -25; }
for g in a b c d; do
  [ -n "${ONLY:-}" ] && [[ $ONLY != *$g* ]] && continue
  if [ -n "${SKIP[$g]:-}" ]; then
    # shellcheck disable=SC2086
    python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider ${FILES[$g]} 2>/dev/null | grep "::" \
      | tail -n +$((SKIP[$g] + 1)) > "/tmp/ids_$g"
    split -n "l/${SPLIT:-2}" -d "/tmp/ids_$g" "/tmp/ids_${g}_"
    for part in /tmp/ids_"${g}"_*; do
      # shellcheck disable=SC2046
      [ -s "$part" ] && (t $(cat "$part") > "$OUT/tests_${g}_${part##*_}.log") &
    done
  else
    # shellcheck disable=SC2086
    (t ${FILES[$g]} > "$OUT/tests_$g.log") &
  fi
done
# EXTRA: more node ids (e.g. tests added since a cut run), one more parallel process
# shellcheck disable=SC2086
[ -n "${EXTRA:-}" ] && (t $EXTRA > "$OUT/tests_extra.log") &
wait
for f in "$OUT"/tests_*.log "$OUT"/graph_memory.log; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
