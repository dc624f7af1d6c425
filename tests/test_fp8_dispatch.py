"""The block-FP8 GEMM dispatch on the CPU: the measured table (kernels/fp8/table.py) built from a
study's rows and read per weight shape and row class, the first runnable backend taken, float32
kept on the Triton GEMM, and the optional library (DeepGEMM) absent: logged once, the fallback
serves, the warm-up does nothing. The device half: tests/gpu/test_fp8_lib_gpu.py. ~1 s."""

import logging
import sys

import pytest
import torch

import ddtree.kernels.fp8 as fp8
from ddtree.kernels.fp8 import deepgemm as DG
from ddtree.kernels.fp8 import table
from ddtree.models.shapes import QWEN3_8B, QWEN36_27B


def row(n, k, rows, **us):
    out = {"N": n, "K": k, "rows": rows}
    out.update({f"{b}_us": t for b, t in us.items()})
    out.update({f"{b}_err": 1.7e-3 for b in us})
    return out


RESULTS = [  # two wide shapes, one long-K; DeepGEMM wins big rows, Triton decode of wide weights
    row(6144, 4096, 1, triton=16, cublas=17, deepgemm=20),
    row(6144, 4096, 16, triton=17, cublas=17.5, deepgemm=18),
    row(6144, 4096, 64, triton=19, cublas=18, deepgemm=17),
    row(6144, 4096, 520, triton=66, cublas=40, deepgemm=30),
    row(24576, 4096, 1, triton=44, cublas=47, deepgemm=50),
    row(24576, 4096, 64, triton=47, cublas=48, deepgemm=40),
    row(24576, 4096, 1040, triton=376, cublas=228, deepgemm=160),
    row(4096, 12288, 1, triton=37, cublas=27, deepgemm=30),
    row(4096, 12288, 128, triton=52, cublas=46, deepgemm=40),
    {**row(4096, 12288, 1040, triton=290, cublas=177, deepgemm=1), "deepgemm_err": 0.5},  # wrong
]


@pytest.fixture
def built():
    return table.build(RESULTS, {"device": "test"})


def test_table_orders_backends_per_shape_and_row_class(built):
    assert built["classes"] == [16, 128, None]
    assert built["shapes"]["6144x4096"] == [
        ["triton", "cublas", "deepgemm"],  # 1 + 16 rows summed: 33 < 34.5 < 38
        ["deepgemm", "cublas", "triton"],
        ["deepgemm", "cublas", "triton"],
    ]
    # a backend off the reference at a measured row count of a class does not rank there
    assert built["shapes"]["4096x12288"][2] == ["cublas", "triton"]
    assert built["shapes"]["4096x12288"][0] == ["cublas", "deepgemm", "triton"]
    # families: the most wins in the class, then the general order
    assert built["families"]["wide"][0][0] == "triton"
    assert built["families"]["wide"][2][0] == "deepgemm"
    assert built["families"]["long_k"][2] == ["cublas", "triton"]


def test_preference_reads_the_shape_then_its_family(built):
    assert table.preference(1, 6144, 4096, built) == ("triton", "cublas", "deepgemm")
    assert table.preference(17, 6144, 4096, built)[0] == "deepgemm"
    assert table.preference(2000, 6144, 4096, built)[0] == "deepgemm"  # the last class: no bound
    assert table.preference(1, 5120, 5120, built)[0] == "triton"  # unmeasured: wide family
    assert table.preference(1000, 5120, 17408, built) == ("cublas", "triton")  # long-K family
    assert table.preference(1, 64, 64, {}) == ("triton",)  # no table: the fallback
    one = {"shapes": {"64x64": [["cublas"]] * 3}, "families": {}}
    assert table.preference(1, 64, 64, one) == ("cublas", "triton")  # Triton always among them


def test_choose_takes_the_first_backend_that_runs(built, monkeypatch):
    monkeypatch.setattr(table, "load", lambda: built)
    assert fp8.choose(520, 6144, 4096, cublas=True, deepgemm=True) == "deepgemm"
    assert fp8.choose(520, 6144, 4096, cublas=True, deepgemm=False) == "cublas"  # no library
    assert fp8.choose(520, 6144, 4096, cublas=False, deepgemm=False) == "triton"
    # float32 activations: the Triton GEMM at every row count (one summation order: spec == AR)
    assert fp8.choose(520, 6144, 4096, cublas=True, exact=True, deepgemm=True) == "triton"


