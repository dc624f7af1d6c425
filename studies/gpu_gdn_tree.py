#!/usr/bin/env python3
"""H200 timing of the GPU path of hybrid (Gated DeltaNet) targets: one run, < 3 minutes, a short table.

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 studies/gpu_gdn_tree.py [--only b,d]   # $OUT/gpu_gdn_tree.json when $OUT is set

Qwen3.6-27B-shaped GDN layer (config: Hk=16, Hv=48, dk=dv=128, conv kernel 4; 48 of its 64 layers are GDN).
(b) tree verify at B=64 (65 nodes), batch 1 and 8: kernel (CUDA graph, tile sweep) vs reference (eager), and
    the chunk-form tree rule (tree_chunk: no per-node states; the no_buffer verify) eager and CUDA graph, alone
    and with the post-state of one node; rel err vs the reference (outputs, that node's state), for reading.
(c) commit through HybridStatePool.commit on 48 layers: copy one node's state (extra_buffer) vs replay of the
    accepted path (no_buffer), accept lengths 1/4/8/16, batch 1 and 8; per layer = total / 48. Then the
    no_buffer commit's rule part alone on the 48 layers' accepted chains: fla replay vs the chunk-form path
    state, and the full verify + commit per layer for both strategies (with (b)'s verify times).
(d) fla chunk (prefill: varlen, initial states) and fused recurrent (decode, continuing from the chunk's final
    state) vs the reference: rel err and time.
(e) the no_buffer verify's Triton kernel (tree_chunk_triton: the solve, then the outputs) vs the
    PyTorch chunk form vs the extra_buffer recurrence, B=64,
    batch 1 / 8, bushy tree, chain and flat (depth 1): CUDA graph us per layer, launch options
    swept, rel err vs the reference (`--only e`: about two minutes).
Timing only: the pass / fail checks are tests/gpu (python3 -m pytest -m gpu tests/gpu): test_gdn_gpu.py for
(a)-(d), test_hybrid_graphs_gpu.py for the former (e) (the toy hybrid pair end to end, graphs vs eager and
vs AR). The exit code is 1 only if a section crashed or was skipped.
"""

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ddtree import envs  # noqa: E402
from ddtree.bench.cuda_timing import time_graph  # noqa: E402
from ddtree.kernels.gdn import backend, reference  # noqa: E402
from ddtree.kernels.gdn.tree_chunk import tree_chunk_gated_delta_rule  # noqa: E402
from ddtree.kernels.gdn.triton_tree import tree_gated_delta_rule_triton  # noqa: E402

HK, HV, DK, DV, KCONV, GDN_LAYERS = 16, 48, 128, 128, 4, 48
DEV = torch.device("cuda")
RESULT: dict = {}
FAILED: list[str] = []


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def row(*cols):
    print("  " + " | ".join(str(c) for c in cols), flush=True)


