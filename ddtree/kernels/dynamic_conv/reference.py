"""Plain PyTorch reference of DFlash2's grouped dynamic causal convolution (the oracle for
`triton.py` and the CPU / training path).

Within each block of `block_size` rows, output row t of channel c in group g = c // group_size is
    y[t, c] = sum_{o < k, o <= t % block_size} (base[o, c] + dyn[t, o, g]) * x[t - o, c]
(z-lab's `_grouped_dynamic_convolve`: a causal convolution over the block's positions whose taps
are a per-channel base kernel plus a per-row, per-group dynamic offset). Products and the sum are
taken in fp32 and rounded once to x's dtype.
"""

from __future__ import annotations

import torch


def dynamic_conv_reference(
    x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group_size: int, block_size: int
) -> torch.Tensor:
    """x [..., L, H] (L a multiple of block_size: whole blocks), dyn [..., L, k * G] laid out (tap,
    group), base [k, H] -> y [..., L, H] in x's dtype."""
    *lead, L, H = x.shape
    k = base.shape[0]
    G = H // group_size
    xb = x.float().reshape(-1, L // block_size, block_size, G, group_size)
    db = dyn.float().reshape(-1, L // block_size, block_size, k, G)
    bb = base.float().view(k, G, group_size)
    y = torch.zeros_like(xb)
    for o in range(min(k, block_size)):
        coef = bb[o] + db[:, :, o:, o, :, None]  # [N, A, S - o, G, g]
        y[:, :, o:] += coef * xb[:, :, : block_size - o]
    return y.view(*lead, L, H).to(x.dtype)
