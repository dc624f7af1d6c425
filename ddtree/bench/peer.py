"""The paper's reference code (liranringel/ddtree) run on our weights in this process: its per-round time.

`peer_round_ms(peer_dir, target, drafter, context_len, budget, rounds, device) -> dict` takes an outside
checkout of liranringel/ddtree (never committed: it lives under `.peer/`, named by `--peer-checkout DIR`;
either the checkout itself or a folder holding it as `ddtree/`), our target (`ddtree.models.qwen3`
`Qwen3ForCausalLM`, HF key names) and drafter (`DFlashDrafter`, z-lab layout), and builds the peer's models
from them: an HF transformers `Qwen3ForCausalLM` (target, SDPA as in the paper: its tree mask is a 4-D float
mask) and the checkout's own `model.DFlashDraftModel`, both on the meta device with our parameter tensors
assigned (no second copy of the weights). It then runs the peer's own loop, `ddtree_generate` (or
`dflash_generate` with algorithm="DFLASH"), on a random prompt of `context_len` tokens with `rounds + 1` new
tokens, after a short warm-up call. The peer syncs the device between stages and stamps every round
(`round_timestamps`); a round's time is the gap between consecutive stamps, and round 0 (the drafter's
prefill over the whole context) is left out. Random weights accept ~nothing, so rounds ~= new tokens.

Returned dict: ms (median per round), ms_mean, ms_p10, ms_p90, rounds (timed), emitted_mean (tokens per
round), stages_ms (the peer's own stage split per round: draft, tree_build, tree_compile, verify, commit, and
the tree_build_{copy,heap,visibility} sub-stages), output_ids (the new tokens of the timed call), and the
settings (algorithm, budget, context, target_attn, draft_attn, cpp_compact, peer commit).

Adaptations (the peer's files are never edited; `peer.adaptations` lists those made): `loguru`/`datasets`,
which the peer imports but a round never uses, are stubbed when absent; its `ddtree`, `model` and `dflash`
modules are loaded under private names, so they never shadow our `ddtree` package; transformers >= 5.18 reads
`DynamicCache.crop(n)` as "remove -n tokens" and rejects the peer's `crop(start)`, so there its modules get a
DynamicCache subclass that keeps the old meaning (5.17, the H200's, takes it with a deprecation warning and
is left alone); on a CPU device its `cuda_time` (torch.cuda.synchronize + host clock) becomes the host clock.
Only dense Qwen3 targets (the peer has no hybrid path).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import logging
import os
import statistics
import sys
import time
import types
import warnings

import torch
from torch import nn

from ddtree.bench.round_timing import percentile

_LOADED: dict[str, types.SimpleNamespace] = {}


class PeerCheckoutError(RuntimeError):
    """The --peer-checkout path holds no usable liranringel/ddtree checkout."""


def resolve_checkout(peer_dir: str) -> str:
    """The folder holding the peer's ddtree.py, dflash.py and model/ (`peer_dir` or `peer_dir/ddtree`)."""
    for d in (peer_dir, os.path.join(peer_dir, "ddtree")):
        if all(
            os.path.exists(os.path.join(d, f))
            for f in ("ddtree.py", "dflash.py", "model/dflash.py")
        ):
            return os.path.abspath(d)
    raise PeerCheckoutError(
        f"--peer-checkout {peer_dir!r}: no liranringel/ddtree checkout there (want ddtree.py, dflash.py and "
        "model/dflash.py in it or in its ddtree/ folder); put the repository's files under .peer/ddtree"
    )


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _unavailable(*_a, **_k):
    raise RuntimeError("stubbed by ddtree.bench.peer: the `datasets` package is not installed")


