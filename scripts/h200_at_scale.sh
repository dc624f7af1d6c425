#!/usr/bin/env bash
# The at-scale serving benchmark in one H200 device run (issue 18), from the repository root,
# with `.whl` carried (fastapi / uvicorn / pydantic / openai wheels for Python 3.12, which the
# device image lacks):
#   scripts/h200_at_scale.sh [OUT_DIR] [extra `ddtree bench at-scale` flags]
# Inflates the embedded pair to the Qwen3-8B shape on the GPU, writes it to /tmp (local disk
# there), times it against a random-weight 8B pair, serves NONE / DFLASH / DDTREE B=16,32,64 at
# concurrency 1..64 and compares τ with the small pair. Starts no new step after
# --time-budget-s (default 540 s).
set -euo pipefail
OUT=${1:-${OUT:-at_scale_out}}
shift || true
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python3 -m ddtree bench at-scale --shape qwen3-8b --work-dir /tmp/ddtree_at_scale \
  --out "$OUT" "$@" 2>&1 | tee "$OUT/at_scale.log"
