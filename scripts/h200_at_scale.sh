#!/usr/bin/env bash
# The at-scale serving benchmark for both production shapes in one H200 device run (issue 18), from
# the repository root, with `.whl` carried (fastapi / uvicorn / pydantic / openai wheels for Python
# 3.12, which the device image lacks):
#   scripts/h200_at_scale.sh [OUT_DIR] [--only 27b|8b] [--time-budget-s S] [bench at-scale flags]
# 1. Qwen3.6-27B hybrid (first: it is the new table): the embedded pair inflated in memory by each
#    server (--model-path inflate:qwen3.6-27b, built on the GPU in bf16; ~55 GB is never written),
#    NONE / DFLASH / DDTREE B=16,64 at concurrency 1,4,16,64, no_buffer state (bench default for
#    hybrids), eager or with whatever CUDA graphs the hybrid path captures.
# 2. Qwen3-8B: inflated on the GPU, written to /tmp, rounds vs a random-weight pair, NONE / DFLASH /
#    DDTREE B=16,32,64 at concurrency 1..64, τ vs the small pair (the BENCHMARKS table).
# --time-budget-s (default 480) is the whole run's: the 27B part gets all but RESERVE_8B_S (200 s,
# what the 8B table took) and the 8B part what is left; each starts no config or level expected to
# end after its share, so the command ends within ~9 minutes. Results: OUT/<shape>/at_scale.json,
# .png, .log and the server logs. Extra flags go to both shapes' runs; per shape:
# FLAGS_27B="..." / FLAGS_8B="..." (e.g. FLAGS_27B="--disable-cuda-graph").
set -euo pipefail
OUT=${OUT:-at_scale_out}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT=$1; shift; fi
ONLY=both BUDGET=480 EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY=$2; shift 2 ;;
    --time-budget-s) BUDGET=$2; shift 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
case "$ONLY" in both|27b|8b) ;; *) echo "error: --only must be 27b or 8b (got $ONLY)" >&2; exit 2 ;; esac
RESERVE_8B_S=${RESERVE_8B_S:-200}
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/device_env.sh"  # the carried wheels, PYTHONPATH
T0=$(date +%s)
run() {  # run SHAPE BUDGET_S FLAGS...
  local shape=$1 budget=$2; shift 2
  mkdir -p "$OUT/$shape"
  echo "## $shape: --time-budget-s $budget"
  python3 -m ddtree bench at-scale --shape "$shape" --out "$OUT/$shape" --time-budget-s "$budget" \
    "$@" ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 | tee "$OUT/$shape/at_scale.log" || true
  # the device tool returns at most 8 files: per shape the JSON, the log and one archive of the
  # plot and server logs
  (cd "$OUT/$shape" && shopt -s nullglob && f=(*.png server_*.log) && [ ${#f[@]} -gt 0 ] &&
    tar czf extras.tgz "${f[@]}" && rm -f "${f[@]}") || true
}
if [ "$ONLY" != 8b ]; then
  B27=$BUDGET
  [ "$ONLY" = both ] && B27=$((BUDGET - RESERVE_8B_S))
  # shellcheck disable=SC2086
  run qwen3.6-27b "$B27" --in-memory --configs DFLASH,DDTREE64,NONE,DDTREE16 \
    --concurrency 1,4,16,64 --waves 1 --min-prompts 2 --tau-level 16 --parts serving,tau \
    --server-timeout-s 240 ${FLAGS_27B:-}
fi
if [ "$ONLY" != 27b ]; then
  LEFT=$((BUDGET - ($(date +%s) - T0)))
  PARTS=rounds,serving,tau
  [ "$LEFT" -lt 150 ] && PARTS=serving,tau  # the rounds check (~40 s) first goes
  if [ "$LEFT" -lt 60 ]; then
    echo "## qwen3-8b: skipped, ${LEFT} s left of --time-budget-s $BUDGET (run --only 8b)"
  else
    # shellcheck disable=SC2086
    run qwen3-8b "$LEFT" --work-dir /tmp/ddtree_at_scale --parts "$PARTS" ${FLAGS_8B:-}
  fi
fi
echo "## done in $(($(date +%s) - T0)) s; results under $OUT/"
