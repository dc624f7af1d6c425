#!/usr/bin/env bash
# Issue 56's GPU checks of the round redesign in one device run, from the repository root:
#   git archive <before> ddtree | tar -x -C .before --exclude=ddtree/assets   (the package before)
#   run: bash scripts/device/round_checks.sh      (carry: [".whl", ".before"])
# 1. served Qwen3-8B shape (inflated in memory, bf16, CUDA graphs, held-out prompts, 128 tokens,
#    T=0): NONE / DFLASH / auto at concurrency 1, 8, 64, the package before and after, alternating
#    per config in one run (`bench at-scale --parts serving`);
# 2. the GPU tests of the round's paths (graphs, hybrid graphs, budgets, log-probs, memory plan,
#    prefix cache, extend graphs), four groups in parallel on the one GPU;
# 3. the DFLASH server with --max-running-requests 256 --cuda-graph-max-bs 256 (start_256.sh).
set -uo pipefail
OUT=${OUT:-round_out}
mkdir -p "$OUT"
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"
ROOT=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
ln -sfn "$ROOT/ddtree/assets" .before/ddtree/assets
echo "## 1. served 8B, before / after"
for cfg in NONE DFLASH DDTREEAUTO; do
  for ver in after before; do
    dir=$ROOT; [ $ver = before ] && dir=$ROOT/.before
    (cd "$dir" && timeout 200 python3 -m ddtree bench at-scale --shape qwen3-8b --parts serving \
      --configs $cfg --concurrency 1,8,64 --waves 1 --min-prompts 8 --out "$ROOT/$OUT/serve_${cfg}_$ver" \
      2>&1 | grep -v "^\[ddtree\]" | tail -12) | tee -a "$OUT/serve.log"
  done
done
echo "## 2. GPU tests"
G=tests/gpu
t() { timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider "$@" 2>&1 | tail -6; }
(t $G/test_cuda_graphs_gpu.py $G/test_hybrid_graphs_gpu.py > "$OUT/tests_a.log") &
(t $G/test_budget_gpu.py $G/test_budget_rungs_gpu.py $G/test_logprobs_cuda.py $G/test_prompt_logprobs_cuda.py > "$OUT/tests_b.log") &
(t $G/test_engine_config_gpu.py $G/test_prefix_cache_gpu.py $G/test_first_request_gpu.py > "$OUT/tests_c.log") &
(t $G/test_extend_graph_gpu.py $G/test_dflash2_gpu.py > "$OUT/tests_d.log") &
wait
for f in "$OUT"/tests_*.log; do echo "== $f"; cat "$f"; done
echo "## 3. DFLASH at 256"
OUT=$OUT timeout 150 bash scripts/device/start_256.sh > /dev/null 2>&1
cat "$OUT/start_256.log" 2>/dev/null | grep -v "^\[ddtree\]" | tail -20
cd "$OUT" && tar czf extra.tgz serve_* server_*.log 2>/dev/null && rm -rf serve_* server_*.log; ls