def load_peer(peer_dir: str) -> types.SimpleNamespace:
    """Import the peer's ddtree.py (and through it dflash.py and model/) under private module names."""
    root = resolve_checkout(peer_dir)
    if root in _LOADED:
        return _LOADED[root]
    stubs = {}
    for name, attrs in (
        ("loguru", {"logger": logging.getLogger("ddtree.peer")}),
        ("datasets", {k: _unavailable for k in ("load_dataset", "Features", "Sequence", "Value")}),
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            stubs[name] = _stub(name, **attrs)
    shadowed = ("model", "dflash")
    saved = {k: v for k, v in sys.modules.items() if k in shadowed or k.startswith("model.")}
    for k in saved:
        del sys.modules[k]
    sys.modules.update(stubs)
    sys.path.insert(0, root)
    try:
        spec = importlib.util.spec_from_file_location(
            "_ddtree_peer_reference", os.path.join(root, "ddtree.py")
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        peer = types.SimpleNamespace(
            ddtree=mod, dflash=sys.modules["dflash"], model=sys.modules["model"], root=root
        )
    # an import error or a transformers API the peer expects and this version lacks
    except Exception as e:
        raise PeerCheckoutError(
            f"--peer-checkout {peer_dir!r}: importing the peer code from {root} failed: "
            f"{type(e).__name__}: {e}"
        ) from e
    finally:
        sys.path.remove(root)
        for k in [k for k in sys.modules if k in shadowed or k.startswith("model.") or k in stubs]:
            del sys.modules[k]
        sys.modules.update(saved)
    peer.adaptations = [f"stubbed {n} (not installed)" for n in stubs]
    if not _crop_takes_length():
        for m in (peer.ddtree, peer.dflash):
            m.DynamicCache = _length_crop_cache()
        peer.adaptations.append(
            "DynamicCache.crop(max_length) restored (this transformers takes -tokens_to_remove)"
        )
    _LOADED[root] = peer
    return peer


def _crop_takes_length() -> bool:
    """Whether DynamicCache.crop(n > 0) still means 'keep n tokens' (transformers < 5.18; 5.17 warns)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1), 0)
    try:
        cache.crop(1)
    except (ValueError, RuntimeError):
        return False
    return cache.get_seq_length() == 1


def _length_crop_cache():
    from transformers import DynamicCache

    class LengthCropCache(DynamicCache):
        """The peer's `crop(start)` (keep `start` tokens) on a transformers that counts tokens to remove."""

        def crop(self, max_length: int) -> None:
            if max_length > 0:
                max_length = min(max_length - self.get_seq_length(), 0)
            super().crop(max_length)

    return LengthCropCache


def _assign(hf: nn.Module, ours: nn.Module, device) -> nn.Module:
    """Point every parameter of the meta-built `hf` at our tensor of the same name; rebuild rotary buffers."""
    state = ours.state_dict()
    names = [
        n for n, _ in hf.named_parameters(remove_duplicate=False)
    ]  # tied heads under both names
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(f"peer model has parameters ours lacks: {missing[:6]}")
    hf.load_state_dict({n: state[n] for n in names}, strict=False, assign=True)
    for name, mod in list(hf.named_modules()):
        if type(mod).__name__.endswith("RotaryEmbedding"):
            parent = hf.get_submodule(name.rpartition(".")[0]) if "." in name else hf
            with torch.device(device):
                setattr(parent, name.rpartition(".")[2], type(mod)(mod.config))
    left = [
        n
        for n, t in list(hf.named_parameters(remove_duplicate=False)) + list(hf.named_buffers())
        if t.is_meta
    ]
    if left:
        raise ValueError(f"peer model tensors left unassigned: {left[:6]}")
    return hf.eval()


def _hf_config(raw: dict, attn: str, **extra):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        **{k: v for k, v in raw.items() if k not in ("architectures", "auto_map")}, **extra
    )
    cfg._attn_implementation = attn
    return cfg


def build_peer_models(
    peer, target: nn.Module, drafter: nn.Module, device, draft_attn: str = "sdpa"
):
    """(HF Qwen3ForCausalLM, peer DFlashDraftModel) sharing `target`'s and `drafter`'s tensors."""
    from transformers import Qwen3ForCausalLM as HFQwen3

    tcfg, dcfg = target.config, drafter.config
    if getattr(tcfg, "is_hybrid", False):
        raise ValueError("the peer code runs dense Qwen3 targets only")
    draw = dict(dcfg.raw)
    draw["dflash_config"] = {
        **(draw.get("dflash_config") or {}),
        "mask_token_id": dcfg.mask_token_id,
        "target_layer_ids": list(dcfg.target_layer_ids),
    }
    draw["block_size"] = dcfg.block_size
    draw["num_target_layers"] = tcfg.num_hidden_layers
    with torch.device("meta"):
        hf_target = HFQwen3(_hf_config(tcfg.raw, "sdpa"))
        hf_drafter = peer.model.DFlashDraftModel(_hf_config(draw, draft_attn))
    return _assign(hf_target, target, device), _assign(hf_drafter, drafter, device)


def random_prompt(vocab: int, context_len: int, mask_token_id: int, seed: int = 0) -> torch.Tensor:
    """[1, context_len] random ids without the MASK id (the peer drops MASK ids from its output)."""
    ids = torch.randint(0, vocab, (1, context_len), generator=torch.Generator().manual_seed(seed))
    return ids.masked_fill(ids == mask_token_id, 0 if mask_token_id else 1)


def _host_time() -> float:
    return time.perf_counter()


def peer_round_ms(
    peer_dir: str,
    target_model: nn.Module,
    drafter_model: nn.Module,
    context_len: int,
    budget: int,
    rounds: int,
    device,
    *,
    algorithm: str = "DDTREE",
    warmup: int = 3,
    seed: int = 0,
    draft_attn: str = "auto",
    cpp_compact: bool | None = None,
    models=None,
) -> dict:
    """Per-round time of the peer's own decode loop on our weights (see the module docstring).

    draft_attn "auto" is flash_attention_2 (the paper's drafter setting) where flash_attn imports on CUDA, else
    sdpa. cpp_compact (the peer's inline C++ KV compaction, its default) defaults to on for CUDA, off on CPU; the
    result says whether it really loaded (the peer falls back to ATen ops when it cannot build).
    `models`: a (target, drafter) pair from `build_peer_models` to reuse across calls."""
    device = torch.device(device)
    peer = load_peer(peer_dir)
    cuda = device.type == "cuda"
    if draft_attn == "auto":
        draft_attn = (
            "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
        )
    if cpp_compact is None:
        cpp_compact = cuda
    hf_target, hf_drafter = models or build_peer_models(
        peer, target_model, drafter_model, device, draft_attn
    )
    dcfg = drafter_model.config
    mods = (peer.ddtree, peer.dflash)
    saved_clock = [m.cuda_time for m in mods]
    if not cuda:
        for m in mods:
            m.cuda_time = _host_time
    try:
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():
            # builds the extension once (or warns, falls back)
            peer.ddtree.maybe_enable_cpp_compact(cpp_compact)
            cpp_compact = cpp_compact and peer.ddtree.load_cpp_compact_module() is not None
            ids = random_prompt(
                target_model.config.vocab_size, context_len, dcfg.mask_token_id, seed
            ).to(device)

            def call(new_tokens: int):
                kw = {
                    "model": hf_drafter,
                    "target": hf_target,
                    "input_ids": ids,
                    "mask_token_id": dcfg.mask_token_id,
                    "max_new_tokens": new_tokens,
                    "block_size": dcfg.block_size,
                    "stop_token_ids": None,
                    "temperature": 0.0,
                }
                if algorithm == "DFLASH":
                    return peer.dflash.dflash_generate(**kw)
                return peer.ddtree.ddtree_generate(**kw, tree_budget=budget)

            # transformers' deprecation notes about the peer's kwargs
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                if warmup:
                    call(warmup + 1)
                res = call(rounds + 1)
    finally:
        for m, f in zip(mods, saved_clock):
            m.cuda_time = f
    stamps = res.round_timestamps
    per = [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]
    if not per:
        raise RuntimeError(f"the peer ran {len(stamps)} round(s); ask for more rounds")
    n = res.decode_rounds
    stages = {k: v * 1e3 / max(n - (k == "draft"), 1) for k, v in res.stage_times.items()}
    return {
        "algorithm": algorithm,
        "budget": budget if algorithm == "DDTREE" else None,
        "context": context_len,
        "rounds": len(per),
        "ms": statistics.median(per),
        "ms_mean": statistics.fmean(per),
        "ms_p10": percentile(per, 0.1),
        "ms_p90": percentile(per, 0.9),
        "emitted_mean": statistics.fmean(res.acceptance_lengths),
        "stages_ms": stages,
        "output_ids": res.output_ids[0, res.num_input_tokens :].tolist(),
        "target_attn": "sdpa",
        "draft_attn": draft_attn,
        "cpp_compact": bool(cpp_compact),
        "peer": {"path": peer.root, "commit": _commit(peer.root), "adaptations": peer.adaptations},
    }


def _commit(root: str) -> str | None:
    """The peer commit recorded in `.peer/SOURCES.txt` (written when the checkout was made), if any."""
    for path in (
        os.path.join(root, "SOURCES.txt"),
        os.path.join(os.path.dirname(root), "SOURCES.txt"),
    ):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.startswith("liranringel/ddtree "):
                        return line.split()[1]
    return None
