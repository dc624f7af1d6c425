"""A bf16 node-state stash for the tree GDN kernel, and the error bound it must meet (CPU and GPU tests).

Why the bound: the kernel keeps a node's state in fp32 registers and rounds only what it stores; a
child re-reads its parent's stored state unless the parent is the node just before it. One rounding
perturbs a state by at most u * |S| per element (u = 2^-8 covers bf16 round-to-nearest and the CPU
interpreter's truncation), and every later delta-rule step maps a perturbation dS to
exp(g) (I - beta k k^T) dS (k l2-normalised, 0 <= beta <= 1): a contraction. So a node at depth d,
with at most d rounded reads on its ancestor chain and one for its own store, is off by at most
(d + 1) u max|S| in Frobenius norm, and its output (q l2-normalised, times `scale`) by d u max|S| scale.
"""

from __future__ import annotations

import torch

U = 2.0**-8


def random_tree(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A branching depth-sorted tree (parents < index; about a third of the nodes not their parent's
    next node, so the kernel re-reads stored states)."""
    par, depth = [-1], [0]
    for c in range(1, n):
        p = (
            c - 1
            if torch.rand((), generator=gen) < 0.6
            else int(torch.randint(0, c, (), generator=gen))
        )
        par.append(p)
        depth.append(depth[p] + 1)
    return torch.tensor(par), torch.tensor(depth)


def inputs(n: int, hk: int, hv: int, d: int, gen: torch.Generator, slow_decay: bool = True):
    """q, k, v, g, beta of one request ([1, n, ...]); slow decays (g near 0) on half the heads keep
    states large, the hard case for a rounded stash."""
    q = torch.randn(1, n, hk, d, generator=gen)
    k = torch.randn(1, n, hk, d, generator=gen)
    v = torch.randn(1, n, hv, d, generator=gen)
    g = -torch.rand(1, n, hv, generator=gen) * 2
    if slow_decay:
        g[..., ::2] *= 0.02
    beta = torch.rand(1, n, hv, generator=gen)
    return q, k, v, g, beta


def check_bound(st, rst, o, ro, depths, scale: float) -> float:
    """Assert the per-node bounds (module docstring); returns the largest error / bound ratio."""
    n = depths.shape[-1]
    smax = rst.float().flatten(3).norm(dim=-1).amax()  # max over nodes / heads of |S|_F
    worst = 0.0
    for i in range(n):
        dep = int(depths[0, i])
        es = (st[0, i].float() - rst[0, i]).flatten(1).norm(dim=-1).amax().item()
        eo = (o[0, i].float() - ro[0, i].float()).norm(dim=-1).amax().item()
        bs, bo = (dep + 1) * U * smax.item(), max(dep, 1) * U * smax.item() * scale
        assert es <= bs, f"node {i} (depth {dep}): state error {es:.3e} > bound {bs:.3e}"
        assert eo <= bo, f"node {i} (depth {dep}): output error {eo:.3e} > bound {bo:.3e}"
        worst = max(worst, es / bs)
    return worst
