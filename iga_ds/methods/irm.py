"""IRMv1 (Arjovsky et al., "Invariant risk minimization", 2019)."""
from __future__ import annotations

import torch

from iga_ds.methods.base import GradientMethod
from iga_ds.methods.losses import per_domain_means


def irm_penalty(domain_losses: torch.Tensor, dummy_scale: torch.Tensor) -> torch.Tensor:
    """sum_n (d R_n / d w |_{w=1})^2, with w a scalar multiplying the logits."""
    total = domain_losses.new_zeros(())
    for risk in domain_losses:
        (grad,) = torch.autograd.grad(risk, dummy_scale, create_graph=True)
        total = total + grad.pow(2).sum()
    return total


class IRM(GradientMethod):
    """Mean risk plus lambda times the squared gradient of each domain's risk w.r.t. a dummy logit scale."""

    name = "irm"
    scope = "loss"
    paper = "Arjovsky et al., Invariant risk minimization, arXiv:1907.02893, 2019"

    def __init__(self, penalty_weight: float = 1.0, seed: int = 0):
        super().__init__(seed)
        self.penalty_weight = float(penalty_weight)

    def needs_dummy_scale(self) -> bool:
        return True

    def objective(self, sequence_losses, domain_ids, num_domains, dummy_scale=None):
        if dummy_scale is None:
            raise ValueError("IRM needs the logits multiplied by the hook's dummy_scale()")
        risks = per_domain_means(sequence_losses, domain_ids, num_domains)
        return sequence_losses.mean() + self.penalty_weight * irm_penalty(risks, dummy_scale)
