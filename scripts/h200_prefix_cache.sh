#!/usr/bin/env bash
# The prefix-cache serving targets (issue 22) in one H200 device run, from the repository root,
# with `.whl` carried (fastapi / uvicorn / pydantic / openai wheels, as scripts/h200_at_scale.sh):
#   scripts/h200_prefix_cache.sh [OUT_DIR] [--only 8b|27b] [extra `ddtree bench prefix-cache` flags]
# Per shape, two servers (cache on, --disable-radix-cache) with DDTREE B=16 run the multi-turn
# workload (2048-token shared system prompt, 4 turns of 64 tokens, 128 output tokens per turn,
# 8 conversations at once; held-out stdlib text, so drafts are accepted as in use) and the
# no-sharing one; the table, the TTFT by phase and PASS / FAIL per target (exit 1 on a FAIL).
# 1. qwen3-8b: the embedded pair inflated on the GPU into /tmp once, 32 conversations (~230 s).
# 2. qwen3.6-27b (hybrid): each server builds the pair in memory (--model-path inflate:qwen3.6-27b,
#    nothing written), prefix hits restore recurrent-state checkpoints, no_buffer state (as bench
#    at-scale), CONV_27B conversations (default 16). Not measured yet: with two 27B servers
#    starting (build + warm-up + graphs) both shapes may not fit one 9-minute device call; run
#    --only 8b and --only 27b as two calls.
# Results: OUT/<shape>/prefix_cache.json, prefix_cache.log and extras.tgz (server logs): at most 6
# files for both shapes (the device returns 8). Extra flags go to both shapes; per shape
# FLAGS_8B="..." / FLAGS_27B="...".
set -euo pipefail
OUT=${OUT:-prefix_cache_out}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT=$1; shift; fi
ONLY=both EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY=$2; shift 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
case "$ONLY" in both|27b|8b) ;; *) echo "error: --only must be 8b or 27b (got $ONLY)" >&2; exit 2 ;; esac
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/device_env.sh"  # the carried wheels, PYTHONPATH
T0=$(date +%s)
RC=0
run() {  # run SHAPE FLAGS...
  local shape=$1; shift
  mkdir -p "$OUT/$shape"
  echo "## $shape"
  python3 -m ddtree bench prefix-cache --out "$OUT/$shape" "$@" ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 |
    tee "$OUT/$shape/prefix_cache.log" || RC=1
  # the device tool returns at most 8 files: per shape the JSON, the log and one archive
  (cd "$OUT/$shape" && shopt -s nullglob && f=(server_*.log) && [ ${#f[@]} -gt 0 ] &&
    tar czf extras.tgz "${f[@]}" && rm -f "${f[@]}") || true
}
if [ "$ONLY" != 27b ]; then
  PAIR=/tmp/ddtree_prefix_cache/qwen3-8b
  if [ ! -f "$PAIR/drafter/config.json" ]; then
    python3 -m ddtree inflate --shape qwen3-8b --device cuda "$PAIR" 2>&1 | tail -3
  fi
  # shellcheck disable=SC2086
  run qwen3-8b --model-path "$PAIR/target" --speculative-draft-model-path "$PAIR/drafter" \
    --conversations 32 --concurrency 8 ${FLAGS_8B:-}
fi
if [ "$ONLY" != 8b ]; then
  # shellcheck disable=SC2086
  run qwen3.6-27b --model-path inflate:qwen3.6-27b --conversations "${CONV_27B:-16}" \
    --concurrency 8 --server-timeout-s 300 \
    --server-flag=--mamba-scheduler-strategy=no_buffer ${FLAGS_27B:-}
fi
echo "## done in $(($(date +%s) - T0)) s; results under $OUT/"
exit $RC
