"""SAND-mask (Shahtalebi et al., "SAND-mask: an enhanced gradient masking strategy for the
discovery of invariances in domain generalization", 2021)."""
from __future__ import annotations

import torch

from iga_ds.methods.and_mask import AGREEMENT_STATISTICS, rescaled_masked_mean
from iga_ds.methods.base import GradientMethod, ModuleGrads, ModuleUpdate


class SANDMask(GradientMethod):
    """Smoothed AND-mask: max(0, tanh(k * (|mean sign| - tau) / (gamma * var)))."""

    name = "sand_mask"
    scope = "module"
    paper = "Shahtalebi et al., SAND-mask, ICML UDL workshop 2021"
    statistics = AGREEMENT_STATISTICS

    def __init__(self, tau: float = 0.5, k: float = 10.0, gamma: float = 1.0, seed: int = 0):
        super().__init__(seed)
        self.tau, self.k, self.gamma = float(tau), float(k), float(gamma)

    def mask(self, grads: torch.Tensor) -> torch.Tensor:
        agreement = torch.sign(grads).mean(dim=0).abs()
        # Sample variance (the authors' torch.var); a zero variance means perfect agreement in
        # magnitude, which the tiny floor turns into a saturated tanh.
        var = grads.var(dim=0, unbiased=True).clamp_min(1e-17)
        mask = torch.tanh(self.k * (agreement - self.tau) / (self.gamma * var))
        return mask.clamp_min(0)

    def combine_module(self, module: ModuleGrads, step: int) -> ModuleUpdate:
        mA, mB = self.mask(module.gA), self.mask(module.gB)
        gA = rescaled_masked_mean(module.gA, mA)
        gB = rescaled_masked_mean(module.gB, mB)
        # tensors, read back for all modules at once by combine
        mean = (mA.sum() + mB.sum()) / (mA.numel() + mB.numel())
        below = ((mA < 0.5).sum() + (mB < 0.5).sum()) / (mA.numel() + mB.numel())
        return ModuleUpdate(gA, gB, {"mask_mean": mean, "mask_frac_below_half": below})
