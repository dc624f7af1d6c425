#!/usr/bin/env bash
# Trains a DFlash2 drafter for the embedded reference pair's target (issue 42), seeded.
# Warm start: the shipped DFlash drafter's weights (function-preserving: identity convolutions,
# a selector whose rescoring starts at zero), then the candidate selector.
#   scripts/train_reference_dflash2.sh OUT_DIR              (CPU: --selector-only, ~15 min of one
#       core: the backbone frozen, the selector fitted on features computed once, the step with the
#       best held-out chain acceptance kept; OUT/drafter/selector_features.* cache the features)
#   FULL=1 scripts/train_reference_dflash2.sh OUT_DIR       (GPU: every weight, convolutions
#       included, the DFlash recipe plus the selector loss)
#   SMOKE=1 scripts/train_reference_dflash2.sh OUT_DIR      (a few steps, to check the pipeline)
#   BLOCK=8 ...                                             (block size 8: 7 drafts per round)
set -euo pipefail
OUT=${1:?usage: train_reference_dflash2.sh OUT_DIR}
PAIR=$(python3 -c "from ddtree.assets import PACKAGE_PAIR; print(PACKAGE_PAIR)")
mkdir -p "$OUT"
BLOCK=${BLOCK:-16}
if [ "${SMOKE:-0}" = 1 ]; then
  REGEN=16; GEN=32; STEPS=5; ANCHORS=4
else
  REGEN=${REGEN:-1024}; GEN=${GEN:-96}; STEPS=${STEPS:-1000}; ANCHORS=${ANCHORS:-12}
fi
# prompts: the first 64 tokens of packed training rows (held-out modules never enter), as the
# DFlash drafter's own run (scripts/train_reference_pair.sh)
python3 - "$OUT" "$PAIR" <<'PY'
import sys
from transformers import AutoTokenizer
from ddtree.tools.train import data
out, pair = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(f"{pair}/target")
files, _ = data.stdlib_files()
rows = data.pack_documents(data.tokenize_texts(tok, data.read_texts(files)), 64)
data.save_tokens(f"{out}/prompts.pt", rows)
print("prompts", tuple(rows.shape), file=sys.stderr)
PY
COMMON=(--model-path "$PAIR/target" --data "$OUT/prompts.pt" --regenerate "$REGEN" --prompt-len 64
  --gen-len "$GEN" --num-layers 4 --target-layer-ids 1,2,3 --mask-token-id 2 --block-size "$BLOCK"
  --architecture dflash2 --selector-rank "${RANK:-64}" --selector-top-k 16 --init-from "$PAIR/drafter"
  --eval-frac 0.04
  --seed 0 --save-dtype bfloat16 --save-every 0 --no-progress --out "$OUT/drafter")
if [ "${FULL:-0}" = 1 ]; then
  python3 -m ddtree train-drafter "${COMMON[@]}" --anchors 64 --steps "${STEPS}" --batch-size 32 --lr 2e-4
else
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python3 -m ddtree train-drafter "${COMMON[@]}" --device cpu \
    --selector-only --anchors "$ANCHORS" --steps "$STEPS" --batch-size 4096 --lr 3e-3
fi
