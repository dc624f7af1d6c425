"""How tensor parallelism splits a model over `tp` ranks (torch-free: the loader, the memory plan
and the config checks all read it, so the plan and the checks describe what the engine loads).

Rank r of tp holds:
- attention: heads / tp query heads [r * hq, (r + 1) * hq) and the KV heads they read: kv / tp of
  them when tp divides kv, else the one KV head of its query group, replicated on tp / kv ranks
  (SGLang's rule; Qwen3.6-27B's 4 KV heads at tp 8), so kv must divide tp there;
- MLP: intermediate / tp rows of gate|up and the same columns of down (all-reduce after down);
- vocab: ceil(V / tp) rows of the embedding and the LM head (the last shard zero-padded);
- Gated DeltaNet: value heads / tp, key heads divided or replicated like KV heads (value head i reads
  key head i // (hv / hk): contiguous blocks keep that map), their conv channels, A_log / dt_bias,
  z / a / b rows and out_proj columns;
- replicated: every norm (q/k norms are per head, shared by all heads), biases added after an
  all-reduce, the drafter's fc / hidden_norm (the fused context is needed whole by every layer).

A model built from `shard_target(cfg, tp)` / `shard_drafter(cfg, tp)` has exactly one rank's local
shapes, so the KV pools, state pools and attention kernels of a rank need no TP code at all.
"""

from __future__ import annotations

import dataclasses
import re

from ddtree.models.configs import DrafterConfig, TargetConfig


def head_shard(heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first head, head count) of `rank`: heads / tp each, or one replicated head when heads | tp."""
    if heads % tp == 0:
        n = heads // tp
        return rank * n, n
    if tp % heads == 0:
        return rank // (tp // heads), 1
    raise ValueError(f"{heads} heads split over neither divides nor is divided by tp {tp}")


def vocab_rows(vocab: int, tp: int) -> int:
    """Embedding / LM-head rows per rank (the vocab padded to a multiple of tp)."""
    return -(-vocab // tp)


def _divides_or_replicates(n: int, tp: int) -> bool:
    return n % tp == 0 or tp % n == 0


def tp_problems(tp: int, t: TargetConfig | None, d: DrafterConfig | None) -> list[str]:
    """One line per head count / width that `tp` cannot split (empty = every rank gets a shard)."""
    if tp <= 1:
        return []
    exact, shared = {}, {}
    if t is not None:
        exact["target attention heads"] = t.num_attention_heads
        exact["target intermediate size"] = t.intermediate_size
        shared["target KV heads"] = t.num_key_value_heads
        if t.is_hybrid:
            exact["target linear value heads"] = t.linear_num_value_heads
            shared["target linear key heads"] = t.linear_num_key_heads
    if d is not None:
        exact["drafter attention heads"] = d.num_attention_heads
        exact["drafter intermediate size"] = d.intermediate_size
        shared["drafter KV heads"] = d.num_key_value_heads
    bad = [f"{k} ({n})" for k, n in exact.items() if n % tp]
    bad += [
        f"{k} ({n}; KV-style heads must divide or be a divisor of tp)"
        for k, n in shared.items()
        if not _divides_or_replicates(n, tp)
    ]
    if not bad:
        return []
    valid = [
        k
        for k in range(1, 65)
        if all(n % k == 0 for n in exact.values())
        and all(_divides_or_replicates(n, k) for n in shared.values())
    ]
    return [f"--tp-size {tp} does not divide the {', '.join(bad)}; valid --tp-size values: {valid}"]


def shard_target(cfg: TargetConfig, tp: int) -> TargetConfig:
    """One rank's local target geometry (vocab stays whole: logits are gathered to full width)."""
    if tp == 1:
        return cfg
    return dataclasses.replace(
        shard_drafter(cfg, tp),
        linear_num_key_heads=(
            head_shard(cfg.linear_num_key_heads, tp, 0)[1] if cfg.is_hybrid else 0
        ),
        linear_num_value_heads=cfg.linear_num_value_heads // tp,
    )


def shard_drafter(cfg: DrafterConfig | TargetConfig, tp: int) -> DrafterConfig | TargetConfig:
    """One rank's attention heads (KV heads replicated where fewer than tp) and MLP rows: all of a
    drafter's sharding, the attention and MLP part of a target's."""
    if tp == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=head_shard(cfg.num_key_value_heads, tp, 0)[1],
        intermediate_size=cfg.intermediate_size // tp,
    )


Piece = tuple[int, int, int]  # (dim, start, stop) of a checkpoint tensor


