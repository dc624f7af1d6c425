#!/usr/bin/env bash
# Issue 57's GPU measurements in one device run, from the repository root, `.whl` carried
# (scripts/fetch_device_wheels.sh):
#   run: bash scripts/device/batch_budget.sh      (carry: [".whl"])
# 1. the cost side: one verify's target forward as a CUDA graph, AR / dense width W / packed
#    batch-wide budgets of R rows, at batch 64, 128, 256, the 8B shape (studies/gpu_packed_verify.py,
#    which also checks the packed logits against the dense ones);
# 2. today's policy at high load: the 8B shape served (inflated in memory, bf16, CUDA graphs,
#    held-out prompts, 128 tokens) by NONE / DFLASH / auto at concurrency 128 and 256, with the rows
#    per request, their spread and the round ms predicted against measured (`bench at-scale`).
# Results in $OUT: packed.json, packed.log, at_scale.log and at_scale.json.
set -uo pipefail
OUT=${OUT:-batch_budget_out}
mkdir -p "$OUT"
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
echo "## 1. packed against dense verify"
timeout 200 python3 studies/gpu_packed_verify.py --batches 64,128,256 --out "$OUT/packed.json" 2>&1 \
  | grep -v "^\[ddtree\]" | tee "$OUT/packed.log"
echo "## 2. served at 128 and 256"
timeout 330 python3 -m ddtree bench at-scale --shape qwen3-8b --parts serving \
  --configs NONE,DFLASH,DDTREEAUTO --concurrency 128,256 --waves 1 --out "$OUT/as" 2>&1 \
  | grep -v "^\[ddtree\]" | tail -40 | tee "$OUT/at_scale.log"
cp "$OUT/as/at_scale.json" "$OUT/at_scale.json" 2>/dev/null; rm -rf "$OUT/as"
