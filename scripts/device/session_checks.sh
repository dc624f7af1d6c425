#!/usr/bin/env bash
# This session's GPU checks in one device run (issues 54, 55, 56), from the repository root with
# `.whl` carried (bash scripts/fetch_device_wheels.sh):
#   run: bash scripts/device/session_checks.sh      (carry: [".whl"])
# 1. seeded sampling in every mode on the GPU (scripts/device/seeded_modes.py);
# 2. the GPU tests this session's changes touch (prompt log-probs, logprobs, CUDA graphs, the
#    memory plan's allocation, the prefix cache);
# 3. the DFLASH server at the 8B shape with --max-running-requests 256 --cuda-graph-max-bs 256
#    (scripts/device/start_256.sh), which died of CUDA OOM at startup before.
set -uo pipefail
OUT=${OUT:-session_out}
mkdir -p "$OUT"
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "## 1. seeded sampling, every mode"
timeout 150 python3 scripts/device/seeded_modes.py 2>&1 | grep -v "^\[ddtree\]" | tee "$OUT/seeded.log"
echo "## 2. GPU tests"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_prompt_logprobs_cuda.py \
  tests/gpu/test_logprobs_cuda.py tests/gpu/test_engine_config_gpu.py \
  tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_prefix_cache_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
echo "## 3. DFLASH at 256"
OUT=$OUT bash scripts/device/start_256.sh
