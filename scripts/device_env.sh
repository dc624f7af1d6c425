# Sourced by the scripts/h200_*.sh runs, from the repository root: the device image lacks fastapi /
# uvicorn / pydantic / openai / fla-core, so the wheels carried in `.whl` go to /tmp/site (no
# index, no deps); PYTHONPATH then puts them and this checkout first.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
