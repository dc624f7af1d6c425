"""Recurrent-state pool of hybrid (Gated DeltaNet) targets (the per-forward contexts that read / write it:
state_contexts.py).

Rows are indexed [gdn_layer, request_slot, ...] (request_slot = the request's block-table row):
  conv ....... [L, R, C, K-1]       the last K-1 pre-conv inputs (model dtype)
  ssm ........ [L, R, Hv, dk, dv]   delta-rule state (--mamba-ssm-dtype)
A tree verify never writes `conv`/`ssm`; it leaves a per-node stash that `commit` turns into the state
after the last accepted node:
  extra_buffer: node_conv [L, R, W, C, K-1], node_ssm [L, R, W, Hv, dk, dv]  -> commit copies one node
  no_buffer:    node_x [L, R, W, C] (pre-conv), node_y [L, R, W, C] (post-conv q|k|v), node_g [L, R, W, Hv]
                fp32, node_beta [L, R, W, Hv]                                  -> commit replays the path
W = max_verify_width (root included). With `scratch_row` the pool has one row past the requests'
(index max_reqs) that no request owns: the padded rows of a CUDA graph read and write only it.
Under no_buffer the verify itself keeps no per-node states either: on
CUDA it runs the chunk-form tree rule (kernels/gdn/tree_chunk_split_triton.py, two launches per
layer, over the round's tree_mask), extra_buffer the Triton tree kernel; the stash rows are written
inside the conv and rule kernels (no index_put per layer), and no_buffer's commit replays the
accepted path in place (kernels/gdn/commit_triton.py, all layers in one launch).

One-node verifies (AR rounds, auto's width-1 rounds) are the exception, under either strategy
(`in_place`): their root is the state's next token whatever the round accepts, so the verify steps
`conv` / `ssm` in place (the tree conv's in-place mode, kernels/gdn/decode_triton.py: the state
read and written once, two launches per layer) and writes no stash, and their commit
(`commit(..., nodes=1)`, eager or in the commit graph) leaves the GDN state alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.engine.config import (
    DEFAULT_MAMBA_STRATEGY,
    MAMBA_STRATEGIES,
    GDNGeometry,
    stash_width,
)
from ddtree.engine.memory.state_contexts import ExtendContext, TreeContext
from ddtree.kernels.gdn import replay_conv_path
from ddtree.kernels.gdn.backend import choose, commit_kernel
from ddtree.kernels.gdn.dispatch import replay

# no_buffer commit: the most fp32 state one group of layers gathers at a time
REPLAY_GROUP_BYTES = 512 << 20
_SSM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    if d not in _SSM_DTYPES:
        raise ValueError(
            f"--mamba-ssm-dtype {d!r} is not supported; choose one of {sorted(_SSM_DTYPES)}"
        )
    return _SSM_DTYPES[d]


def state_bytes_per_request(
    cfg, max_verify_width: int, strategy: str, ssm_dtype, dtype
) -> tuple[int, int]:
    """(persistent state, tree-verify stash) bytes of one request; for memory planning from config alone."""
    geo = GDNGeometry.from_config(cfg)
    return geo.state_bytes(ssm_dtype, dtype), geo.stash_bytes(
        max_verify_width, strategy, ssm_dtype, dtype
    )


class HybridStatePool:
    def __init__(
        self,
        geo: GDNGeometry,
        max_reqs: int,
        max_verify_width: int,
        device,
        strategy: str = DEFAULT_MAMBA_STRATEGY,
        ssm_dtype="float32",
        dtype=torch.bfloat16,
        scratch_row: bool = False,
    ):
        if strategy not in MAMBA_STRATEGIES:
            raise ValueError(
                f"--mamba-scheduler-strategy {strategy!r} is not supported; choose one of "
                f"{MAMBA_STRATEGIES}"
            )
        self.geo, self.strategy, self.width = geo, strategy, max_verify_width
        self.ssm_dtype, self.dtype = _dtype(ssm_dtype), _dtype(dtype)
        # extra_buffer's node-state stash is --mamba-ssm-dtype's: fp32 takes the node states in
        # place (the tree kernel re-reads parents from it); a 16-bit one goes through an fp32
        # scratch, so the tree itself never runs on rounded states (state_contexts.py)
        self.stash_dtype = self.ssm_dtype
        # the scratch row (padded graph rows) sits past the requests' rows
        self.scratch_row = max_reqs if scratch_row else None
        L, R, W, C, Km1 = (
            geo.num_layers,
            max_reqs + scratch_row,
            # none for a NONE server whose one-node verifies step the rows in place
            stash_width(max_verify_width),
            geo.conv_dim,
            geo.kernel - 1,
        )
        S = (geo.hv, geo.dk, geo.dv)

        def zeros(*shape, dt=self.dtype):
            return torch.zeros(shape, dtype=dt, device=device)

        self.conv = zeros(L, R, C, Km1)
        self.ssm = zeros(L, R, *S, dt=self.ssm_dtype)
        self.stash: dict[str, Tensor] = {}
        if strategy == "extra_buffer":
            self.stash["node_conv"] = zeros(L, R, W, C, Km1)
            self.stash["node_ssm"] = zeros(L, R, W, *S, dt=self.stash_dtype)
        else:
            self.stash["node_x"] = zeros(L, R, W, C)
            self.stash["node_y"] = zeros(L, R, W, C)
            self.stash["node_g"] = zeros(L, R, W, geo.hv, dt=torch.float32)
            self.stash["node_beta"] = zeros(L, R, W, geo.hv)

    @classmethod
    def for_config(
        cls,
        cfg,
        max_reqs,
        max_verify_width,
        device,
        strategy="extra_buffer",
        ssm_dtype="float32",
        dtype=torch.bfloat16,
        scratch_row: bool = False,
    ) -> "HybridStatePool":
        return cls(
            GDNGeometry.from_config(cfg),
            max_reqs,
            max_verify_width,
            device,
            strategy,
            ssm_dtype,
            dtype,
            scratch_row,
        )

    @property
    def device(self) -> torch.device:
        return self.conv.device

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))

    @property
    def stash_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stash.values())

    @property
    def bytes(self) -> int:
        return self.state_bytes + self.stash_bytes

    def check_rows(self, slots: list[int]) -> None:
        """Debug: `slots` are request rows (not the scratch row padded graph rows write) and their
        committed conv / SSM states are finite (a host read of those rows)."""
        rows = self.conv.shape[1] - (self.scratch_row is not None)
        assert all(0 <= s < rows for s in slots), f"state rows {slots} outside 0..{rows - 1}"
        if not slots:
            return
        idx = self._slots(slots)
        for name, t in (("conv", self.conv), ("ssm", self.ssm)):
            bad = ~torch.isfinite(t.index_select(1, idx)).flatten(2).all(-1).all(0)
            assert not bad.any(), f"non-finite {name} state in rows {idx[bad].tolist()}"

    def _slots(self, slots) -> Tensor:
        return torch.as_tensor(slots, dtype=torch.int64).to(self.device)

    def extend_context(
        self, slots: list[int], q_lens: list[int], kv_lens_before: list[int]
    ) -> ExtendContext:
        """Packed extend of q_lens[i] tokens per request; kv_lens_before[i] == 0 starts from a zero state."""
        return ExtendContext(self, self._slots(slots), q_lens, kv_lens_before)

    def tree_context(self, slots: list[int], tree) -> TreeContext:
        if tree.num_nodes > self.width:
            raise ValueError(
                f"tree of {tree.num_nodes} nodes exceeds max_verify_width {self.width}"
            )
        return TreeContext(self, self._slots(slots), tree)

    def in_place(self, nodes: int | None) -> bool:
        """Whether a verify of `nodes`-node trees steps the committed rows itself (one node): its
        commit then has nothing to do."""
        return nodes == 1

    def commit(
        self, slots: Tensor, path: Tensor, accept_length: Tensor, nodes: int | None = None
    ) -> None:
        """Set each request's state to the one after node path[i, accept_length[i]] of the last tree verify.
        path [b, P] node indices root first (entries past accept_length are ignored). nodes: that
        verify's nodes per request (None: unknown, a stash commit); after an in-place one
        (`in_place(nodes)`) the rows already hold the root's state: nothing is written."""
        if self.in_place(nodes):
            return
        slots, path, acc = (
            slots.to(self.device).long(),
            path.to(self.device).long(),
            accept_length.to(self.device).long(),
        )
        if self.strategy == "extra_buffer":
            last = path.gather(1, acc[:, None])[:, 0]
            self.conv[:, slots] = self.stash["node_conv"][:, slots, last]
            self.ssm[:, slots] = self.stash["node_ssm"][:, slots, last].to(self.ssm_dtype)
        else:
            self._replay(slots, path, acc)

    def _replay(self, slots: Tensor, path: Tensor, acc: Tensor) -> None:
        if commit_kernel(self.ssm):
            choose("commit", True, "triton")
            from ddtree.kernels.gdn.commit_triton import commit_replay_triton

            st = self.stash
            commit_replay_triton(
                self.ssm, self.conv, st["node_x"], st["node_y"], st["node_g"], st["node_beta"],
                slots, path, acc, self.geo.hk,
            )  # fmt: skip
            return
        # the reference: gathers of the rows and the accepted stash, the replay, index_put back
        step = torch.arange(path.shape[1], device=self.device)
        keep = step[None, :] <= acc[:, None]
        nodes = torch.where(keep, path, 0)
        # the accepted rows of each request replayed as a chain 0..acc (-1 = padding)
        chain = torch.where(keep, step[None, :], -1)
        # layers in groups whose fp32 states stay under REPLAY_GROUP_BYTES: all 48 layers of a 27B-shape
        # batch-64 commit at once gathered ~10 GB per copy (and a captured graph keeps its peak)
        per_layer = path.shape[0] * self.ssm[0, 0].numel() * 4
        group = max(1, min(self.geo.num_layers, REPLAY_GROUP_BYTES // max(per_layer, 1)))
        for l0 in range(0, self.geo.num_layers, group):
            layers = slice(l0, min(l0 + group, self.geo.num_layers))
            self._replay_layers(layers, slots, nodes, chain)

    def _replay_layers(self, layers: slice, slots: Tensor, nodes: Tensor, chain: Tensor) -> None:
        """Replay one group of layers: nodes [b, P] the accepted path's node indices (0 past it),
        chain [b, P] its steps (-1 past it)."""
        geo, L = self.geo, layers.stop - layers.start
        b = nodes.shape[0]
        chain = chain.repeat(L, 1)  # [L * b, P]: gathered rows are layer-major

        def rows(name):
            t = self.stash[name][layers][:, slots[:, None], nodes]
            return t.flatten(0, 1)

        y = rows("node_y")
        kd = geo.hk * geo.dk
        q, k, v = torch.split(y, [kd, kd, geo.hv * geo.dv], dim=-1)
        q = q.unflatten(-1, (geo.hk, geo.dk))
        k = k.unflatten(-1, (geo.hk, geo.dk))
        v = v.unflatten(-1, (geo.hv, geo.dv))
        S0 = self.ssm[layers][:, slots].flatten(0, 1)
        S = replay(q, k, v, rows("node_g"), rows("node_beta"), chain, S0)
        conv = replay_conv_path(rows("node_x"), chain, self.conv[layers][:, slots].flatten(0, 1))
        self.ssm[layers, slots] = S.unflatten(0, (L, b)).to(self.ssm_dtype)
        self.conv[layers, slots] = conv.unflatten(0, (L, b))
