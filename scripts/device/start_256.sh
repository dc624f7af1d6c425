#!/usr/bin/env bash
# Every batch size the plan accepts starts (issue 56): servers at the Qwen3-8B shape (inflated in
# memory, bf16, CUDA graphs to 256) with --max-running-requests 256 --cuda-graph-max-bs 256, for
# DFLASH (which died of CUDA OOM at startup in the draft graph's capture before the draft's log Z
# went through row_logsumexp) and DDTREE auto; each must reach /health, then serve 256 concurrent
# requests of 32 tokens. Beside each: check-config's plan for the same flags, and the GPU memory
# in use once serving. From the repository root, `.whl` carried (scripts/fetch_device_wheels.sh):
#   run: bash scripts/device/start_256.sh      (carry: [".whl"])
# WITH_AUTO=1 adds the auto server (its graphs at every rung to 256 take minutes to capture).
# Results in $OUT: start_256.log (this output) and server_<config>.log.
set -uo pipefail
OUT=${OUT:-start_256_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/start_256.log") 2>&1
# shellcheck source=scripts/device_env.sh
. "$(dirname "$0")/../device_env.sh"
FLAGS=(--model-path inflate:qwen3-8b --max-running-requests 256 --cuda-graph-max-bs 256)
serve() {  # serve NAME FLAGS...
  local name=$1; shift
  echo "## $name: check-config"
  python3 -m ddtree check-config "${FLAGS[@]}" "$@" 2>&1 | sed -n '/memory plan:/,$p'
  echo "## $name: server"
  local t0; t0=$(date +%s)
  python3 -m ddtree.launch_server "${FLAGS[@]}" "$@" --port 30000 > "$OUT/server_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 150); do
    curl -sf localhost:30000/health > /dev/null && break
    kill -0 $pid 2> /dev/null || break
    sleep 2
  done
  if ! curl -sf localhost:30000/health > /dev/null; then
    echo "$name: DID NOT START ($(($(date +%s) - t0)) s)"; tail -30 "$OUT/server_$name.log"
    kill $pid 2> /dev/null; wait $pid 2> /dev/null; return
  fi
  echo "$name: healthy after $(($(date +%s) - t0)) s"
  grep -E "KV cache:|CUDA graphs" "$OUT/server_$name.log" | tail -3
  python3 - <<'PY'
import asyncio, time, httpx
async def main():
    async with httpx.AsyncClient(timeout=300) as c:
        async def one(i):
            r = await c.post("http://127.0.0.1:30000/v1/completions", json={
                "prompt": f"def f{i}(x):\n    ", "max_tokens": 32, "ignore_eos": True, "temperature": 0})
            return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
        t = time.perf_counter()
        res = await asyncio.gather(*(one(i) for i in range(256)))
        dt = time.perf_counter() - t
        ok = sum(s == 200 for s, _ in res)
        print(f"256 concurrent: {ok} x 200, {sum(n for _, n in res)} tokens in {dt:.1f} s")
asyncio.run(main())
PY
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
  curl -s localhost:30000/health; echo
  kill $pid; wait $pid 2> /dev/null
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
serve dflash --speculative-algorithm DFLASH
[ "${WITH_AUTO:-0}" = 1 ] && serve auto --speculative-algorithm DDTREE --speculative-ddtree-budget auto
