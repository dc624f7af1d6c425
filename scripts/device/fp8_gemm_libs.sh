#!/usr/bin/env bash
# Issue 58: block-FP8 GEMM libraries vs today's Triton / cuBLAS and bf16, in one device run, from the
# repository root. DeepGEMM: `.dglib/deep_gemm.tgz` carried (the package with its extension built
# against the device's torch: scripts/build_deep_gemm.sh; the sgl-deep-gemm wheels on PyPI are
# built against torch >= 2.12 and do not load on 2.11), or a `.whl` wheel that loads there.
# flashinfer-python is not carried (its wheel alone is 62 MB, over what a call takes).
#   scripts/device/fp8_gemm_libs.sh [OUT_DIR] [--only gemm,tests,rounds] [--rows 1,8,...] [--sweep-m N]
# 1. gemm: studies/gpu_fp8_gemm_libs.py at the 8B and 27B layer shapes and LM heads, 1 .. 1040 rows:
#    us per call of bf16 / Triton / cuBLAS block-scaled / DeepGEMM (quantization included, and alone),
#    each against the reference, bit-for-bit row invariance in bf16 and fp32, then a table.
#    DeepGEMM's JIT compiles into $DG_JIT_CACHE_DIR (nvcc from the device's CUDA 13).
# 2. tests: tests/gpu/test_fp8_gpu.py and tests/gpu/test_fp8_lib_gpu.py (the library kernels vs the
#    reference, the engine's table and warm-up on the device).
# 3. rounds: `ddtree bench rounds` on the Qwen3-8B shape (random weights), bf16 then --quantization
#    fp8 (the engine's dispatch: the table), AR / DFLASH / DDTREE B=64 at batch 1 and 8, as fp8.sh's.
# Results: OUT/gemm_libs.json, OUT/gemm_libs.log, OUT/tests.log, OUT/rounds_{bf16,fp8}.json, OUT/rounds.log.
set -uo pipefail
OUT=${OUT:-fp8_libs_out}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT=$1; shift; fi
ONLY=gemm,tests,rounds ROWS=1,8,16,64,128,256,520,1040 SWEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY=$2; shift 2 ;;
    --rows) ROWS=$2; shift 2 ;;
    --sweep-m) SWEEP=$2; shift 2 ;;
    *) echo "error: unknown argument $1 (use --only, --rows, --sweep-m)" >&2; exit 2 ;;
  esac
done
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"  # the carried wheels, PYTHONPATH, the Triton cache
[ -d .toycache ] && export DDTREE_CACHE="$PWD/.toycache"
if [ -f .dglib/deep_gemm.tgz ]; then
  mkdir -p /tmp/dglib && tar xzf .dglib/deep_gemm.tgz -C /tmp/dglib
  export PYTHONPATH="/tmp/dglib:$PYTHONPATH"
fi
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
export CUDA_HOME DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/dgcache}
mkdir -p "$OUT" "$DG_JIT_CACHE_DIR"
has() { [[ ",$ONLY," == *",$1,"* ]]; }
status=0
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
nvcc --version | tail -2
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -3
if has gemm; then
  echo "## 1. FP8 GEMM libraries"
  timeout "${GEMM_TIMEOUT:-420}" python3 studies/gpu_fp8_gemm_libs.py --rows "$ROWS" \
    --sweep-m "$SWEEP" --sweep-budget-s "${SWEEP_BUDGET:-60}" --out "$OUT/gemm_libs.json" \
    > "$OUT/gemm_libs.log" 2>&1 || status=1
  grep -E "^(deepgemm|\{)" "$OUT/gemm_libs.log" | cut -c1-1500
  sed -n '/^us per call/,$p' "$OUT/gemm_libs.log"
  grep -E "Error|error" "$OUT/gemm_libs.log" | sort | uniq -c | sort -rn | head -8 | cut -c1-600
fi
if has tests; then
  echo "## 2. GPU tests"
  # TESTS_K: a -k selection (e.g. "not graphs_match": without the toy pairs' engine runs)
  timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/gpu/test_fp8_lib_gpu.py tests/gpu/test_fp8_gpu.py -k "${TESTS_K:-}" \
    2>&1 | tail -25 | tee "$OUT/tests.log" || status=1
fi
if has rounds; then
  echo "## 3. 8B rounds, bf16 then fp8"
  for q in bf16 fp8; do
    flags=""
    [ "$q" = fp8 ] && flags="--quantization fp8"
    echo "# $q" | tee -a "$OUT/rounds.log"
    # shellcheck disable=SC2086
    timeout "${ROUNDS_TIMEOUT:-110}" python3 -m ddtree bench rounds --batch-sizes 1,8 \
      --budgets 64 --rounds 20 --warmup 3 --accept-lengths "" --no-plot \
      --output "$OUT/rounds_$q.json" $flags 2>&1 | grep -v "CUDA graphs" | tee -a "$OUT/rounds.log" \
      | grep -E "^(floor|device| +1024|ctx)" || status=1
  done
fi
echo "## done; results under $OUT/ (status $status)"
exit $status
