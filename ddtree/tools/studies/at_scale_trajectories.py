"""The second half of the bf16 DFLASH study (`python3 -m ddtree.tools.studies.at_scale_trajectories`): the
engine's own greedy trajectories. `at_scale_precision` holds the text fixed; here each pair
(small, and the inflated `inflate:SHAPE` built in memory) decodes its own text through `ddtree.LLM`
in bf16, and for each trajectory we report the served τ, where it first leaves the fp32 reference
text, and the teacher-forced τ of the fp32 small pair on that same text: if that τ moves with the
served one, a τ gap between the pairs is the text each decoded (a flipped near-tie early in a
request), not drafter quality.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="python3 -m ddtree.tools.studies.at_scale_trajectories"
    )
    p.add_argument("--shape", required=True, help="inflation shape (name or config.json)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--algorithms", default="DFLASH,DDTREE16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda (served with the default backend)")
    p.add_argument("--dtype", default="bfloat16", help="served dtype (float32: the check that the")
    p.add_argument("--pairs", default="small,big", help="...served τ equals the walk's)")
    p.add_argument("--cache", default=None, help="at_scale_precision's reference sequences")
    p.add_argument("--json", default=None)
    return p


def served(target: str, algo: str, prompts, n: int, dtype: str, device: str = "cpu"):
    from ddtree import LLM, SamplingParams

    budget = {}
    if algo.startswith("DDTREE"):
        budget = {"speculative_ddtree_budget": int(algo[6:] or 16)}
        algo = "DDTREE"
    drafter = {}
    if not target.startswith("inflate:"):
        from ddtree.assets import default_model_paths

        drafter = {"speculative_draft_model_path": default_model_paths()[1]}
    llm = LLM(
        target,
        speculative_algorithm=algo,
        device=device,
        dtype=dtype,
        max_running_requests=len(prompts),
        max_total_tokens=len(prompts) * (max(map(len, prompts)) + n + 160),
        **drafter,
        **budget,
    )
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([list(p) for p in prompts], params)
    del llm  # the next engine needs the device memory (an 8B pair and its pools)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outs


def main(argv: list[str] | None = None) -> int:
    from ddtree.assets import default_model_paths
    from ddtree.bench.acceptance import DEFAULT_PROMPTS
    from ddtree.engine.setup import load_tokenizer
    from ddtree.models.loader import load_drafter, load_target
    from ddtree.tools.studies.at_scale_precision import (
        Side,
        accept_lengths,
        blocks,
        reference_sequences,
        walk_tau,
    )

    ns = make_parser().parse_args(argv)
    torch.set_num_threads(ns.threads)
    t_dir, d_dir = default_model_paths()
    tok = load_tokenizer(t_dir)
    prompts = [tok.encode(p, add_special_tokens=False)[-96:] for p in DEFAULT_PROMPTS[: ns.prompts]]
    small_t = load_target(t_dir, torch.float32, ns.device)
    ref = reference_sequences(small_t, prompts, ns.tokens, ns.cache)
    oracle = Side(small_t, load_drafter(d_dir, torch.float32, ns.device), torch.float32, False)
    mask_id = oracle.drafter.config.mask_token_id

    def tf_tau(seq: list[int], n0: int) -> float:
        s = torch.tensor(seq, device=ns.device)
        _, taps = oracle.taps(s)
        anchors = torch.arange(n0, len(s) - oracle.drafter.config.block_size + 1, device=s.device)
        return walk_tau(accept_lengths(blocks(oracle, taps, s, anchors, mask_id), s, anchors))

    rows = []
    ref_tf = [tf_tau(r, len(p)) for r, p in zip(ref, prompts)]
    print(f"# reference text: teacher-forced tau {sum(ref_tf) / len(ref_tf):.3f}", flush=True)
    for algo in [a for a in ns.algorithms.split(",") if a]:
        targets = {"small": t_dir, "big": f"inflate:{ns.shape}"}
        for pair in ns.pairs.split(","):
            target = targets[pair]
            t0 = time.perf_counter()
            outs = served(target, algo, prompts, ns.tokens, ns.dtype, ns.device)
            per = []
            for o, p, r in zip(outs, prompts, ref):
                seq = list(p) + list(o.token_ids)
                diff = [i for i, (a, b) in enumerate(zip(seq[len(p) :], r[len(p) :])) if a != b]
                per.append(
                    {
                        "tau": o.mean_accept_length,
                        "rounds": len(o.accept_lengths),
                        "accepted": sum(o.accept_lengths),
                        "first_divergence": diff[0] if diff else None,
                        "tf_tau_fp32_on_this_text": tf_tau(seq, len(p)),
                    }
                )
            rounds = sum(x["rounds"] for x in per)
            row = {
                "algorithm": algo,
                "pair": pair,
                "served_tau": sum(x["accepted"] for x in per) / max(rounds, 1),
                "tf_tau_fp32_on_this_text": sum(x["tf_tau_fp32_on_this_text"] for x in per)
                / len(per),
                "tf_tau_fp32_on_reference": sum(ref_tf) / len(ref_tf),
                "diverged": sum(x["first_divergence"] is not None for x in per),
                "per_prompt": per,
                "seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "per_prompt"}), flush=True)
            print("#   per prompt tau / first divergence / tf tau:", flush=True)
            for x in per:
                print(
                    f"#   {x['tau']:.2f} / {x['first_divergence']} / "
                    f"{x['tf_tau_fp32_on_this_text']:.2f}",
                    flush=True,
                )
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump({"meta": vars(ns), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
