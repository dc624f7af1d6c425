#!/usr/bin/env bash
# Issue 39's differential fuzzer on the H200 (~6 min), from the repository root:
#   scripts/device/fuzz.sh [OUT_DIR]
# The CPU suite fuzzes the eager paths; here the same seeded cases run on CUDA with the server's
# defaults: CUDA graphs (verify with the in-graph greedy accept walk, commit, draft -> tree build
# kernel, graphed prefill extends; captured up to batch 8), Triton attention and GDN kernels (both
# mamba strategies), fp32 toy pairs (dense Qwen3 + hybrid Qwen3.5, trained here in ~1 min: no
# DDTREE_CACHE on the device). Every case: integrity after every step, every greedy output == AR
# (also on CUDA) cut by the stop-rule oracle, cached pages / checkpoints == a fresh prefill,
# injected faults failed alone.
# Prints per failing case its report and a one-line reproduction (`--device cuda`), then a summary:
#   "N cases, R requests, S steps, T s; F failed" and the coverage counters.
# What to look for: "0 failed" and a greedy speculative mean accept length > 2. A failure line names
# the seed; rerun it here with the printed command (CPU: drop --device cuda, to see if it is
# CUDA-only). Writes $OUT/fuzz_cuda.log (everything) and $OUT/summary.txt.
set -uo pipefail
OUT=${1:-${OUT:-fuzz_out}}
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"  # PYTHONPATH (the engine fuzz needs no server wheels)
mkdir -p "$OUT"
export DDTREE_CACHE=${DDTREE_CACHE:-/tmp/ddtree_fuzz_pairs}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/summary.txt"
# the toy pairs (trained once, seeded: the same weights as the CPU suite's cache)
timeout 150 python3 -c "import sys; sys.path.insert(0, 'tests'); import fuzz_engine as f; print(f.toy_pairs())" \
  2>&1 | tail -2 | tee -a "$OUT/summary.txt"
# seeds from 100000: cases the CPU CI (seeds 0-35) and its regression seeds never ran
timeout 330 python3 tests/fuzz_engine.py --device cuda --long --hours 0.08 --seed 100000 \
  --requests 24 2>&1 | grep -v "GC pause" | tee "$OUT/fuzz_cuda.log"
status=${PIPESTATUS[0]}
tail -4 "$OUT/fuzz_cuda.log" | tee -a "$OUT/summary.txt"
grep "^FAILED:" "$OUT/fuzz_cuda.log" | tee -a "$OUT/summary.txt"
exit "$status"
