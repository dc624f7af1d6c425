#!/usr/bin/env bash
# Issue 45's multi-GPU run, ready for a multi-GPU kind (nvidia-h200-x2 / -x4 / -x8), from the
# repository root, `.whl` carried (and `.tcache`); ~8 minutes on 8 GPUs:
#   scripts/device/dp_multi.sh [OUT_DIR] [--time-budget-s S]
# With N GPUs (all that are visible):
# 1. tests/gpu/test_dp_gpu.py: --dp-size 2 with one GPU per replica answers the engine's tokens
#    (fp32, embedded pair), and survives a replica killed with SIGKILL.
# 2. `bench at-scale` at the Qwen3-8B shape (it fits one GPU), written once to
#    /tmp/ddtree_at_scale (tensor parallelism loads a directory), DFLASH, 128 tokens, concurrency
#    LEVELS (default 1,8,64,256), the same N GPUs split three ways:
#      tpN        --tp-size N: one group, every GPU reads 1/N of the weights (latency)
#      dpN        --dp-size N: N replicas, no all-reduce per layer (throughput)
#      dp2xtpN/2  --dp-size 2 --tp-size N/2 (N >= 4)
#    and scripts/device/dp_report.py's table (tok/s over tpN, TTFT / TPOT p50, tau, round ms).
# What to look for: tpN the lowest TPOT at c=1; dpN the most tok/s at c=64 and up (each replica
# batches c/N with its own weights, no collective); `check-config --dp-size N` and `--tp-size N`
# print the capacity side of the same trade. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 ...).
# Results (<= 8 files): OUT/dp_tests.log, OUT/8b/at_scale.json, at_scale.log, extras.tgz,
# OUT/dp_table.txt, dp_table.json.
set -uo pipefail
OUT=${OUT:-dp_multi_out}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT=$1; shift; fi
BUDGET=540
while [ $# -gt 0 ]; do
  case "$1" in
    --time-budget-s) BUDGET=$2; shift 2 ;;
    *) echo "error: unknown argument $1 (use --time-budget-s)" >&2; exit 2 ;;
  esac
done
LEVELS=${LEVELS:-1,8,64,256}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"  # the carried wheels, PYTHONPATH, the Triton cache
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$N" -lt 2 ]; then
  echo "error: $N GPU visible; this script splits several (scripts/device/dp.sh is the one-GPU run)" >&2
  exit 2
fi
mkdir -p "$OUT/8b"
T0=$(date +%s)
status=0
echo "## 1. correctness on $N GPUs: tests/gpu/test_dp_gpu.py"
timeout 200 python3 -m pytest -m gpu tests/gpu/test_dp_gpu.py -q -s -p no:cacheprovider 2>&1 \
  | tail -15 | tee "$OUT/dp_tests.log" || status=1
CONFIGS="[{\"name\": \"tp$N\", \"algorithm\": \"DFLASH\", \"flags\": [\"--tp-size\", \"$N\"]},
 {\"name\": \"dp$N\", \"algorithm\": \"DFLASH\", \"flags\": [\"--dp-size\", \"$N\"]}"
if [ "$N" -ge 4 ]; then
  H=$((N / 2))
  CONFIGS="$CONFIGS, {\"name\": \"dp2xtp$H\", \"algorithm\": \"DFLASH\",
  \"flags\": [\"--dp-size\", \"2\", \"--tp-size\", \"$H\"]}"
fi
echo "$CONFIGS]" > "$OUT/8b/dp_configs.json"
LEFT=$((BUDGET - ($(date +%s) - T0)))
echo "## 2. timing on $N GPUs: bench at-scale qwen3-8b, --time-budget-s $LEFT"
python3 -m ddtree bench at-scale --shape qwen3-8b --model-store disk \
  --work-dir /tmp/ddtree_at_scale --parts serving --configs "" \
  --config-json "$OUT/8b/dp_configs.json" --concurrency "$LEVELS" --time-budget-s "$LEFT" \
  --out "$OUT/8b" 2>&1 | tee "$OUT/8b/at_scale.log" | grep "^#" || status=1
rm -f "$OUT/8b/dp_configs.json"
(cd "$OUT/8b" && shopt -s nullglob && f=(*.png server_*.log) && [ ${#f[@]} -gt 0 ] &&
  tar czf extras.tgz "${f[@]}" && rm -f "${f[@]}") || true
python3 scripts/device/dp_report.py "$OUT/8b/at_scale.json" "$OUT/dp_table.json" \
  | tee "$OUT/dp_table.txt" || status=1
echo "## done in $(($(date +%s) - T0)) s; results under $OUT/"
exit $status
