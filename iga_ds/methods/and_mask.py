"""AND-mask (Parascandolo et al., "Learning explanations that are hard to vary", ICLR 2021)."""
from __future__ import annotations

import torch

from iga_ds.methods.base import GradientMethod, ModuleGrads, ModuleUpdate, Statistic

AGREEMENT_STATISTICS = (
    Statistic("mask_mean", "mean", "mean of the mask over the module's elements (1: nothing masked)"),
    Statistic("mask_frac_below_half", "mean", "share of elements the mask damps below 1/2"),
)


def rescaled_masked_mean(grads: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mask * mean, divided by the kept fraction so the step size does not shrink with the mask
    (as in the authors' and DomainBed's implementations)."""
    kept = mask.sum() / mask.numel()
    return mask * grads.mean(dim=0) / (kept + 1e-10)


class ANDMask(GradientMethod):
    """Keep an element only where at least a fraction `threshold` of domains agree in sign."""

    name = "and_mask"
    scope = "module"
    paper = "Parascandolo et al., Learning explanations that are hard to vary, ICLR 2021"
    statistics = AGREEMENT_STATISTICS

    def __init__(self, threshold: float = 1.0, seed: int = 0):
        super().__init__(seed)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = float(threshold)

    def _apply(self, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        agreement = torch.sign(grads).mean(dim=0).abs()
        mask = (agreement >= self.threshold).to(grads.dtype)
        return rescaled_masked_mean(grads, mask), mask

    def combine_module(self, module: ModuleGrads, step: int) -> ModuleUpdate:
        gA, mA = self._apply(module.gA)
        gB, mB = self._apply(module.gB)
        kept = (mA.sum() + mB.sum()) / (mA.numel() + mB.numel())  # read back with every module's, by combine
        return ModuleUpdate(gA, gB, {"mask_mean": kept, "mask_frac_below_half": 1.0 - kept})