class ShardMap:
    """Which slices of each checkpoint tensor (state-dict names: HF's) rank `rank` reads: `pieces(name)` ->
    (dim, start, stop) pieces concatenated along dim, or None for a replicated tensor. `vocab_pad(name)`
    -> rows of zeros appended (the last vocab shard)."""

    _ATTN = re.compile(r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")
    _MLP = re.compile(r"mlp\.(gate_proj|up_proj|down_proj)\.weight$")
    _GDN = re.compile(
        r"linear_attn\.(in_proj_qkv\.weight|conv1d\.weight|in_proj_z\.weight|in_proj_b\.weight"
        r"|in_proj_a\.weight|dt_bias|A_log|out_proj\.weight)$"
    )
    _VOCAB = ("embed_tokens.weight", "lm_head.weight")

    def __init__(self, cfg: TargetConfig | DrafterConfig, tp: int, rank: int):
        self.cfg, self.tp, self.rank = cfg, tp, rank
        gated = isinstance(cfg, TargetConfig) and cfg.attn_output_gate
        hd = cfg.head_dim
        q0, qn = head_shard(cfg.num_attention_heads, tp, rank)
        k0, kn = head_shard(cfg.num_key_value_heads, tp, rank)
        qr = hd * (2 if gated else 1)  # q rows per head ([query | gate] per head when gated)
        i0, i_n = head_shard(cfg.intermediate_size, tp, rank)
        self.rows = {
            "q_proj": [(0, q0 * qr, (q0 + qn) * qr)],
            "k_proj": [(0, k0 * hd, (k0 + kn) * hd)],
            "v_proj": [(0, k0 * hd, (k0 + kn) * hd)],
            "o_proj": [(1, q0 * hd, (q0 + qn) * hd)],
            "gate_proj": [(0, i0, i0 + i_n)],
            "up_proj": [(0, i0, i0 + i_n)],
            "down_proj": [(1, i0, i0 + i_n)],
        }
        if isinstance(cfg, TargetConfig) and cfg.is_hybrid:
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            a0, an = head_shard(cfg.linear_num_key_heads, tp, rank)
            v0, vn = head_shard(cfg.linear_num_value_heads, tp, rank)
            key_dim = cfg.linear_num_key_heads * dk
            conv = [
                (0, a0 * dk, (a0 + an) * dk),
                (0, key_dim + a0 * dk, key_dim + (a0 + an) * dk),
                (0, 2 * key_dim + v0 * dv, 2 * key_dim + (v0 + vn) * dv),
            ]
            heads = [(0, v0, v0 + vn)]
            self.rows.update(
                {
                    "in_proj_qkv.weight": conv,
                    "conv1d.weight": conv,
                    "in_proj_z.weight": [(0, v0 * dv, (v0 + vn) * dv)],
                    "in_proj_b.weight": heads,
                    "in_proj_a.weight": heads,
                    "dt_bias": heads,
                    "A_log": heads,
                    "out_proj.weight": [(1, v0 * dv, (v0 + vn) * dv)],
                }
            )
        self.vocab = vocab_rows(cfg.vocab_size, tp)

    def pieces(self, name: str) -> list[Piece] | None:
        if self.tp == 1:
            return None
        if name.endswith(self._VOCAB):
            start = self.rank * self.vocab
            return [(0, start, min(start + self.vocab, self.cfg.vocab_size))]
        m = self._ATTN.search(name)
        if m:
            if m.group(1) == "o_proj" and m.group(2) == "bias":
                return None  # added once, after the all-reduce
            return self.rows[m.group(1)]
        m = self._MLP.search(name) or self._GDN.search(name)
        if m:
            return self.rows[m.group(1)]
        return None

    def vocab_pad(self, name: str) -> int:
        if self.tp == 1 or not name.endswith(self._VOCAB):
            return 0
        start = self.rank * self.vocab
        return self.vocab - (min(start + self.vocab, self.cfg.vocab_size) - start)

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape rank `rank` holds of a checkpoint tensor of `shape`."""
        pieces = self.pieces(name)
        if pieces is None:
            return tuple(shape)
        dim = pieces[0][0]
        out = list(shape)
        out[dim] = sum(stop - start for _, start, stop in pieces) + self.vocab_pad(name)
        return tuple(out)


def fp8_cuts(cfg: TargetConfig | DrafterConfig, tp: int, shapes: dict, block) -> list[str]:
    """The FP8 linears (state-dict module name -> full [out, in]) whose rank slices at `tp` cut a
    weight block: a rank's rows must start and end on multiples of bn (or the weight's end), its
    columns on multiples of bk (each rank quantizes its own activation columns in groups of bk, which
    must be the blocks of its weight's scales). One example per kind of module (layer indices
    dropped), empty when every slice is whole blocks."""
    if tp <= 1:
        return []
    bad: dict[str, str] = {}
    for name, shape in sorted(shapes.items()):
        kind = re.sub(r"\.\d+\.", ".N.", name)
        if kind in bad:
            continue
        for rank in range(tp):
            for dim, start, stop in ShardMap(cfg, tp, rank).pieces(name + ".weight") or ():
                b = block[0] if dim == 0 else block[1]
                if start % b or (stop % b and stop != shape[dim]):
                    what = "rows" if dim == 0 else "columns"
                    bad[kind] = f"{kind} ({what} {start}..{stop} on rank {rank}, blocks of {b})"
                    break
            if kind in bad:
                break
    return list(bad.values())
