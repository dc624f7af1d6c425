#!/usr/bin/env bash
# Issue 54 item 9 on one H100 (80 GiB), from the repository root, with `.whl` carried (as
# scripts/h200_at_scale.sh): the Qwen3.6-27B hybrid shape in FP8, 32 prompts repeated at
# concurrency 1, 8 and 64 (--max-running-requests 64), DFLASH / DDTREE auto / DDTREE auto with
# --disable-radix-cache (the concurrency the checkpoint rows cost):
#   scripts/gpu_hybrid_prefix_hits.sh [OUT_DIR] [bench at-scale flags]
# Before the fix DDTREE auto served 0% of prompt tokens from the cache (the plan left it ~1 state
# checkpoint row; DFLASH 41 rows, 89%). Expected now: both hit from the second level on, and per
# level the JSON's cache_state_miss_tokens (cached KV recomputed for want of a checkpoint) stays 0.
# The summary prints, per config and level, hit rate, state-miss tokens, checkpoint drops and
# output tok/s; the servers' startup lines give the plan (`Prefix cache: N recurrent-state
# checkpoint rows`, the running requests in `KV cache: ...`).
set -euo pipefail
OUT=${OUT:-hybrid_prefix_out}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT=$1; shift; fi
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/device_env.sh"  # the carried wheels, PYTHONPATH
mkdir -p "$OUT"
python3 -m ddtree check-config --model-path inflate:qwen3.6-27b --speculative-algorithm DDTREE \
  --speculative-ddtree-budget auto --quantization fp8 --speculative-draft-quantization fp8 \
  --mamba-scheduler-strategy no_buffer --max-running-requests 64 --cuda-graph-max-bs 64 \
  2>&1 | grep -E "state (pool|checkpoints)|KV pool|warning" || true
python3 -m ddtree bench at-scale --shape qwen3.6-27b --in-memory --out "$OUT" \
  --config-json studies/configs/hybrid_prefix_fp8.json --server-flags \
  "--mamba-scheduler-strategy no_buffer --log-level info" --concurrency 1,8,64 --waves 1 \
  --min-prompts 32 --parts serving --server-timeout-s 240 --time-budget-s 540 "$@" 2>&1 |
  tee "$OUT/at_scale.log" || true
grep -h -E "Prefix cache:|KV cache:" "$OUT"/server_*.log 2>/dev/null || true
python3 - "$OUT/at_scale.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, levels in d["serving"].items():
    for lv in levels:
        print(f"{name:>28} c={lv['concurrency']:>3} hit {lv['cache_hit_rate']:.2f} "
              f"state-miss {lv.get('cache_state_miss_tokens')} drops {lv.get('cache_checkpoint_drops')} "
              f"{lv['output_throughput']:.0f} tok/s")
PY
(cd "$OUT" && shopt -s nullglob && f=(*.png server_*.log) && [ ${#f[@]} -gt 0 ] &&
  tar czf extras.tgz "${f[@]}" && rm -f "${f[@]}") || true
