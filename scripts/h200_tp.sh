#!/usr/bin/env bash
# Issue 24's multi-GPU run in one device call on a multi-GPU kind (nvidia-h200-x2 / -x4 / -x8), from
# the repository root, `.whl` carried (and `.tcache` if a session packed one):
#   scripts/h200_tp.sh [OUT_DIR] [--tp 1,2] [--shapes qwen3-8b,qwen3.6-27b] [--time-budget-s S]
# 1. tests/gpu/test_tp_gpu.py: TP=2 emits TP=1's tokens at T=0 (embedded pair, fp32; AR / DFLASH /
#    DDTREE), the bf16 run reported beside it;
# 2. per shape and TP size, `bench at-scale --parts serving` with `--tp-size`: DFLASH and DDTREE B=64
#    at concurrency 1..64 (the round time at batch 1 and 8 and the tok/s from each server's
#    /metrics). An `inflate:` pair is built whole on one device, so each shape is written once under
#    /tmp/ddtree_at_scale (--model-store disk: ~17 GB for 8B, ~55 GB for 27B) and every TP size
#    loads that directory.
# The per-GPU weight floor is the shard's bytes over the copy bandwidth: `bench at-scale --parts
# rounds` (TP=1) measures the bandwidth in the same call. NVLink multicast stays off (the device
# notes: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
set -uo pipefail
OUT=${OUT:-tp_out}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT=$1; shift; fi
TPS=1,2 SHAPES=qwen3-8b,qwen3.6-27b BUDGET=540
while [ $# -gt 0 ]; do
  case "$1" in
    --tp) TPS=$2; shift 2 ;;
    --shapes) SHAPES=$2; shift 2 ;;
    --time-budget-s) BUDGET=$2; shift 2 ;;
    *) echo "error: unknown argument $1 (use --tp, --shapes, --time-budget-s)" >&2; exit 2 ;;
  esac
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/device_env.sh"  # the carried wheels, PYTHONPATH, the Triton cache
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
for tp in ${TPS//,/ }; do
  if [ "$tp" -gt "$GPUS" ]; then
    echo "error: --tp $TPS asks for $tp GPUs, this machine has $GPUS" >&2; exit 2
  fi
done
mkdir -p "$OUT"
T0=$(date +%s)
status=0
timeout 240 python3 -m pytest -m gpu tests/gpu/test_tp_gpu.py -q -s 2>&1 | tail -20 \
  | tee "$OUT/tp_tests.log" || status=1
for shape in ${SHAPES//,/ }; do
  flags=""
  [ "$shape" = qwen3.6-27b ] && flags="--mamba-scheduler-strategy no_buffer"
  for tp in ${TPS//,/ }; do
    LEFT=$((BUDGET - ($(date +%s) - T0)))
    if [ "$LEFT" -lt 90 ]; then
      echo "## $shape tp=$tp: skipped, ${LEFT} s left of --time-budget-s $BUDGET"; continue
    fi
    parts=serving
    [ "$tp" = 1 ] && parts=rounds,serving  # the copy bandwidth (floor) and TP=1's own rounds
    mkdir -p "$OUT/$shape-tp$tp"
    echo "## $shape tp=$tp: --time-budget-s $LEFT"
    python3 -m ddtree bench at-scale --shape "$shape" --model-store disk --parts "$parts" \
      --configs DFLASH,DDTREE64 --concurrency 1,8,64 --time-budget-s "$LEFT" \
      --out "$OUT/$shape-tp$tp" --server-flags "$flags --tp-size $tp" 2>&1 \
      | tee "$OUT/$shape-tp$tp/at_scale.log" | grep -v "^#" | tail -12 || status=1
    (cd "$OUT/$shape-tp$tp" && shopt -s nullglob && f=(*.png server_*.log) && [ ${#f[@]} -gt 0 ] &&
      tar czf extras.tgz "${f[@]}" && rm -f "${f[@]}") || true
  done
done
pack_triton_cache "$OUT"
exit $status
