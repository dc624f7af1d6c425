#!/usr/bin/env bash
# Grammars inside speculation on the H200 (issue 41), one device run of ~6 minutes, from the
# repository root with `.whl` carried (`bash scripts/fetch_device_wheels.sh` first: the server,
# the bench client and xgrammar + apache-tvm-ffi, which the device image lacks):
#   run: bash scripts/device/grammar.sh        (carry: [".whl"], optionally ".tcache")
# A. the bitmask on the GPU: xgrammar's kernel == grammar/masks.py's reference (bit for bit, on
#    random masks at the 8B vocab, 16 x 65 rows) and each one's time.
# B. lossless under a grammar with CUDA graphs on: the embedded pair in fp32, bench serving's JSON
#    schema, AR / DFLASH / DDTREE16 / auto at concurrency 1 and 4: the `== AR` column must read
#    8/8 everywhere (studies/grammar_rounds.py).
# C. serving, 8B shape (inflate:qwen3-8b, bf16, CUDA graphs, DDTREE auto): `ddtree bench serving
#    --chat` with --response-format text and json_schema at concurrency 1 and 16: tok/s, accept
#    (tau), round ms and the grammar rows' host ms per round (the `grammar` column).
# D. the 8B shape offline, DFLASH and auto: text vs json (forced stretches drafted) vs json-raw
#    (trees built unforced: the study's json-raw): tau, tok/s, round ms, grammar host ms per round at 1 and 16.
# Look at: A "equal True"; B every == AR 8/8; C/D tau and tok/s of json vs text, and grammar ms
# per round against round ms (the host cost the masks add); D json vs json-raw tau (forcing).
# Results in $OUT: mask.txt, lossless.json, serving_text.json, serving_json.json, rounds_8b.json,
# grammar.log (this output).
set -uo pipefail
OUT=${OUT:-grammar_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/grammar.log") 2>&1
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"
T0=$(date +%s)
python3 -c "import importlib.metadata as m, torch; print('xgrammar', m.version('xgrammar'), 'torch', torch.__version__)"

echo "## A. bitmask kernel vs reference"
timeout 60 python3 - <<'EOF' | tee "$OUT/mask.txt"
import time, torch, xgrammar
from ddtree.grammar.masks import apply_bitmask_reference
V, rows = 151936, 16 * 65
g = torch.Generator(device="cuda").manual_seed(0)
masks = torch.randint(-2**31, 2**31 - 1, (rows, (V + 31) // 32), generator=g, device="cuda", dtype=torch.int32)
logits = torch.randn(rows, V, generator=g, device="cuda")
a, b = logits.clone(), logits.clone()
apply_bitmask_reference(a, masks)
xgrammar.apply_token_bitmask_inplace(b, masks, vocab_size=V)
print("equal", torch.equal(a, b))
for name, fn in (("reference", lambda x: apply_bitmask_reference(x, masks)),
                 ("xgrammar", lambda x: xgrammar.apply_token_bitmask_inplace(x, masks, vocab_size=V))):
    x = logits.clone(); fn(x); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        fn(x)
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms for {rows} x {V}")
EOF

echo "## B. lossless under a grammar, fp32, CUDA graphs ($(($(date +%s) - T0)) s)"
timeout 150 python3 studies/grammar_rounds.py --device cuda --dtype float32 \
  --algorithms AR DFLASH DDTREE16 auto --formats json --concurrency 1 4 --num-prompts 8 \
  --max-tokens 96 --output "$OUT/lossless.json"

echo "## C. serving, qwen3-8b shape, DDTREE auto ($(($(date +%s) - T0)) s)"
PORT=30541
python3 -m ddtree.launch_server --model-path inflate:qwen3-8b --speculative-algorithm DDTREE \
  --speculative-ddtree-budget auto --enable-metrics --port $PORT --log-level warning \
  > /tmp/grammar_server.log 2>&1 &
SERVER=$!
for _ in $(seq 240); do
  curl -s -o /dev/null -w "%{http_code}" "localhost:$PORT/health" 2>/dev/null | grep -q 200 && break
  kill -0 $SERVER 2>/dev/null || break
  sleep 1
done
for fmt in text json_schema; do
  short=${fmt%_schema}
  timeout 90 python3 -m ddtree bench serving --base-url "http://127.0.0.1:$PORT" --chat \
    --num-prompts 16 --concurrency 1 16 --max-tokens 128 --response-format $fmt \
    --output "$OUT/serving_$short.json" | grep -v "^wrote"
done
kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
tail -5 /tmp/grammar_server.log
rm -f "$OUT"/serving_*.png

LEFT=$((360 - ($(date +%s) - T0)))
echo "## D. qwen3-8b shape offline, DFLASH and auto (${LEFT} s left)"
if [ "$LEFT" -gt 60 ]; then
  timeout "$LEFT" python3 studies/grammar_rounds.py --device cuda --model-path inflate:qwen3-8b \
    --algorithms DFLASH auto --formats text json json-raw --concurrency 1 16 --num-prompts 16 \
    --max-tokens 128 --output "$OUT/rounds_8b.json"
else
  echo "skipped: not enough time left"
fi
echo "## done in $(($(date +%s) - T0)) s"
