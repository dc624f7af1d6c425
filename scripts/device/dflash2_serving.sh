#!/usr/bin/env bash
# Issue 42's at-scale serving table with the DFlash2 pair, one device run (~9 min; BUDGET_S, default
# 540, bounds it), from the repository root with `.whl` and `.d2` carried. Before the call, here:
#   bash scripts/train_reference_dflash2.sh /tmp/d2                  (CPU, selector-only, 7-15 min)
#   python3 scripts/dflash2_carry.py pack /tmp/d2/drafter .d2         (2 MB; echo /.d2/ >> .git/info/exclude)
# then run: bash scripts/device/dflash2_serving.sh $OUT                (carry: [".whl", ".d2"])
# 1. the trained DFlash2 drafter rebuilt from the carry (scripts/dflash2_carry.py unpack);
# 2. `bench at-scale --shape qwen3-8b --source-drafter` it: the embedded target and that drafter
#    inflated to the Qwen3-8B shape, DFLASH and DDTREE auto served at concurrency 1, 8, 64;
# 3. in the time left, the same with the embedded DFlash drafter: the DFlash / DFlash2 ratio per
#    config on the same card and in the same call.
# Results: OUT/at_scale_dflash2.json, OUT/at_scale_dflash.json, OUT/serving.log.
set -uo pipefail
OUT=${1:-${OUT:-dflash2_serving_out}}
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $((${BUDGET_S:-540} - ($(date +%s) - T0))); }
status=0
[ -f .d2/delta.safetensors ] || { echo "error: carry .d2 (see the header)" >&2; exit 2; }
python3 scripts/dflash2_carry.py unpack .d2 /tmp/d2_drafter || exit 1
serve() {  # serve NAME [--source-drafter DIR]
  local name=$1 budget
  shift
  budget=$(($(left) - 20))
  if [ "$budget" -lt 120 ]; then echo "## $name: skipped, ${budget} s left"; return; fi
  echo "## $name pair, --time-budget-s $budget"
  python3 -m ddtree bench at-scale --shape qwen3-8b --model-store disk --parts serving \
    --configs DFLASH,DDTREEAUTO --concurrency 1,8,64 --waves 1 --time-budget-s "$budget" \
    --work-dir "/tmp/as_$name" --out "$OUT/as_$name" "$@" 2>&1 | grep -v "graph/s\|step/s" \
    | tee -a "$OUT/serving.log" | grep -v "^#" | tail -12 || status=1
  mv "$OUT/as_$name/at_scale.json" "$OUT/at_scale_$name.json" 2>/dev/null || status=1
  rm -rf "$OUT/as_$name" "/tmp/as_$name"  # server logs and the pair: 8 files come back at most
}
serve dflash2 --source-drafter /tmp/d2_drafter
serve dflash
echo "## done in $(($(date +%s) - T0)) s (status $status)"
exit $status
