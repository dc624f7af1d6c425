#!/usr/bin/env bash
# Issue 44 (block FP8) in one H200 device run, from the repository root, `.whl` carried (fastapi /
# uvicorn / pydantic / openai for the servers of part 4; scripts/fetch_device_wheels.sh):
#   scripts/device/fp8.sh [OUT_DIR] [--only gemm,tests,rounds,serving] [--time-budget-s S]
# Expected: ~6 minutes (gemm ~40 s, tests ~70 s, rounds ~60 s, serving the rest of the budget). The
# GPU tests use the toy pairs: carry a `.toycache` holding toy_pair/ and toy_hybrid_pair/ (copies of
# $DDTREE_CACHE's; `echo /.toycache/ >> .git/info/exclude`), else they are trained first (~1 min each).
# 1. gemm: studies/gpu_fp8_gemm.py at the 8B and 27B weight shapes, 1 .. 1040 rows: every variant
#    against the reference (column "auto err": the engine's choice, bf16-output rounding ~1.7e-3;
#    "quant" must say exact: the group-quant kernel == the reference bit for bit), us per call of
#    bf16 F.linear / cuBLAS block-scaled / Triton / auto, the weight floor (FP8 bytes / the copy
#    bandwidth measured in the run), x = bf16 / auto.
# 2. tests: tests/gpu/test_fp8_gpu.py: kernels vs reference at the served shapes, a linear replayed
#    from a CUDA graph == eager, the toy pairs quantized at load served with graphs == eager == FP8 AR
#    (DFLASH / DDTREE, dense and hybrid, mean accept > 2). All must pass.
# 3. rounds: `ddtree bench rounds` on the Qwen3-8B shape (random weights), bf16, then --quantization
#    fp8 (split-K's A/B is part 1's `split` column: the engine never splits): AR, DFLASH and DDTREE
#    B=64 rounds at batch 1 and 8, ms and x floor (each run's own floor: its weight bytes / copy bandwidth).
#    Look at: AR b1 fp8 x its floor (issue goal <= 1.25) and
#    DDTREE B=64 b8 fp8 ms / bf16 ms (goal <= 0.6).
# 4. serving: `bench at-scale` on the 8B shape (pair written once to /tmp in bf16; the fp8 servers
#    quantize at load), studies/configs/fp8_serving.json: DFLASH and DDTREE auto, each bf16 and fp8, at
#    concurrency 1, 8, 64; then studies/fp8_serving_summary.py prints auto / DFLASH at fp8, fp8 / bf16
#    per config (output tok/s, same run) and tau fp8 vs bf16 (goals: auto >= 1.24x DFLASH at c 1-8,
#    >= 1.10x at 16-64; fp8 >= 1.6x bf16 at c 64).
# GEMM_FLAGS: more flags for part 1 (e.g. "--rows 1,16,64 --sweep").
# Results (<= 8 files): OUT/gemm.json, OUT/tests.log, OUT/rounds_{bf16,fp8}.json, OUT/rounds.log,
# OUT/at_scale.json, OUT/serving.log.
set -uo pipefail
OUT=${OUT:-fp8_out}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT=$1; shift; fi
ONLY=gemm,tests,rounds,serving BUDGET=350
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY=$2; shift 2 ;;
    --time-budget-s) BUDGET=$2; shift 2 ;;
    *) echo "error: unknown argument $1 (use --only, --time-budget-s)" >&2; exit 2 ;;
  esac
done
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"  # the carried wheels, PYTHONPATH, the Triton cache
[ -d .toycache ] && export DDTREE_CACHE="$PWD/.toycache"
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
has() { [[ ",$ONLY," == *",$1,"* ]]; }
status=0
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
if has gemm; then
  echo "## 1. FP8 GEMMs vs bf16 / cuBLAS / the floor"
  # shellcheck disable=SC2086
  timeout 150 python3 studies/gpu_fp8_gemm.py --shapes 8b,27b ${GEMM_FLAGS:-} --out "$OUT/gemm.json" \
    > /tmp/gemm.log 2>&1 || status=1
  sed -n '/^per call/,$p' /tmp/gemm.log
fi
if has tests; then
  echo "## 2. GPU tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_fp8_gpu.py 2>&1 \
    | tail -15 | tee "$OUT/tests.log" || status=1
fi
if has rounds; then
  echo "## 3. 8B rounds, bf16 then fp8"
  for q in bf16 fp8; do
    flags=""
    [ "$q" != bf16 ] && flags="--quantization fp8"
    echo "# $q" | tee -a "$OUT/rounds.log"
    # shellcheck disable=SC2086
    timeout 100 python3 -m ddtree bench rounds --batch-sizes 1,8 \
      --budgets 64 --rounds 20 --warmup 3 --accept-lengths "" --no-plot \
      --output "$OUT/rounds_$q.json" $flags 2>&1 | grep -v "CUDA graphs" | tee -a "$OUT/rounds.log" \
      | grep -E "^(floor|device| +1024|ctx)" || status=1
  done
fi
if has serving; then
  LEFT=$(left)
  if [ "$LEFT" -lt 120 ]; then
    echo "## 4. serving: skipped, ${LEFT} s left of --time-budget-s $BUDGET (run --only serving)"
  else
    echo "## 4. 8B serving: DFLASH / DDTREE auto x bf16 / fp8, --time-budget-s $LEFT"
    python3 -m ddtree bench at-scale --shape qwen3-8b --model-store disk --parts serving \
      --configs "" --config-json studies/configs/fp8_serving.json --concurrency 1,8,64 --waves 1 \
      --time-budget-s "$LEFT" --work-dir /tmp/ddtree_at_scale --out "$OUT/at_scale" 2>&1 \
      | tee "$OUT/serving.log" | grep -v "^#" | tail -14 || status=1
    [ -f "$OUT/at_scale/at_scale.json" ] && mv "$OUT/at_scale/at_scale.json" "$OUT/at_scale.json" \
      && python3 studies/fp8_serving_summary.py "$OUT/at_scale.json"
    rm -rf "$OUT/at_scale"  # server logs: the device returns at most 8 files
  fi
fi
echo "## done in $(($(date +%s) - T0)) s; results under $OUT/ (status $status)"
exit $status
