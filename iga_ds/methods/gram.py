"""Methods that weigh whole per-domain gradient vectors need only their Gram matrix.

A domain's gradient vector is the concatenation of its LoRA factor gradients over all
modules. PCGrad and MGDA output a linear combination sum_n w_n g_n whose weights depend on
inner products alone, so the N x N Gram matrix (summed module by module) is all they need.
"""
from __future__ import annotations

from typing import Sequence

import torch

from iga_ds.methods.base import ModuleGrads, ModuleUpdate


def domain_gram(modules: Sequence[ModuleGrads]) -> torch.Tensor:
    """G[i, j] = <g_i, g_j> over all modules, accumulated in float64."""
    n = modules[0].num_domains
    gram = torch.zeros(n, n, dtype=torch.float64)
    for m in modules:
        for g in (m.gA, m.gB):
            flat = g.reshape(n, -1).double()
            gram += (flat @ flat.mT).cpu()
    return gram


def weighted_sum(modules: Sequence[ModuleGrads], weights: torch.Tensor, stats: dict[str, float]) -> list[ModuleUpdate]:
    out = []
    for m in modules:
        w = weights.to(device=m.gA.device, dtype=m.gA.dtype)
        out.append(
            ModuleUpdate(
                torch.einsum("n,n...->...", w, m.gA),
                torch.einsum("n,n...->...", w, m.gB),
                dict(stats),
            )
        )
    return out
