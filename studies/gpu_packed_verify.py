"""Issue 57: what a packed (ragged) verify costs against the dense [b, W] verify, at high batch.

The target forward + logits + greedy tokens of one verify, each captured in a CUDA graph and
replayed (median of REPLAYS), on a random-weight target of a named shape (bf16, Triton attention,
every request at CONTEXT cached tokens): AR (one row a request), dense trees of width W (b * W
rows, what `auto` runs today), and packed batch-wide budgets of R = b * k drafted nodes (b + R
rows, ragged q_lens from speculative/batch_budget.py on random best-first trees). Also checks,
once per batch, that the packed rows' logits equal the dense verify's at the kept nodes.

    python3 studies/gpu_packed_verify.py [--shape QWEN3_8B] [--batches 64,128,256] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ddtree.attention.backend import AttentionMetadata
from ddtree.bench import random_pair
from ddtree.engine.model_runner import ModelRunner, RunnerConfig
from ddtree.engine.scheduling.request import Req, SamplingParams
from ddtree.speculative.batch_budget import allocate, pack
from ddtree.speculative.tree import build_tree

REPLAYS = 10
CONTEXT = 1024
DEPTHS = 15
WMAX = 65


def graphed_ms(fn) -> float:
    """Median ms of fn() replayed as a CUDA graph (captured after two warm-up calls); on the CPU
    (a dry run of this script) timed eagerly."""
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(REPLAYS + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times[2:])


def check(runner, meta, full, lay, m) -> None:
    """The packed rows' logits against the dense verify's at the kept nodes (the same KV)."""
    b = full.batch_size
    tree_m = runner.verify_metadata(meta, full.tree_mask, WMAX)
    with torch.inference_mode():
        hd, _ = runner.target_forward(
            full.tokens.flatten(), full.positions(meta.lens).flatten(), tree_m
        )
        ld = runner.target.logits(hd).float().view(b, WMAX, -1)
        hp, _ = runner.target_forward(lay.input_ids, lay.positions, m)
        lp = runner.target.logits(hp).float()
    kept = lay.local_node.clamp(min=0)
    want = ld.gather(1, kept[..., None].expand(-1, -1, ld.shape[-1]))
    ok = lay.local_row >= 0
    got = lp.index_select(0, lay.local_row.clamp(min=0).flatten()).view_as(want)
    err = (got - want).abs()[ok].max().item()
    same = (got.argmax(-1) == want.argmax(-1))[ok].float().mean().item()
    print(
        f"b={b}: packed vs dense logits at kept nodes: max abs {err:.3g}, argmax same {same:.4f}",
        flush=True,
    )
    del ld, lp, want, got, hd, hp


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--shape", default="QWEN3_8B")
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--out", default=None)
    p.add_argument("--context", type=int, default=CONTEXT)
    ns = p.parse_args()
    batches = [int(x) for x in ns.batches.split(",")]
    ctx = ns.context
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tcfg, dcfg = random_pair.pair_configs(getattr(random_pair, ns.shape), 1, 16, "bfloat16")
    target, _ = random_pair.build_pair(tcfg, dcfg, dev, torch.bfloat16)
    top, page = max(batches), 16
    per = (ctx + WMAX) // page + 2
    cfg = RunnerConfig(
        page_size=page,
        num_pages=top * per + 8,
        max_running_requests=top,
        max_context=ctx + WMAX + page,
        block_size=DEPTHS + 1,
        max_verify_width=WMAX,
        attention_backend="triton" if dev.type == "cuda" else "torch",
    )
    runner = ModelRunner(target, None, cfg, dev, torch.bfloat16)
    params = SamplingParams(temperature=0, ignore_eos=True)
    rows_out = []
    for b in batches:
        reqs = [Req(prompt_ids=[1] * ctx, params=params, output_ids=[2]) for _ in range(b)]
        for r in reqs:
            runner.bm.allocate(r, ctx + WMAX)
            r.kv_len = ctx
        meta = runner.begin(reqs)
        gen = torch.Generator(device=dev).manual_seed(b)
        vocab = min(4096, tcfg.vocab_size)
        logits = torch.randn(b, DEPTHS, vocab, device=dev, generator=gen) * 3
        roots = torch.randint(0, vocab, (b,), device=dev, generator=gen)
        full = build_tree(roots, logits, WMAX - 1, 8, False, node_scores=True)

        def verify(ids, pos, m):
            def fn():
                with torch.inference_mode():
                    hidden, _ = runner.target_forward(ids, pos, m)
                    return runner.target.logits(hidden).argmax(-1)

            return fn

        def dense(w: int):
            tree = build_tree(roots, logits, w - 1, 8, False) if w > 1 else full.narrow(1)
            m = runner.verify_metadata(meta, tree.tree_mask, w)
            return verify(tree.tokens.flatten(), tree.positions(meta.lens).flatten(), m)

        def packed(total: int):
            alloc = allocate(full, torch.full((b,), WMAX - 1, device=dev), total)
            lay = pack(full, alloc.keep, meta.lens, b + total)
            q = lay.q_lens.tolist()
            slots = runner.slots_of(
                meta.rows.index_select(0, lay.flat_req.clamp(min=0)), lay.kv_positions[:, None]
            )
            m = AttentionMetadata(
                q_lens=q,
                kv_lens=[k + x for k, x in zip(meta.kv_lens, q)],
                qo_indptr=lay.qo_indptr,
                kv_lens_t=meta.lens + lay.q_lens,
                block_table=meta.rows,
                slot_mapping=slots.flatten(),
                page_size=page,
                tree_mask=lay.tree.tree_mask,
            )
            return alloc, lay, m, verify(lay.input_ids, lay.positions, m)

        if b == batches[0]:
            check(runner, meta, full, *packed(b * 4)[1:3])

        for w in (1, 5, 9, 17, 33, 65):
            if b * w > 8192:
                continue
            ms = graphed_ms(dense(w))
            rows_out.append(
                dict(batch=b, kind="dense" if w > 1 else "ar", width=w, rows=b * w, ms=ms)
            )
            print(
                f"b={b} {'dense' if w > 1 else 'AR':>6} W={w:>2}: {b * w:>6} rows {ms:7.2f} ms",
                flush=True,
            )
        for k in (1, 2, 4, 8, 16):
            alloc, lay, m, fn = packed(b * k)
            ms = graphed_ms(fn)
            q = lay.q_lens.float()
            rows_out.append(
                dict(batch=b, kind="packed", per_req=k, rows=b * (k + 1), ms=ms,
                     max_q=int(q.max()), q_sd=float(q.std()))
            )  # fmt: skip
            print(
                f"b={b} packed R={b * k:>5} ({k:>2}/req, max q {int(q.max()):>2}, sd {float(q.std()):4.1f}):"
                f" {b * (k + 1):>6} rows {ms:7.2f} ms",
                flush=True,
            )
        for r in reqs:
            runner.release(r)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(
                {
                    "shape": ns.shape,
                    "context": ctx,
                    "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                    "rows": rows_out,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
