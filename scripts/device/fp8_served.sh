#!/usr/bin/env bash
# Issue 58's served table in one H100 (80 GB) device call, from the repository root, with `.whl`
# (scripts/fetch_device_wheels.sh: fastapi / uvicorn / openai / fla-core ...) and the DeepGEMM
# artifact (scripts/build_deep_gemm.sh: the package with its extension built against the device's
# torch; the sgl-deep-gemm wheels on PyPI need torch >= 2.12) carried:
#   run: bash scripts/device/fp8_served.sh $OUT --deep-gemm .fp8dev/deep_gemm.tgz
#        (carry: [".whl", ".fp8dev"]; timeout_s 600)
#   scripts/device/fp8_served.sh [OUT_DIR] [--deep-gemm TGZ] [--wall-s S] [--parts 8b,ar,27b]
#                                [--dry-run] [studies/fp8_served.py flags ...]
# studies/fp8_served.py does the work (its docstring: parts, order, what is measured), under a time
# budget of --wall-s (default 565) less what this script spent before it and RESERVE_S (20) for
# after: each measured level is written to OUT/fp8_served.{json,md} when it ends, so a run cut
# short returns the rows it finished. Expected: setup ~15-20 s; 8B, four servers, ~200-300 s (the
# DeepGEMM pre-warm of its 5 FP8 weight shapes, 12 processes, beside the bf16 DFLASH start-up,
# then the auto start-ups: their round-cost profiles); AR, two servers, ~50 s; 27B what is left
# (its first server, bf16 DFLASH beside the 27B pre-warm, compiles the hybrid kernels cold: the
# 27B rows are the ones a short budget loses; `--parts 27b` alone in a second call then, or
# `--parts 8b,27b,ar` to put AR last).
# --dry-run: the CPU check (tiny shapes, every step, no GPU, no DeepGEMM).
# Results (<= 8 files): OUT/fp8_served.json (rows, plans, every level's raw result), .md (the
# BENCHMARKS tables: python3 studies/fp8_serving_summary.py OUT/fp8_served.json), .log, logs.tgz
# (servers' and the pre-warm's logs).
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-fp8_served_out}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT=$1; shift; fi
DG_TGZ="" WALL=565 RESERVE_S=${RESERVE_S:-20} EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --deep-gemm) DG_TGZ=$2; shift 2 ;;
    --wall-s) WALL=$2; shift 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"  # the carried wheels, PYTHONPATH, the Triton cache
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/fp8_served_logs.XXXX)
if [ -n "$DG_TGZ" ]; then
  if [ -f "$DG_TGZ" ]; then
    mkdir -p /tmp/dglib && tar xzf "$DG_TGZ" -C /tmp/dglib && export PYTHONPATH="/tmp/dglib:$PYTHONPATH"
  else
    echo "warning: --deep-gemm $DG_TGZ: no such file; FP8 serves on cuBLAS / Triton" >&2
  fi
fi
if command -v nvcc > /dev/null; then  # DeepGEMM's JIT builds with the device's CUDA toolkit
  CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
  export CUDA_HOME
fi
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/dgcache}
mkdir -p "$DG_JIT_CACHE_DIR"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__)"
python3 -c "import deep_gemm; print('deep_gemm', getattr(deep_gemm, '__version__', '?'), \
deep_gemm.__file__)" 2>&1 | tail -1
BUDGET=$((WALL - ($(date +%s) - T0) - RESERVE_S))
echo "## studies/fp8_served.py, --time-budget-s $BUDGET"
timeout -k 15 $((BUDGET + 10)) python3 studies/fp8_served.py --out "$OUT" --log-dir "$LOGS" \
  --time-budget-s "$BUDGET" ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 | tee "$OUT/fp8_served.log"
status=${PIPESTATUS[0]}
if [ "$status" = 124 ] && [ -f "$OUT/fp8_served.json" ]; then  # cut short: the rows it finished
  echo "## cut at the time limit; the rows saved:"
  python3 studies/fp8_serving_summary.py "$OUT/fp8_served.json" | tee "$OUT/fp8_served.md"
fi
tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null
rm -f "$OUT"/dry_shape_*.json  # --dry-run's tiny shapes
echo "## done in $(($(date +%s) - T0)) s (status $status); results under $OUT/"
exit "$status"
