#!/usr/bin/env bash
# Issue 57's served numbers in one device run, from the repository root, `.whl` carried
# (scripts/fetch_device_wheels.sh):
#   run: bash scripts/device/batch_budget.sh      (carry: [".whl"])
# The 8B shape served (inflated in memory, bf16, CUDA graphs to the largest level, held-out
# prompts, 128 tokens, T=0) by auto (its batch-wide packed rounds where its cost model rates them
# above the dense rung), NONE and DFLASH at LEVELS (default 64,128,256), `bench at-scale`: tok/s,
# τ, rows per request and their spread, round ms predicted against measured, the rung mix
# (packed rounds included). Results in $OUT: at_scale.log, at_scale.json, server logs (tgz).
set -uo pipefail
OUT=${OUT:-batch_budget_out}
mkdir -p "$OUT"
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
timeout "${WALL_S:-530}" python3 -m ddtree bench at-scale --shape qwen3-8b --parts serving \
  --configs "${CONFIGS:-DDTREEAUTO,NONE,DFLASH}" --concurrency "${LEVELS:-64,128,256}" --waves 1 \
  --time-budget-s "$(( ${WALL_S:-530} - 40 ))" --out "$OUT/as" 2>&1 \
  | grep -v "^\[ddtree\]" | tail -60 | tee "$OUT/at_scale.log"
cp "$OUT/as/at_scale.json" "$OUT/at_scale.json" 2>/dev/null
(cd "$OUT/as" && grep -h "packed\|rung\|Budget policy" server_*.log | tail -40) > "$OUT/server_grep.log" 2>/dev/null
tar czf "$OUT/servers.tgz" -C "$OUT/as" . 2>/dev/null; rm -rf "$OUT/as"
