"""Paged-KV slot arithmetic shared by the kernels' references and the torch attention backend."""

from __future__ import annotations

import torch


def gather_slots(block_table_row: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Slots of logical positions [0, length) for one request."""
    pos = torch.arange(length, device=block_table_row.device)
    return block_table_row[pos // page_size] * page_size + pos % page_size