def test_shipped_table_covers_the_served_shapes():
    """The table the engine reads loads, names its measurement, and holds the 8B and 27B layer
    weights as the engine fuses them."""
    t = table.load()
    assert t["measured"]["device"] and t["classes"] == [16, 128, None]
    h, i = QWEN3_8B["hidden_size"], QWEN3_8B["intermediate_size"]
    kv = QWEN3_8B["num_key_value_heads"] * QWEN3_8B["head_dim"]
    q = QWEN3_8B["num_attention_heads"] * QWEN3_8B["head_dim"]
    h27, i27 = QWEN36_27B["hidden_size"], QWEN36_27B["intermediate_size"]
    for n, k in [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i), (2 * i27, h27), (h27, i27)]:
        assert f"{n}x{k}" in t["shapes"], (n, k)
    with pytest.raises(ValueError, match="orders of"):
        bad = table.PATH.with_name("bad_table.json")
        try:
            bad.write_text('{"shapes": {"1x1": [["fast"]]}, "families": {}}')
            table.load(str(bad))
        finally:
            bad.unlink()


def test_without_the_library_the_engine_logs_once_and_falls_back(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm -> ImportError
    DG.module.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="ddtree"):
            assert DG.module() is None and DG.module() is None
        lines = [r for r in caplog.records if "DeepGEMM unavailable" in r.getMessage()]
        assert len(lines) == 1 and "ModuleNotFoundError" in lines[0].getMessage()
    finally:
        DG.module.cache_clear()
    w = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    assert not DG.takes(w, 128, 128, torch.bfloat16)  # a CPU weight: never the library
    scale = torch.ones(2, 2)
    assert fp8.warm_up(w, scale, 128, 128, torch.bfloat16, 64) == 0


def test_warm_up_covers_every_weight_shape_to_the_largest_forward(monkeypatch):
    """The engine's warm-up runs the library warm-up once per FP8 weight shape of target and
    drafter, to the most rows a forward may meet: a prefill chunk or a verify of every running
    request at the widest tree."""
    from types import SimpleNamespace

    from ddtree.engine import warmup
    from ddtree.models import quant
    from ddtree.models.quant import Fp8Linear

    calls = []
    monkeypatch.setattr(
        fp8, "warm_up", lambda w, s, gn, gk, dt, rows, st: calls.append((w.shape, rows)) or 1
    )

    def model(*shapes):
        m = torch.nn.Sequential(
            *[Fp8Linear(k, n, False, (128, 128), 128, torch.bfloat16) for n, k in shapes]
        )
        return m

    target = model((256, 128), (256, 128), (128, 256))  # two layers share a shape: one warm-up
    drafter = model((384, 128))
    cfg = SimpleNamespace(max_running_requests=8, max_verify_width=65)
    engine = SimpleNamespace(
        runner=SimpleNamespace(target=target, drafter=drafter, cfg=cfg, dtype=torch.bfloat16),
        scheduler=SimpleNamespace(prefill_budget=256),
    )
    assert warmup._fp8_library(engine) == 3
    assert calls == [((256, 128), 520), ((128, 256), 520), ((384, 128), 520)]  # 8 x 65 > 256
    engine.scheduler.prefill_budget = 4096
    calls.clear()
    assert quant.warm_up(target, torch.bfloat16, 4096) == 2 and calls[0][1] == 4096


def test_warm_up_rows_split_between_processes_cover_the_range_once(monkeypatch):
    """studies/fp8_served.py warms the library's cache from several processes, each a slice of the
    rows (min_rows..max_rows): the slices run every row count the whole range does, once."""
    seen = []
    monkeypatch.setattr(DG, "takes", lambda *a: True)
    monkeypatch.setattr(fp8, "use_kernels", lambda w: True)
    monkeypatch.setattr(fp8, "choose", lambda m, *a, **k: "deepgemm" if m % 3 else "triton")
    monkeypatch.setattr(fp8, "linear", lambda x, *a, **k: seen.append(x.shape[0]))
    w, s = torch.zeros(256, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 1)
    whole = fp8.warm_up(w, s, 128, 128, torch.bfloat16, 40)
    full, seen[:] = list(seen), []
    parts = [
        fp8.warm_up(w, s, 128, 128, torch.bfloat16, hi, min_rows=lo)
        for lo, hi in ((1, 9), (10, 40))
    ]
    assert sum(parts) == whole == len(full) and seen == full == [m for m in range(1, 41) if m % 3]
