"""Kernel launches per decoder layer of one engine round, counted on the CPU: a proxy for what a CUDA
graph of the round replays, and a regression guard (tests/test_hybrid_op_count.py).

Counted: every aten op that does work (views, `empty*` and other metadata-only ops are free), one per
Triton kernel launch (our kernels run in Triton's interpreter: TRITON_INTERPRET=1 and
DDTREE_FUSED_KERNELS_INTERPRET=1, set before `ddtree` is imported, as `main` does), and one per
attention call (the CPU's reference attention stands in for the GPU's one kernel). Each op is
charged to the target decoder layer running it (the add + RMSNorm after layer i is layer i's),
everything else to "other" (drafter, tree build, LM head, accept walk, commit).

    python3 -m ddtree.tools.studies.op_count [--algorithm NONE|DFLASH|DDTREE] [--budget 8] [--ops]

NONE's one-node rounds step the GDN state in place (the in-place conv + the decode kernel, the
gate inside; no state commit).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch nothing: allocation without a fill, metadata, aliasing
_FREE = {
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "set_",
    "resize_",
    "is_same_size",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "_reshape_alias",
    "_unsafe_view",
    "resolve_conj",
    "resolve_neg",
    "promote_types",
}


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


class LaunchCounter(TorchDispatchMode):
    """Counts launches per label (`label` is set by the model hooks of `count_round`)."""

    def __init__(self):
        super().__init__()
        self.label = "other"
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.syncs = 0
        self._opaque = 0

    def charge(self, what: str) -> None:
        self.ops[self.label][what] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        if not self._opaque:
            if name == "_local_scalar_dense":
                self.syncs += 1  # a host read-back (.item(), .tolist())
            elif not (func.is_view or name in _FREE):
                self.charge(name)
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def opaque(self, what: str):
        """Charge one launch for what runs inside (a Triton kernel, an attention call)."""
        if not self._opaque:
            self.charge(what)
        self._opaque += 1
        try:
            yield
        finally:
            self._opaque -= 1

    def per_label(self) -> dict[str, int]:
        return {k: sum(c.values()) for k, c in self.ops.items()}


@contextlib.contextmanager
def _triton_launches(counter: LaunchCounter):
    """Each interpreted Triton launch = one launch (its host copies are the interpreter's, not ours)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        with counter.opaque(f"triton:{self.fn.__name__}"):
            return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield
    finally:
        InterpretedFunction.run = run


@contextlib.contextmanager
def _layer_labels(counter: LaunchCounter, runner):
    """Label ops with the target layer running them; attention calls charged as one launch."""
    target, handles = runner.target, []
    body = target.model

    def labeller(label):
        def hook(module, args):
            counter.label = label

        return hook

    for i, layer in enumerate(body.layers):
        kind = "gdn" if getattr(layer, "linear_ordinal", None) is not None else "attn"
        handles.append(layer.register_forward_pre_hook(labeller(f"{kind}:{i}")))
    handles.append(body.embed_tokens.register_forward_pre_hook(labeller("other")))
    handles.append(body.norm.register_forward_hook(lambda *a: setattr(counter, "label", "other")))
    backend = runner.backend
    extend = backend.extend

    def attention(*args, **kwargs):
        with counter.opaque("attention"):
            return extend(*args, **kwargs)

    backend.extend = attention
    try:
        yield
    finally:
        backend.extend = extend
        for h in handles:
            h.remove()
        counter.label = "other"


def summarize(counter: LaunchCounter) -> dict[str, float]:
    """Mean launches per GDN layer and per attention layer, and the round's total / other."""
    per = counter.per_label()
    out: dict[str, float] = {"total": sum(per.values()), "other": per.get("other", 0)}
    for kind in ("gdn", "attn"):
        vals = [v for k, v in per.items() if k.startswith(kind + ":")]
        out[kind] = sum(vals) / len(vals) if vals else 0.0
    out["syncs"] = counter.syncs
    return out


def layer_ops(counter: LaunchCounter, kind: str) -> collections.Counter:
    """The ops of the first layer of `kind` ("gdn" / "attn")."""
    for label, ops in counter.ops.items():
        if label.startswith(kind + ":"):
            return ops
    return collections.Counter()


def count_round(llm, prompt: list[int], decode_steps: int = 1) -> LaunchCounter:
    """Prefill `prompt`, run one decode round, then count the next `decode_steps` decode rounds.
    The engine's CUDA-graph path runs (capture off), as on the GPU."""
    from ddtree import SamplingParams
    from ddtree.engine.graphs.runner import attach_uncaptured

    engine = llm.engine
    runner = engine.runner
    if runner.graphs is None:
        attach_uncaptured(engine, max_bs=1)
    params = SamplingParams(temperature=0, max_tokens=64 + 16 * decode_steps, ignore_eos=True)
    req = engine.add_request(list(prompt), params)
    while engine.last_round is None:  # prefill (+ first token), then the first decode round
        engine.step()
    counter = LaunchCounter()
    with _triton_launches(counter), _layer_labels(counter, runner), counter:
        for _ in range(decode_steps):
            engine.step()
    engine.abort(req.rid)
    return counter


def interpreter_env() -> dict[str, str]:
    """What must be set before ddtree / triton are imported for the GPU's kernel sequence on CPU."""
    from ddtree import envs

    return {envs.TRITON_INTERPRET.name: "1", envs.FUSED_KERNELS_INTERPRET.name: "1"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithm", default="both", choices=["NONE", "DFLASH", "DDTREE", "both"])
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument(
        "--ops", action="store_true", help="list the ops of one layer of each kind, and the rest"
    )
    ap.add_argument("--strategy", default="extra_buffer", choices=["extra_buffer", "no_buffer"])
    args = ap.parse_args(argv)
    if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
        print("set TRITON_INTERPRET=1 before importing triton", file=sys.stderr)
        return 2
    import tempfile

    from ddtree import envs

    os.environ[envs.TRITON_INTERPRET.name] = "1"  # before triton is imported
    from ddtree import LLM
    from ddtree.tools.train.toy import build_toy_hybrid_pair, toy_prompts

    torch.set_num_threads(1)
    root = envs.CACHE.get() or tempfile.mkdtemp()
    # trained with the references (the interpreter would crawl), then counted with the kernels
    target, drafter = build_toy_hybrid_pair(os.path.join(root, "toy_hybrid_pair"))
    os.environ.update(interpreter_env())
    algos = ["NONE", "DDTREE"] if args.algorithm == "both" else [args.algorithm]
    for algo in algos:
        kw = dict(dtype="float32", device="cpu", mamba_scheduler_strategy=args.strategy)
        if algo != "NONE":
            kw.update(speculative_draft_model_path=drafter)
        if algo == "DDTREE":
            kw.update(speculative_ddtree_budget=args.budget)
        llm = LLM(target, speculative_algorithm=algo, **kw)
        c = count_round(llm, toy_prompts(1, 7)[0])
        s = summarize(c)
        print(
            f"{algo:7s} launches/round {s['total']:5.0f}  per GDN layer {s['gdn']:5.1f}  "
            f"per attention layer {s['attn']:5.1f}  other {s['other']:4.0f}  syncs {s['syncs']}"
        )
        if args.ops:
            for kind in ("gdn", "attn"):
                ops = layer_ops(c, kind)
                print(f"  {kind}: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
            other = c.ops.get("other", {})  # drafter, tree build, LM head, accept walk, commit
            print("  other: " + ", ".join(f"{k} {v}" for k, v in sorted(other.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
