#!/usr/bin/env python3
"""H200 check of CUDA graphs for the target verify and the drafter block: one run, < 2.5 minutes, a short table.

    python3 studies/gpu_cuda_graphs.py            # from the repo root; [--only default,toy] [--budget-s 125]

Pairs: the embedded default pair (ddtree/assets/default_pair) and the toy pair (ddtree/tools/train/toy.py, trained on
the CPU in a subprocess while the default pair runs; cached under $DDTREE_CACHE or ~/.cache/ddtree). For each
pair, dtype (bf16, fp32) and algorithm (NONE, DFLASH, DDTREE B=16, DDTREE B=64) one engine is built with
--attention-backend triton and graphs on (captured up to batch 8), then batch 1 and batch 5 (ragged prompts,
greedy, 48 tokens) run twice on it: graphs on, and with the runner's graphs detached (eager). Printed:
  - ms per round (median over the rounds that ran the full batch), eager vs graphs;
  - for reading, the requests whose tokens differ (bf16 rounding can flip a near-tie) and the replays
    (verify / draft / in-graph accept walk).
Timing only: the pass / fail of graphs vs eager (fp32 token-identical, the graph path really replayed) is
tests/gpu/test_cuda_graphs_gpu.py and, for hybrid targets, tests/gpu/test_hybrid_graphs_gpu.py
(python3 -m pytest -m gpu tests/gpu). Exit code 1 only if a config crashed.
"""

import argparse
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ddtree import LLM, SamplingParams, envs  # noqa: E402
from ddtree.assets import PACKAGE_PAIR  # noqa: E402

ALGOS = [("NONE", None), ("DFLASH", None), ("DDTREE", 16), ("DDTREE", 64)]
BATCHES = (1, 5)
MAX_TOKENS = 48
T0 = time.time()


def toy_subprocess(out: str) -> subprocess.Popen:
    code = f"from ddtree.tools.train.toy import build_toy_pair; build_toy_pair({out!r})"
    # CPU only: never touches the GPU while graphs capture
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


def prompts_for(pair_name: str, llm, n: int) -> list[list[int]]:
    """Ragged prompts: held-out stdlib source for the default pair (trained on stdlib code), the synthetic
    corpus for the toy pair."""
    lengths = [17, 40, 9, 63, 28][:n]
    if pair_name == "toy":
        from ddtree.tools.train.data import synthetic_sequences

        seqs = synthetic_sequences(n, 64, 64, seed=7)
        return [seqs[i][:k].tolist() for i, k in enumerate(lengths)]
    import json.decoder
    import statistics as st
    import textwrap

    srcs = [inspect.getsource(m) for m in (textwrap, json.decoder, st, argparse, textwrap)]
    return [
        llm.tokenizer.encode(s[200 * i :], add_special_tokens=False)[:k]
        for i, (s, k) in enumerate(zip(srcs, lengths))
    ]


class Probe:
    """Per-round wall time (the round ends in its one device->host copy) and graph replay counts."""

    def __init__(self, llm):
        self.rounds, self.replays = [], {"verify": 0, "draft": 0, "accept": 0}
        dec, runner = llm.engine.decoder, llm.engine.runner
        round_fn = dec.round

        def timed(reqs, max_context):
            t = time.perf_counter()
            out = round_fn(reqs, max_context)
            self.rounds.append((len(reqs), time.perf_counter() - t))
            return out

        dec.round = timed
        g = runner.graphs
        for name, key in (("verify", "verify"), ("draft_tree", "draft")):
            fn = getattr(g, name)

            def counted(*a, _fn=fn, _key=key):
                self.replays[_key] += 1
                out = _fn(*a)
                # the greedy accept walk ran inside the verify graph
                if _key == "verify" and out[3] is not None:
                    self.replays["accept"] += 1
                return out

            setattr(g, name, counted)


def generate(llm, probe, prompts, graphs):
    runner = llm.engine.runner
    saved = runner.graphs
    runner.graphs = saved if graphs else None
    probe.rounds.clear()
    probe.replays.update(verify=0, draft=0, accept=0)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outs = llm.generate(prompts, params)
    finally:
        runner.graphs = saved
    full = [t for b, t in probe.rounds if b == len(prompts)]
    ms = 1e3 * statistics.median(full) if full else float("nan")
    acc = [n for o in outs for n in o.accept_lengths]
    return [o.token_ids for o in outs], ms, dict(probe.replays), sum(acc) / max(len(acc), 1)


