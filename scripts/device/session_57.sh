#!/usr/bin/env bash
# One device call for a short budget (issues 56 / 57): the GPU tests a cut run left plus the new
# ones (the packed rounds on the device, eager and graphed; the graph pool within the plan) for at most TEST_S
# seconds in parallel, then issue 57's served numbers (scripts/device/batch_budget.sh, WALL_S).
#   run: bash scripts/device/session_57.sh      (carry: [".whl", ".fp8dev"])
# Results in $OUT: tests.tgz (each process's pytest tail), the batch_budget.sh files.
set -uo pipefail
OUT=${OUT:-session_57_out}
mkdir -p "$OUT/t"
OUT=$OUT/t RESUME=${RESUME:-a:51,c:19} SPLIT=3 ONLY=${ONLY:-ac} GRAPH_CASES=none TEST_S=${TEST_S:-150} \
  EXTRA="tests/gpu/test_budget_gpu.py::test_packed_rounds_on_the_device_equal_ar tests/gpu/test_budget_gpu.py::test_packed_graphs_on_the_device_equal_ar tests/gpu/test_engine_config_gpu.py::test_cuda_graph_pool_is_within_the_plan" \
  bash "$(dirname "$0")/gpu_suite.sh" > /dev/null 2>&1
for f in "$OUT"/t/tests_*.log; do
  echo "== $f: $(tr -cd '.sFE' < "$f" | wc -c) run, $(tr -cd 'FE' < "$f" | wc -c) F/E; $(grep -E "passed|failed|error" "$f" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$f" | head -5
done
tar czf "$OUT/tests.tgz" -C "$OUT/t" . && rm -rf "$OUT/t"
[ "${WALL_S:-420}" -gt 0 ] && OUT=$OUT WALL_S=${WALL_S:-420} bash "$(dirname "$0")/batch_budget.sh"
