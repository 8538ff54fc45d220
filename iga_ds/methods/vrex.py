"""V-REx (Krueger et al., "Out-of-distribution generalization via risk extrapolation", ICML 2021)."""
from __future__ import annotations

import torch

from iga_ds.methods.base import GradientMethod
from iga_ds.methods.losses import per_domain_means


def vrex_penalty(domain_losses: torch.Tensor) -> torch.Tensor:
    """Population variance of the per-domain risks."""
    return (domain_losses - domain_losses.mean()).pow(2).mean()


class VREx(GradientMethod):
    """Mean risk plus beta times the variance of per-domain risks."""

    name = "vrex"
    scope = "loss"
    paper = "Krueger et al., Out-of-distribution generalization via risk extrapolation, ICML 2021"

    def __init__(self, penalty_weight: float = 1.0, seed: int = 0):
        super().__init__(seed)
        self.penalty_weight = float(penalty_weight)

    def objective(self, sequence_losses, domain_ids, num_domains, dummy_scale=None):
        risks = per_domain_means(sequence_losses, domain_ids, num_domains)
        return sequence_losses.mean() + self.penalty_weight * vrex_penalty(risks)
