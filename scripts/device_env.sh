# Sourced by the scripts/h200_*.sh runs, from the repository root: the device image lacks fastapi /
# uvicorn / pydantic / openai / fla-core, so the wheels carried in `.whl` go to /tmp/site (no
# index, no deps); PYTHONPATH then puts them and this checkout first. `bash scripts/fetch_device_wheels.sh`
# downloads the set (a 2026-12-02 at-scale run without sniffio died in the openai client's import).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
# The Triton cache across device sessions (a first 27B hybrid server compiles for ~3 minutes on a
# fresh machine, 38 s with the cache): carry `.tcache` (the parts `pack_triton_cache` wrote) and it
# is unpacked into /tmp/tcache here; `pack_triton_cache $OUT` at the end of a run writes the
# machine's cache back as <= 15 MiB parts (the device returns files of <= 16 MiB, 8 at most:
# `cat tcache.tgz.part_* | tar tz` checks them; copy them into .tcache/ for the next session).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".tcache/tcache.tgz.part_*" > /dev/null; then
  cat .tcache/tcache.tgz.part_* | tar xz -C "$(dirname "$TRITON_CACHE_DIR")" \
    --transform "s|^tcache|$(basename "$TRITON_CACHE_DIR")|" || echo "device_env: .tcache unreadable" >&2
fi
pack_triton_cache() {  # pack_triton_cache OUT_DIR
  (cd "$(dirname "$TRITON_CACHE_DIR")" &&
    tar czf - --transform "s|^$(basename "$TRITON_CACHE_DIR")|tcache|" \
      "$(basename "$TRITON_CACHE_DIR")" | split -b 15m - "$1/tcache.tgz.part_")
}
