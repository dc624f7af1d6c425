#!/usr/bin/env bash
# Issue 45 (--dp-size) on ONE H200, from the repository root, `.whl` carried (and `.tcache` if a
# session packed one); ~6 minutes:
#   scripts/device/dp.sh [OUT_DIR]
# 1. Correctness (~1.5 min): tests/gpu/test_dp_gpu.py - a --dp-size 2 server, its two replicas
#    sharing the GPU (--gpu-id-step 0, --mem-fraction-static 0.3 each), answers the offline
#    engine's tokens at T=0 (embedded pair, fp32, DDTREE, CUDA graphs), prompts alone and all at
#    once over both replicas; a replica killed with SIGKILL leaves the other serving.
# 2. Timing (~4 min): `bench at-scale` at the Qwen3-8B shape (each server, each replica, builds
#    inflate:qwen3-8b in memory, bf16), DFLASH, concurrency 1,4,16,64 (LEVELS), 128 tokens:
#      in-process  one engine inside the HTTP process (today's server, --dp-size 1)
#      dp2-shared  --dp-size 2 --gpu-id-step 0 --mem-fraction-static 0.42: two replicas on the GPU
#      replica     --dp-size 1 --dp-replica-process: the one engine in a replica
#                  process behind the dispatcher (the process boundary alone)
#    then scripts/device/dp_report.py prints the table (tok/s, each over in-process, TTFT / TPOT
#    p50, tau, the HTTP loop's lag, round and host ms per round from /metrics).
# What to look for: `replica` vs `in-process` at every concurrency is the dispatch's own cost
# (expected ~1.00x tok/s, TTFT within ~1 ms, TPOT equal; the HTTP loop lag lower: the engine no
# longer shares its GIL). `dp2-shared` at c=1 equals `in-process` (one replica busy); above that
# two replicas time-share one GPU (no MPS) and each reads the weights for half the batch, so it
# falls below in-process: the physics of sharing a GPU, which a multi-GPU run
# (scripts/device/dp_multi.sh) does not have. Results (<= 8 files): OUT/dp_tests.log,
# OUT/8b/at_scale.json, at_scale.log, extras.tgz (server logs), OUT/dp_table.txt, dp_table.json.
set -uo pipefail
OUT=${OUT:-dp_out}
if [ $# -gt 0 ]; then OUT=$1; fi
LEVELS=${LEVELS:-1,4,16,64}  # LEVELS=1,2,4,8,16,32,64 for the full table (~1 min more)
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"  # the carried wheels, PYTHONPATH, the Triton cache
mkdir -p "$OUT/8b"
T0=$(date +%s)
status=0
echo "## 1. correctness: tests/gpu/test_dp_gpu.py"
timeout 200 python3 -m pytest -m gpu tests/gpu/test_dp_gpu.py -q -s -p no:cacheprovider 2>&1 \
  | tail -15 | tee "$OUT/dp_tests.log" || status=1
LEFT=$((350 - ($(date +%s) - T0)))
echo "## 2. timing: bench at-scale qwen3-8b, --time-budget-s $LEFT"
cat > "$OUT/8b/dp_configs.json" <<'JSON'
[
 {"name": "in-process", "algorithm": "DFLASH", "flags": []},
 {"name": "dp2-shared", "algorithm": "DFLASH",
  "flags": ["--dp-size", "2", "--gpu-id-step", "0", "--mem-fraction-static", "0.42"]},
 {"name": "replica", "algorithm": "DFLASH", "flags": ["--dp-replica-process"]}
]
JSON
python3 -m ddtree bench at-scale --shape qwen3-8b --model-store memory --parts serving \
  --configs "" --config-json "$OUT/8b/dp_configs.json" --concurrency "$LEVELS" \
  --time-budget-s "$LEFT" --out "$OUT/8b" 2>&1 | tee "$OUT/8b/at_scale.log" | grep "^#" || status=1
rm -f "$OUT/8b/dp_configs.json"
(cd "$OUT/8b" && shopt -s nullglob && f=(*.png server_*.log) && [ ${#f[@]} -gt 0 ] &&
  tar czf extras.tgz "${f[@]}" && rm -f "${f[@]}") || true
python3 scripts/device/dp_report.py "$OUT/8b/at_scale.json" "$OUT/dp_table.json" \
  | tee "$OUT/dp_table.txt" || status=1
echo "## done in $(($(date +%s) - T0)) s; results under $OUT/"
exit $status
