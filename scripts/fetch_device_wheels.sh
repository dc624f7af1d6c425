#!/usr/bin/env bash
# The Python wheels the H200 device image lacks (the server, the bench client, fla-core), for
# Python 3.12 / x86-64, into .whl/ (git-ignored; carry it: `carry: [".whl"]`, then
# `. scripts/device_env.sh` installs them with no index and no deps). Versions: what the test
# extra resolves here; `--no-deps`, so every dependency the image lacks is named below.
#   bash scripts/fetch_device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ver() { python3 -m pip show "$1" 2>/dev/null | awk '/^Version:/{print "=="$2}'; }
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# server: fastapi (+ starlette, pydantic, annotated-types, typing-inspection, opentelemetry-api),
# uvicorn; bench client: openai (+ httpx2, httpcore2, truststore, jiter, distro, sniffio); GDN: fla-core (+ einops);
# grammars: xgrammar (+ apache-tvm-ffi; its torch / triton / transformers are the image's)
PKGS=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection opentelemetry-api
  uvicorn openai httpx2 httpcore2 truststore jiter distro sniffio xgrammar apache-tvm-ffi einops)
mkdir -p .whl
for p in "${PKGS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" -d .whl "$p$(ver "$p")"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLAT[@]}" -d .whl "fla-core==0.6.0"
ls .whl