def run_config(pair_name, target, drafter, dtype, algo, budget, rows, failures):
    kw = dict(
        dtype=dtype,
        device="cuda",
        attention_backend="triton",
        cuda_graph_max_bs=8,
        max_running_requests=8,
        context_length=2048,
        max_total_tokens=8 * (2048 + 80),
        speculative_algorithm=algo,
    )
    if algo != "NONE":
        kw["speculative_draft_model_path"] = drafter
    if budget:
        kw["speculative_ddtree_budget"] = budget
    t = time.time()
    llm = LLM(target, **kw)
    runner = llm.engine.runner
    if runner.graphs is None:
        raise RuntimeError("graphs were not enabled (see the log)")
    build_s = time.time() - t
    probe = Probe(llm)
    name = algo if budget is None else f"{algo} B={budget}"
    for b in BATCHES:
        prompts = prompts_for(pair_name, llm, b)
        for graphs in (False, True):  # warm-up: eager split variants compile on first use
            generate(llm, probe, prompts[:b], graphs)
        eager, ms_e, _, acc = generate(llm, probe, prompts, False)
        graph, ms_g, replays, _ = generate(llm, probe, prompts, True)
        # for reading only: the pass / fail of both is tests/gpu/test_cuda_graphs_gpu.py
        bad = sum(x != y for x, y in zip(eager, graph))
        notes = []
        if bad:
            first = next(i for i, (x, y) in enumerate(zip(eager, graph)) if x != y)
            pos = next(
                (j for j, (u, v) in enumerate(zip(eager[first], graph[first])) if u != v), None
            )
            notes.append(f"req {first} diverges at token {pos}")
        if replays["verify"] == 0:
            notes.append("NO REPLAY")
        rows.append(
            (
                pair_name,
                dtype,
                name,
                b,
                f"{acc:.2f}",
                f"{ms_e:.2f}",
                f"{ms_g:.2f}",
                f"{ms_e / ms_g:.2f}x",
                f"{bad}/{b}",
                f"{replays['verify']}/{replays['draft']}/{replays['accept']}",
                f"{build_s:.1f}",
                " ".join(notes),
            )
        )
    del llm, runner, probe
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
    )
    ap.add_argument("--only", default="default,toy", help="pairs to run: default,toy")
    ap.add_argument(
        "--budget-s", type=float, default=125, help="skip remaining configs after this many seconds"
    )
    ns = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    pairs = [p for p in ns.only.split(",") if p]
    toy_dir = os.path.join(envs.CACHE.get() or tempfile.mkdtemp(prefix="ddtree-"), "toy_pair")
    toy_proc = toy_subprocess(toy_dir) if "toy" in pairs else None
    rows, failures, skipped = [], [], []
    for pair_name in pairs:
        if pair_name == "default":
            target, drafter = (
                os.path.join(PACKAGE_PAIR, "target"),
                os.path.join(PACKAGE_PAIR, "drafter"),
            )
        else:
            t = time.time()
            if toy_proc.wait() != 0:
                failures.append("toy pair build failed")
                continue
            print(f"toy pair ready (waited {time.time() - t:.1f}s)", flush=True)
            target, drafter = os.path.join(toy_dir, "target"), os.path.join(toy_dir, "drafter")
        for dtype in ("float32", "bfloat16"):
            for algo, budget in ALGOS:
                if time.time() - T0 > ns.budget_s:
                    skipped.append(f"{pair_name} {dtype} {algo}{'' if budget is None else budget}")
                    continue
                try:
                    run_config(pair_name, target, drafter, dtype, algo, budget, rows, failures)
                except Exception:  # noqa: BLE001 - report and go on with the other configs
                    failures.append(f"{pair_name} {dtype} {algo} {budget}: crashed")
                    traceback.print_exc()
                print(
                    f"[{time.time() - T0:5.0f}s] {pair_name} {dtype} {algo} {budget or ''} done",
                    flush=True,
                )
    head = (
        "pair",
        "dtype",
        "algo",
        "batch",
        "accept",
        "eager ms/rd",
        "graph ms/rd",
        "speedup",
        "mismatch",
        "replays v/d/acc",
        "build s",
        "notes",
    )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    if skipped:
        print(f"skipped (over --budget-s {ns.budget_s:.0f}): {', '.join(skipped)}")
    print(
        f"total {time.time() - T0:.0f}s on {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
