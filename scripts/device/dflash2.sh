#!/usr/bin/env bash
# Issue 42 (DFlash2 drafters) in one H200 device run, from the repository root (~6 min; BUDGET_S,
# default 340, bounds it; `.whl` / `.tcache` carried as for the other device scripts):
#   scripts/device/dflash2.sh [OUT_DIR]
# 1. tests/gpu/test_dflash2_gpu.py: the grouped dynamic convolution and the selector-chain kernels
#    against their references at the 8B / 27B widths, the path-conditioned tree built on the GPU ==
#    the CPU build, and CUDA graphs == eager through the engine (embedded target + a DFlash2
#    drafter: fp32 token-identical, bf16 <= 1 near-tie, DFLASH and DDTREE 16, batch 1 and 5, mean
#    accepted length > 2). Look for "passed" / any "FAILED" in OUT/gpu_tests.log.
# 2. studies/gpu_dflash2.py at qwen3-8b, then qwen3.6-27b with the time left: median round ms of
#    DFLASH with the DFlash vs the DFlash2 drafter (batch 1 and 8; the draft column is the drafter
#    block + LM head + chain / tree), and DDTREE B=32 (DFlash; DFlash2 path-conditioned; DFlash2
#    over its unary marginals). The line per shape and batch "DFLASH round DFlash2 X ms vs DFlash
#    Y ms: +Z% (OK (<= 5%) | OVER 5%)" is issue 42's criterion. Rows: OUT/dflash2_<shape>.json.
# The DFlash2 source drafter: the checkout's shipped one (ddtree/assets/default_pair/
# drafter_dflash2) if present, else one carried from the embedded DFlash drafter with noise
# (`ddtree.tools.train.selector.dflash2_from_dflash`: cost, not acceptance, is measured here).
set -uo pipefail
OUT=${1:-${OUT:-dflash2_out}}
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $((${BUDGET_S:-340} - ($(date +%s) - T0))); }
status=0
D2=ddtree/assets/default_pair/drafter_dflash2
if [ ! -d "$D2" ]; then
  D2=/tmp/dflash2_src
  python3 -c "
from ddtree.assets import default_model_paths
from ddtree.tools.train.selector import dflash2_from_dflash
t, d = default_model_paths()
dflash2_from_dflash(d, t, '$D2', noise=0.05)" || status=1
fi
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_dflash2_gpu.py \
  >"$OUT/gpu_tests.log" 2>&1 || status=1
tail -4 "$OUT/gpu_tests.log"
for shape in qwen3-8b qwen3.6-27b; do
  budget=$(($(left) - 15))
  if [ "$budget" -lt 60 ]; then echo "skipping $shape: ${budget}s left"; continue; fi
  timeout "$budget" python3 studies/gpu_dflash2.py --shapes "$shape" --dflash2 "$D2" \
    --batches 1,8 --budgets 32 --rounds 30 --time-budget-s "$((budget - 30))" \
    --output "$OUT/dflash2_$shape.json" 2>&1 | grep -v "^Writing\|it/s\]" | tee "$OUT/bench_$shape.log" \
    || status=1
done
pack_triton_cache "$OUT"
echo "total $(($(date +%s) - T0)) s"
exit $status