def time_eager(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def us(fn, graph=True):
    """Median microseconds from a CUDA graph; eager (with launch overhead, marked *) if capture fails."""
    if graph:
        try:
            return f"{time_graph(fn, reps=20) * 1e6:9.1f}"
        except Exception:  # noqa: BLE001 - not capturable (host sync) -> eager
            torch.cuda.synchronize()
    return f"{time_eager(fn) * 1e6:8.1f}*"


def tree(b, n, kind, gen):
    """Depth-sorted parents (node i's parent < i): chain, bushy (parent among the previous level, few levels),
    flat (all children of the root) or random; returns parents, depths on the device."""
    parents = torch.full((b, n), -1, dtype=torch.int64)
    for r in range(b):
        for c in range(1, n):
            if kind == "chain":
                p = c - 1
            elif kind == "flat":  # every node a child of the root (rounds = 0)
                p = 0
            elif kind == "bushy":  # ~sqrt(n) levels of fan-out
                p = max(0, c - 1 - int(torch.randint(0, 9, (1,), generator=gen)))
            else:
                p = int(torch.randint(0, c, (1,), generator=gen))
            parents[r, c] = p
    depths = torch.zeros(b, n, dtype=torch.int64)
    for c in range(1, n):
        depths[:, c] = depths.gather(1, parents[:, c : c + 1])[:, 0] + 1
    return parents.to(DEV), depths.to(DEV)


def rule_inputs(b, n, dtype, gen):
    q, k = (torch.randn(b, n, HK, DK, generator=gen).to(DEV, dtype) for _ in range(2))
    v = torch.randn(b, n, HV, DV, generator=gen).to(DEV, dtype)
    g = (-torch.rand(b, n, HV, generator=gen) * 2).to(DEV)
    beta = torch.rand(b, n, HV, generator=gen).to(DEV, dtype)
    s0 = (torch.randn(b, HV, DK, DV, generator=gen) * 0.1).to(DEV)
    return q, k, v, g, beta, s0


def section_b(gen):
    print(
        "(b) tree verify, B=64 (65 nodes), one GDN layer: us (kernel: CUDA graph; reference: eager)",
        flush=True,
    )
    out = []
    for b in (1, 8):
        parents, depths = tree(b, 65, "bushy", gen)
        q, k, v, g, beta, s0 = rule_inputs(b, 65, torch.bfloat16, gen)
        bufs = {
            "fp32": torch.empty(b, 65, HV, DK, DV, device=DEV),
            "bf16": torch.empty(b, 65, HV, DK, DV, device=DEV, dtype=torch.bfloat16),
        }
        best, rec_sweep = None, []
        # (block_v, warps): auto = the default; warps 1 keeps the dk reductions inside one warp,
        # small tiles give more programs per head (the walk is latency-bound)
        sweep = (
            (None, 4),
            (4, 1),
            (8, 1),
            (8, 2),
            (16, 1),
            (16, 2),
            (16, 4),
            (32, 1),
            (32, 4),
            (32, 8),
            (64, 8),
        )
        # bf16: a bf16 node-state buffer (children re-read rounded parents)
        variants = [(c, "fp32") for c in sweep] + [(c, "bf16") for c in sweep[:6]]
        for (bv, nw), sd in variants:
            buf = bufs[sd]

            def fn(bv=bv, nw=nw, buf=buf):
                tree_gated_delta_rule_triton(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    parents,
                    depths,
                    s0,
                    node_states=buf,
                    block_v=bv,
                    num_warps=nw,
                )

            try:
                t = time_graph(fn, reps=20) * 1e6
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                row(f"b={b}", f"block_v={bv}", f"warps={nw}", f"failed: {type(e).__name__}")
                continue
            best = min(best or t, t)
            row(
                f"b={b}",
                f"block_v={bv or 'auto'}",
                f"warps={nw}",
                f"stash={sd}",
                f"{t:8.1f} us",
                f"node-state write {buf.numel() * buf.element_size() / t / 1e6:.2f} TB/s",
            )
            rec_sweep.append(dict(bv=bv, warps=nw, stash=sd, us=t))
        ref = (
            time_eager(
                lambda: reference.tree_gated_delta_rule(
                    q, k, v, g, beta, parents, depths, s0, return_node_states=True, max_depth=64
                )
            )
            * 1e6
        )
        row(
            f"b={b}",
            "reference",
            f"{ref:8.1f} us",
            f"kernel best {best:.1f} us" if best else "kernel: none ran",
        )
        # errors on fp32 outputs (bf16 rounding would hide them)
        f32 = [t.float() for t in (q, k, v, g, beta)]
        ro, rst = reference.tree_gated_delta_rule(
            *f32, parents, depths, s0, return_node_states=True
        )
        last = torch.randint(0, 65, (b,), generator=gen).to(DEV)
        rec = {"b": b, "kernel_best_us": best, "reference_us": ref, "sweep": rec_sweep}
        for with_state in (False, True):

            def chunk(with_state=with_state):
                return tree_chunk_gated_delta_rule(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    parents,
                    depths,
                    s0,
                    max_depth=64,
                    last=last if with_state else None,
                )

            o, st = tree_chunk_gated_delta_rule(
                *f32, parents, depths, s0, last=last if with_state else None
            )
            eo = rel(o, ro)
            es = rel(st, rst[torch.arange(b, device=DEV), last]) if with_state else 0.0
            eager = time_eager(chunk, reps=20) * 1e6
            try:
                graph = time_graph(chunk, reps=20) * 1e6
            except Exception as e:  # noqa: BLE001 - not capturable: reported, eager stands
                graph = None
                row(
                    f"b={b}",
                    "tree_chunk",
                    f"CUDA graph capture failed: {type(e).__name__}: {e}"[:160],
                )
            name = "tree_chunk+state" if with_state else "tree_chunk"
            row(
                f"b={b}",
                f"{name:16s}",
                f"eager {eager:8.1f} us",
                f"graph {graph:8.1f} us" if graph else "graph -",
                f"rel err out {eo:.1e}" + (f" state {es:.1e}" if with_state else ""),
            )
            rec[f"{name}_eager_us"], rec[f"{name}_graph_us"] = eager, graph
            rec[f"{name}_err"] = (eo, es)
        out.append(rec)
    RESULT["b"] = out


def section_e(gen):
    """The no_buffer verify's Triton kernel vs the PyTorch chunk form vs the extra_buffer recurrence
    (which also writes every node's fp32 state), one layer, B=64, CUDA graphs; the kernel's launch
    options swept (tile columns, dk chunk, warps, dot precision)."""
    from ddtree.kernels.gdn.tree_chunk_triton import tree_chunk_triton
    from ddtree.speculative.tree import DraftTree

    print(
        "(e) no_buffer tree verify, B=64 (65 nodes), one GDN layer, CUDA graph us: the chunk kernel"
        " vs the PyTorch chunk form vs the extra_buffer recurrence",
        flush=True,
    )
    out = []
    for b in (1, 8):
        for kind in ("bushy", "chain", "flat"):
            parents, depths = tree(b, 65, kind, gen)
            q, k, v, g, beta, s0 = rule_inputs(b, 65, torch.bfloat16, gen)
            mask = DraftTree.from_parents(torch.zeros_like(parents), parents).tree_mask
            f32 = [t.float() for t in (q, k, v, g, beta)]
            ro, _ = reference.tree_gated_delta_rule(*f32, parents, depths, s0)
            states = torch.empty(b, 65, HV, DK, DV, device=DEV)
            rec = {"b": b, "tree": kind, "sweep": []}
            rec["recurrence_us"] = float(
                us(
                    lambda: tree_gated_delta_rule_triton(
                        q, k, v, g, beta, parents, depths, s0, node_states=states
                    )
                ).rstrip("*")
            )
            rec["torch_chunk_us"] = float(
                us(
                    lambda: tree_chunk_gated_delta_rule(
                        q, k, v, g, beta, parents, depths, s0, max_depth=64, mask=mask
                    )
                ).rstrip("*")
            )
            row(
                f"b={b} {kind}",
                f"recurrence {rec['recurrence_us']:8.1f}",
                f"torch chunk {rec['torch_chunk_us']:8.1f}",
            )
            # the default first, then launch options (studies/gdn_tree_chunk_compile_report.py
            # --variants: which of them spill)
            sweep = [(None, None, None, "auto"), (16, 32, 4, "auto"), (64, 32, 8, "auto")]
            sweep += [(32, 32, 8, "auto"), (32, 32, 4, "tf32x3")]
            if kind == "flat":  # the random-weight pairs' trees: the default only
                sweep = sweep[:1]
            for bv, bk, nw, prec in sweep:
                kw = dict(block_v=bv, block_k=bk, num_warps=nw, precision=prec)

                def fn(kw=kw):
                    return tree_chunk_triton(q, k, v, g, beta, depths, s0, mask, **kw)

                try:
                    err = rel(fn(), ro)
                    t = time_graph(fn, reps=20) * 1e6
                except Exception as e:  # noqa: BLE001 - an option that does not compile is skipped
                    row(f"b={b} {kind}", str(kw), f"failed: {type(e).__name__}: {e}"[:160])
                    continue
                row(f"b={b} {kind}", f"{kw}", f"{t:8.1f} us", f"rel err {err:.1e}")
                rec["sweep"].append(dict(kw, us=t, err=err))
            if rec["sweep"]:
                best = min(rec["sweep"], key=lambda r: r["us"])
                rec["kernel_default_us"] = rec["sweep"][0]["us"]
                row(
                    f"b={b} {kind}",
                    f"kernel default {rec['kernel_default_us']:.1f} us, best {best['us']:.1f} us "
                    f"({best})",
                    f"x48 layers: {48 * rec['kernel_default_us'] / 1e3:.2f} ms vs torch chunk "
                    f"{48 * rec['torch_chunk_us'] / 1e3:.2f} ms vs recurrence "
                    f"{48 * rec['recurrence_us'] / 1e3:.2f} ms",
                )
            out.append(rec)
    RESULT["e"] = out


def section_c(gen):
    from ddtree.engine.memory.state_pool import GDNGeometry, HybridStatePool

    print(f"(c) commit on {GDN_LAYERS} GDN layers: us total (per layer)", flush=True)
    geo = GDNGeometry(GDN_LAYERS, HK, DK, HV, DV, KCONV)
    out = []
    for b in (1, 8):
        slots = torch.arange(b, device=DEV) + 1
        for strategy in ("extra_buffer", "no_buffer"):
            pool = HybridStatePool(geo, b + 1, 17, DEV, strategy, "float32", torch.bfloat16)
            for (
                name,
                t,
                # replay inputs finite and non-trivial (g <= 0); copies move zeros
            ) in pool.stash.items():
                if strategy == "no_buffer":
                    t.copy_(
                        torch.rand(t.shape, device=DEV, dtype=t.dtype)
                        * (-1 if name == "node_g" else 1)
                    )
            for acc in (1, 4, 8, 16):
                path = torch.arange(17, device=DEV).repeat(b, 1)
                accept = torch.full((b,), acc, device=DEV)
                t = us(lambda path=path, accept=accept, pool=pool: pool.commit(slots, path, accept))
                per = float(t.rstrip("*")) / GDN_LAYERS
                row(
                    f"b={b}",
                    f"{strategy:12s}",
                    f"accept {acc:2d}",
                    f"{t} us",
                    f"({per:6.2f} us/layer)",
                )
                out.append({"b": b, "strategy": strategy, "accept": acc, "us": t})
            del pool
            torch.cuda.empty_cache()
    print(f"  replay backend: {backend.describe(DEV)['replay']}", flush=True)
    RESULT["c"] = out
    section_c_rule(gen)


def section_c_rule(gen):
    """The no_buffer commit's rule part on L x b accepted chains (what HybridStatePool._replay hands the
    dispatch): fla fused-recurrent replay vs the chunk-form state of the chain's last node."""
    from ddtree.kernels.gdn import dispatch

    print(
        f"(c') no_buffer commit rule on {GDN_LAYERS} layers' accepted chains: us total (per layer)",
        flush=True,
    )
    rule = {}
    for b in (1, 8):
        N, P = GDN_LAYERS * b, 17
        torch.manual_seed(b)  # on the device: 384 states do not come from a CPU generator in time
        q, k = (torch.randn(N, P, HK, DK, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(N, P, HV, DV, device=DEV, dtype=torch.bfloat16)
        g = -torch.rand(N, P, HV, device=DEV) * 2
        beta = torch.rand(N, P, HV, device=DEV, dtype=torch.bfloat16)
        s0 = torch.randn(N, HV, DK, DV, device=DEV) * 0.1
        for acc in (1, 8, 16):
            step = torch.arange(P, device=DEV)
            path = torch.where(step <= acc, step, -1).repeat(N, 1)
            par = torch.where(path > 0, step - 1, -1)
            dep = torch.where(path >= 0, step, -1)
            last = torch.full((N,), acc, device=DEV)
            want = reference.replay_path(q, k, v, g, beta, path, s0)

            def by_replay():  # fla's fused recurrent where installed
                ins = reference.path_inputs(q, k, v, g, beta, path)
                return dispatch.recurrent_rule(*ins, s0, op="replay")[1]

            def by_formula():
                return tree_chunk_gated_delta_rule(
                    q, k, v, g, beta, par, dep, s0, max_depth=16, last=last
                )[1]

            e_rep, e_form = rel(by_replay(), want), rel(by_formula(), want)
            t_rep, t_form = us(by_replay), us(by_formula)
            per = [float(t.rstrip("*")) / GDN_LAYERS for t in (t_rep, t_form)]
            row(
                f"b={b}",
                f"accept {acc:2d}",
                f"replay {t_rep} us ({per[0]:.2f}/layer, err {e_rep:.1e})",
                f"chunk path state {t_form} us ({per[1]:.2f}/layer, err {e_form:.1e})",
            )
            rule[(b, acc)] = per
        del q, k, v, g, beta, s0
    RESULT["c_rule"] = {f"b={b},acc={a}": p for (b, a), p in rule.items()}
    verify = {r["b"]: r for r in RESULT.get("b", [])}
    commit = {
        (r["b"], r["strategy"], r["accept"]): float(r["us"].rstrip("*")) / GDN_LAYERS
        for r in RESULT["c"]
    }
    if not verify:
        print("  (run section b too for the verify + commit totals)", flush=True)
        return
    print(
        "  verify + commit per GDN layer, accept 8 (verify: CUDA graph; commit: HybridStatePool.commit / 48)"
    )
    for b in (1, 8):
        vb = verify.get(b)
        if not vb:
            continue
        chunk_v = vb.get("tree_chunk_graph_us") or vb.get("tree_chunk_eager_us")
        ex = (vb["kernel_best_us"] or float("nan")) + commit[(b, "extra_buffer", 8)]
        nb = chunk_v + commit[(b, "no_buffer", 8)]
        row(
            f"b={b}",
            f"extra_buffer (triton + copy) {ex:8.1f} us",
            f"no_buffer (tree_chunk + replay) {nb:8.1f} us",
            f"x{GDN_LAYERS} layers: {ex * GDN_LAYERS / 1e3:.2f} ms vs {nb * GDN_LAYERS / 1e3:.2f} ms",
        )


def section_d(gen):
    from ddtree.kernels.gdn import dispatch

    print(f"(d) fla vs reference (backends: {backend.describe(DEV)})", flush=True)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        key = str(dtype).split(".")[1]
        lens = [1000, 37, 3059]
        T = sum(lens)
        q, k, v, g, beta, _ = rule_inputs(1, T, dtype, gen)
        s0 = (torch.randn(len(lens), HV, DK, DV, generator=gen) * 0.1).to(DEV)
        cu = torch.tensor([0, *lens], device=DEV).cumsum(0)
        o, S = dispatch.chunk_rule(q, k, v, g, beta, s0, cu_seqlens=cu)
        ro, rS = reference.gated_delta_rule_chunked(q, k, v, g, beta, s0, cu_seqlens=cu)
        # decode continues from the chunk state
        nq, nk, nv, ng, nb, _ = rule_inputs(len(lens), 1, dtype, gen)
        od, Sd = dispatch.recurrent_rule(nq, nk, nv, ng, nb, S)
        rod, rSd = reference.gated_delta_rule_recurrent(nq, nk, nv, ng, nb, rS)
        errs = {
            "prefill_out": rel(o, ro),
            "prefill_state": rel(S, rS),
            "decode_out": rel(od, rod),
            "decode_state": rel(Sd, rSd),
        }
        out[key] = errs
        row(f"{key:8s} varlen {lens}", *(f"{n} {e:.1e}" for n, e in errs.items()))
    q, k, v, g, beta, _ = rule_inputs(1, 4096, torch.bfloat16, gen)
    row(
        "prefill 4096 tok bf16",
        f"dispatch {us(lambda: dispatch.chunk_rule(q, k, v, g, beta), False)} us",
        f"reference {us(lambda: reference.gated_delta_rule_chunked(q, k, v, g, beta), False)} us",
    )
    for b in (1, 8):
        q, k, v, g, beta, s0 = rule_inputs(b, 1, torch.bfloat16, gen)
        row(
            f"decode b={b} bf16",
            f"dispatch {us(lambda: dispatch.recurrent_rule(q, k, v, g, beta, s0))} us",
            f"reference {us(lambda: reference.gated_delta_rule_recurrent(q, k, v, g, beta, s0))} us",
        )
    RESULT["d"] = out


def main():
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
    )
    ap.add_argument("--only", default="b,c,e,d", help="sections to run, e.g. b,d")
    ap.add_argument(
        "--deadline-s", type=float, default=170, help="skip the sections not started by then"
    )
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    err = backend.fla_error()
    if err:
        print(
            f"fla MISSING ({err}): prefill/decode/replay run the PyTorch reference on the GPU",
            flush=True,
        )
    else:
        import fla

        print(f"fla {fla.__version__} from {os.path.dirname(fla.__file__)}", flush=True)
    print(
        torch.cuda.get_device_name(),
        f"torch {torch.__version__}",
        f"backends {backend.describe(DEV)}",
        f"{envs.REFERENCE.name}={os.environ.get(envs.REFERENCE.name, '')}",
        flush=True,
    )
    RESULT.update(
        device=torch.cuda.get_device_name(), fla_error=err, backends=backend.describe(DEV)
    )
    gen = torch.Generator().manual_seed(0)
    # fla's chunk kernels autotune on first use per (shape, dtype): (d) pays it, so it comes last
    sections = {
        "b": section_b,
        "c": section_c,
        "e": section_e,
        "d": section_d,
    }
    start = time.perf_counter()
    for name, fn in sections.items():
        if name not in args.only.split(","):
            continue
        t0 = time.perf_counter()
        if t0 - start > args.deadline_s:
            print(f"({name}) skipped: past --deadline-s {args.deadline_s:.0f}", flush=True)
            FAILED.append(f"{name}:skipped")
            continue
        try:
            fn(gen)
        except Exception:  # noqa: BLE001 - report and go on with the other sections
            traceback.print_exc()
            FAILED.append(f"{name}:crashed")
        print(f"  [{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
    RESULT["failed"] = FAILED
    print("RESULT:", "PASS" if not FAILED else f"FAIL {FAILED}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_gdn_tree.json"), "w") as f:
            json.dump(RESULT, f, indent=1, default=str)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
