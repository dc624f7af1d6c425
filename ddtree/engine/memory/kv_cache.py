"""Paged KV pools: one [num_layers, num_slots, kv_heads, head_dim] K and V tensor pair per model."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype, device
    ):
        shape = (num_layers, num_slots, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows src -> dst in every layer. The gather completes before the scatter, so overlapping
        ranges are safe; duplicate dst entries must carry identical values."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
