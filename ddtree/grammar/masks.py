"""Next-token bitmasks on the device: [rows, words] int32, bit t % 32 of word t // 32 set = token t
allowed (xgrammar's layout). `apply_bitmask` sets the forbidden logits to -inf in place: xgrammar's
kernel on CUDA, `apply_bitmask_reference` (plain PyTorch, the oracle) elsewhere or with
`DDTREE_REFERENCE=grammar_mask`."""

from __future__ import annotations

import logging
import sys

import numpy as np
import torch

from ddtree import envs


def unpack(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool."""
    if masks.device.type == "cpu" and sys.byteorder == "little":  # ~10x the ops below there
        bits = np.unpackbits(masks.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)[..., :vocab]
    return unpack_torch(masks, vocab)


def unpack_torch(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """`unpack` in device ops (any device, any byte order)."""
    # bit j as an int32 (1 << 31 wraps to -2**31: the same bit in two's complement)
    bit = torch.tensor([1 << j if j < 31 else -(2**31) for j in range(32)], dtype=torch.int32)
    bits = (masks[..., None] & bit.to(masks.device)) != 0
    return bits.flatten(-2)[..., :vocab]


def apply_bitmask_reference(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """logits [rows, V] (any float dtype), masks [rows, words] on its device: in place."""
    logits.masked_fill_(~unpack(masks, logits.shape[-1]), float("-inf"))


_KERNEL_FAILED: list[str] = []  # xgrammar's kernel could not run here (the reason, once)


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """logits [rows, V] fp32 contiguous, masks [rows, words] on its device: in place. A kernel
    that cannot build or launch on this machine (its JIT needs a toolchain) falls back to the
    reference for the process, with one warning."""
    use_kernel = logits.device.type == "cuda" and not envs.REFERENCE.has("grammar_mask")
    if use_kernel and not _KERNEL_FAILED:
        try:
            import xgrammar

            xgrammar.apply_token_bitmask_inplace(logits, masks, vocab_size=logits.shape[-1])
            return
        except Exception as e:  # noqa: BLE001 - the reference computes the same
            _KERNEL_FAILED.append(f"{type(e).__name__}: {e}")
            logging.getLogger("ddtree").warning(
                "xgrammar's bitmask kernel failed (%s); using the PyTorch reference", e
            )
    apply_bitmask_reference(logits, masks)
