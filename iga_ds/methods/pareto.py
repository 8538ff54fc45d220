"""Pareto-GS: the min-norm point of the convex hull of domain gradients (MGDA; Désidéri 2012,
Sener and Koltun, "Multi-task learning as multi-objective optimization", NeurIPS 2018)."""
from __future__ import annotations

from typing import Sequence

import torch

from iga_ds.methods.base import GradientMethod, ModuleGrads, ModuleUpdate, Statistic
from iga_ds.methods.gram import domain_gram, weighted_sum


def min_norm_weights(gram: torch.Tensor, max_iter: int = 250, tol: float = 1e-10) -> torch.Tensor:
    """Frank-Wolfe on min_w w^T G w over the simplex, with exact line search."""
    n = gram.shape[0]
    w = torch.full((n,), 1.0 / n, dtype=gram.dtype)
    for _ in range(max_iter):
        grad = gram @ w
        t = int(torch.argmin(grad))
        # segment from w to vertex e_t: minimize ||(1-g) v + g u||^2 with v = G w, u = g_t
        vv = w @ grad
        uv = grad[t]
        uu = gram[t, t]
        denom = vv - 2 * uv + uu
        if denom <= 0:
            break
        gamma = float(((vv - uv) / denom).clamp(0.0, 1.0))
        if gamma < tol:
            break
        w = (1 - gamma) * w
        w[t] += gamma
    return w


class ParetoGS(GradientMethod):
    """Step along the min-norm convex combination of domain gradients (a common descent direction)."""

    name = "pareto"
    scope = "global"
    paper = "Sener and Koltun, Multi-task learning as multi-objective optimization, NeurIPS 2018"
    statistics = (Statistic("weight_<n>", "model", "the min-norm combination's weight of domain n (0-based)"),)

    def __init__(self, max_iter: int = 250, seed: int = 0):
        super().__init__(seed)
        self.max_iter = int(max_iter)

    def combine(self, modules: Sequence[ModuleGrads], step: int) -> list[ModuleUpdate]:
        weights = min_norm_weights(domain_gram(modules), self.max_iter)
        stats = {f"weight_{i}": float(w) for i, w in enumerate(weights)}
        return weighted_sum(modules, weights, stats)
