#!/usr/bin/env bash
# Trains the embedded reference pair (issue 3) from scratch: a Qwen3-architecture target on the Python
# standard library's source (modules json, argparse, textwrap, statistics held out), then its DFlash
# drafter on target-regenerated continuations. Seeded; sized for one 10-minute run on an H200.
#   scripts/train_reference_pair.sh OUT_DIR            (GPU: the real run)
#   SMOKE=1 scripts/train_reference_pair.sh OUT_DIR    (CPU: a few steps, to check the pipeline)
#   TARGET=DIR scripts/train_reference_pair.sh OUT_DIR (reuse a trained target; train the drafter only)
set -euo pipefail
OUT=${1:?usage: train_reference_pair.sh OUT_DIR}
mkdir -p "$OUT"
if [ "${SMOKE:-0}" = 1 ]; then
  T_STEPS=3; D_STEPS=3; REGEN=16; GEN=32; HID=64; LAYERS=2; HEADS=2; INTER=128; FLAGS="--device cpu"
else
  T_STEPS=${T_STEPS:-700}; D_STEPS=${D_STEPS:-4500}; REGEN=${REGEN:-16384}; GEN=${GEN:-192}
  HID=384; LAYERS=6; HEADS=6; INTER=1024; FLAGS=""
fi
D_LAYERS=${D_LAYERS:-4}; D_LR=${D_LR:-8e-4}
if [ -n "${TARGET:-}" ]; then
  mkdir -p "$OUT/target" && cp "$TARGET"/* "$OUT/target/"
else
python3 -m ddtree train-target --corpus stdlib --vocab-size 8192 --seq-len 512 --hidden-size $HID \
  --num-layers $LAYERS --num-heads $HEADS --num-kv-heads 2 --head-dim 64 --intermediate-size $INTER \
  --tie-word-embeddings --max-position-embeddings 4096 --steps $T_STEPS --batch-size 32 --lr 3e-3 --seed 0 \
  --save-dtype bfloat16 --save-every 0 --no-progress $FLAGS --out "$OUT/target"
fi
# prompts for regeneration: the first 64 tokens of packed training rows (held-out modules never enter)
python3 - "$OUT" <<'PY'
import sys
from transformers import AutoTokenizer
from ddtree.tools.train import data
out = sys.argv[1]
tok = AutoTokenizer.from_pretrained(f"{out}/target")
files, _ = data.stdlib_files()
rows = data.pack_documents(data.tokenize_texts(tok, data.read_texts(files)), 64)
data.save_tokens(f"{out}/prompts.pt", rows)
print("prompts", tuple(rows.shape), file=sys.stderr)
PY
python3 -m ddtree train-drafter --model-path "$OUT/target" --data "$OUT/prompts.pt" --regenerate $REGEN \
  --prompt-len 64 --gen-len $GEN --num-layers $D_LAYERS --block-size 16 --anchors 64 --steps $D_STEPS --batch-size 32 \
  --lr $D_LR --seed 0 --save-dtype bfloat16 --save-every 0 --no-progress $FLAGS --out "$OUT/drafter"
