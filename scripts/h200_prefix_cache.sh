#!/usr/bin/env bash
# The prefix-cache serving targets (issue 22) in one H200 device run, from the repository root,
# with `.whl` carried (fastapi / uvicorn / pydantic / openai wheels, as scripts/h200_at_scale.sh):
#   scripts/h200_prefix_cache.sh [OUT_DIR] [extra `ddtree bench prefix-cache` flags]
# Inflates the embedded pair to the Qwen3-8B shape on the GPU into /tmp, then serves it twice
# (cache on, --disable-radix-cache) with DDTREE B=16 and runs the multi-turn workload (2048-token
# shared system prompt, 4 turns of 64 tokens, 128 output tokens per turn, 32 conversations, 8 at
# once) and the no-sharing one; prints the table and PASS / FAIL per target (exit 1 on a FAIL).
set -euo pipefail
OUT=${1:-${OUT:-prefix_cache_out}}
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
# SHAPE=qwen3.6-27b (hybrid; pass --server-flag=--mamba-scheduler-strategy=no_buffer) needs
# about 60 GB of local disk for the inflated pair
SHAPE=${SHAPE:-qwen3-8b}
PAIR=/tmp/ddtree_prefix_cache/$SHAPE
if [ ! -f "$PAIR/drafter/config.json" ]; then
  python3 -m ddtree inflate --shape "$SHAPE" --device cuda "$PAIR" 2>&1 | tail -3
fi
python3 -m ddtree bench prefix-cache --model-path "$PAIR/target" \
  --speculative-draft-model-path "$PAIR/drafter" --conversations 32 --concurrency 8 \
  --out "$OUT" "$@" 2>&1 | tee "$OUT/prefix_cache.log"
