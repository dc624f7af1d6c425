"""The block-FP8 GEMM backend per weight shape and row class, as measured on the GPU: the engine's
`auto` reads `gemm_table.json` beside this file.

Row classes are the issue's: decode (1-16 rows), small verifies (17-128) and large verifies and
prefill (129 and up). For each measured [N, K] weight and class the table lists the backends
fastest first (the sum of their times over the class's measured row counts, activation
quantization included); the dispatch takes the first one that runs here (DeepGEMM needs the
optional library, cuBLAS's block scaling CUDA >= 12.9), the Triton GEMM always last. A weight
shape the table does not hold takes its family's order: `wide` (N >= K: q|k|v, gate|up, the LM
head) or `long_k` (N < K: o at 27B, down), each the backend that won most of the family's
measured shapes in the class.

`build` makes the table from `studies/gpu_fp8_gemm_libs.py`'s JSON (its --write-table):
    python3 studies/gpu_fp8_gemm_libs.py --from docs/results/<run>.json --write-table
"""

from __future__ import annotations

import functools
import json
import pathlib

PATH = pathlib.Path(__file__).with_name("gemm_table.json")
BACKENDS = ("deepgemm", "cublas", "triton")  # what the table may name (kernels/fp8 runs them)
CLASSES = (16, 128, None)  # row-class upper bounds; None: no bound
FALLBACK = ("triton",)  # the order when no table is there at all (runs everywhere)


def row_class(rows: int) -> int:
    return next(i for i, top in enumerate(CLASSES) if top is None or rows <= top)


def family(n: int, k: int) -> str:
    return "wide" if n >= k else "long_k"


@functools.lru_cache(maxsize=None)
def load(path: str = str(PATH)) -> dict:
    """The table (checked: every order a list of known backends, one per class); {} without one."""
    p = pathlib.Path(path)
    if not p.exists():
        return {}
    table = json.loads(p.read_text())
    orders = [*table["shapes"].values(), *table["families"].values()]
    for per_class in orders:
        if len(per_class) != len(CLASSES) or any(b not in BACKENDS for o in per_class for b in o):
            raise ValueError(
                f"{p}: a row of {per_class} is not {len(CLASSES)} orders of {BACKENDS}"
            )
    return table


def preference(rows: int, n: int, k: int, table: dict | None = None) -> tuple[str, ...]:
    """The backends for a [rows, k] x [n, k]^T GEMM, fastest first; the Triton GEMM among them
    (appended where the measurement did not rank it: it runs everywhere)."""
    table = load() if table is None else table
    if not table:
        return FALLBACK
    c = row_class(rows)
    per_class = table["shapes"].get(f"{n}x{k}") or table["families"][family(n, k)]
    order = tuple(per_class[c])
    return order if "triton" in order else order + ("triton",)


MAX_ERR = 3e-3  # |y - ref| / |ref| a ranked backend stays under (bf16 output rounding: ~1.7e-3)


def _ran(r: dict, b: str) -> bool:
    return f"{b}_us" in r and r.get(f"{b}_err", 1.0) <= MAX_ERR


def build(results: list[dict], measured: dict) -> dict:
    """The table from per-(shape, rows) rows holding `<backend>_us` and `<backend>_err` (its
    error against the reference). A backend ranks in a class only where it ran, within MAX_ERR,
    at every measured row count of the class."""
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        by_shape.setdefault((r["N"], r["K"]), []).append(r)
    shapes, wins = {}, {}
    for (n, k), rows in sorted(by_shape.items()):
        per_class = []
        for c in range(len(CLASSES)):
            mine = [r for r in rows if row_class(r["rows"]) == c]
            total = {
                b: sum(r[f"{b}_us"] for r in mine)
                for b in BACKENDS
                if mine and all(_ran(r, b) for r in mine)
            }
            order = sorted(total, key=total.get)
            per_class.append(order)
            votes = wins.setdefault((family(n, k), c), {})
            for i, b in enumerate(order):  # every backend that ran ranks; a win counts
                votes[b] = votes.get(b, 0) + (i == 0)
        shapes[f"{n}x{k}"] = per_class
    families = {}
    for fam in ("wide", "long_k"):
        per_class = []
        for c in range(len(CLASSES)):
            votes = wins.get((fam, c), {})
            # the most wins first, then the general order (the library, cuBLAS, Triton)
            per_class.append(sorted(votes, key=lambda b: (-votes[b], BACKENDS.index(b))))
        families[fam] = [o or list(FALLBACK) for o in per_class]
    return {"measured": measured, "classes": list(CLASSES), "shapes": shapes, "families": families}
