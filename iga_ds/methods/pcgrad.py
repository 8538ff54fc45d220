"""PCGrad (Yu et al., "Gradient surgery for multi-task learning", NeurIPS 2020)."""
from __future__ import annotations

from typing import Sequence

import torch

from iga_ds.methods.base import GradientMethod, ModuleGrads, ModuleUpdate, Statistic
from iga_ds.methods.gram import domain_gram, weighted_sum


def pcgrad_weights(gram: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Weights w with PCGrad's output = sum_k w_k g_k (mean over domains of the projected g_i).

    Each projected g_i' is tracked as coefficients over the original g_k: projecting g_i'
    off g_j when they conflict only needs <g_i', g_j> = c_i . gram[:, j].
    """
    n = gram.shape[0]
    coeffs = torch.eye(n, dtype=gram.dtype)
    for i in range(n):
        order = [j for j in torch.randperm(n, generator=generator).tolist() if j != i]
        for j in order:
            dot = coeffs[i] @ gram[:, j]
            if dot < 0 and gram[j, j] > 0:
                coeffs[i, j] -= dot / gram[j, j]
    return coeffs.mean(dim=0)


class PCGrad(GradientMethod):
    """Project each domain's gradient off the others it conflicts with, in random order, then average."""

    name = "pcgrad"
    scope = "global"
    paper = "Yu et al., Gradient surgery for multi-task learning, NeurIPS 2020"
    statistics = (Statistic("conflicting_pairs", "model", "pairs of domains whose gradients point apart "
                            "(negative inner product)"),)

    def __init__(self, seed: int = 0):
        super().__init__(seed)

    def combine(self, modules: Sequence[ModuleGrads], step: int) -> list[ModuleUpdate]:
        gram = domain_gram(modules)
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % (2**63 - 1))
        weights = pcgrad_weights(gram, gen)
        conflicts = int((gram < 0).sum().item()) // 2
        return weighted_sum(modules, weights, {"conflicting_pairs": float(conflicts)})
