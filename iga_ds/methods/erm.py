"""ERM, the plain mean gradient: DeepSpeed's own path, or reduced once per optimizer step."""
from __future__ import annotations

from typing import Sequence

import torch

from iga_ds.methods.base import GradientMethod, ModuleGrads, ModuleUpdate, Statistic


class ERM(GradientMethod):
    """Empirical risk minimization (Vapnik, 1998): mean loss over all instances."""

    name = "erm"
    scope = "loss"
    paper = "Vapnik, The Nature of Statistical Learning Theory, 1998"

    def __init__(self, seed: int = 0):
        super().__init__(seed)


class CapturedERM(GradientMethod):
    """ERM (Vapnik, 1998) through the engine hook's capture: the same mean gradient, reduced once
    per optimizer step.

    Under ZeRO-2 with gradient accumulation DeepSpeed reduces the LoRA gradients after every
    micro-batch; the capture sums them per domain in the backward and the hook reduces once at
    the boundary. In an isomer batch every domain holds as many instances, so the mean of the
    per-domain means is the mean over all instances: the same update as ``erm``, up to float
    rounding, on another schedule of collectives (docs/PERFORMANCE.md measures both).
    """

    name = "erm_captured"
    scope = "module"
    paper = "Vapnik, The Nature of Statistical Learning Theory, 1998"
    statistics = (Statistic("domain_spread", "mean", "root mean square of the per-domain factor gradients' "
                            "deviations from their mean, over the mean's norm (0: every domain agrees)"),)

    def combine(self, modules: Sequence[ModuleGrads], step: int) -> list[ModuleUpdate]:
        # modules of one shape as one stacked tensor: a handful of kernels for all of them, not
        # a handful per module (the whole method is this arithmetic and its launches)
        groups: dict[tuple, list[int]] = {}
        for i, m in enumerate(modules):
            groups.setdefault((m.gA.shape, m.gB.shape, m.gA.dtype, m.gA.device), []).append(i)
        means: list = [None] * len(modules)
        spreads: list = [None] * len(modules)
        for idx in groups.values():
            gA, gB = torch.stack([modules[i].gA for i in idx]), torch.stack([modules[i].gB for i in idx])
            mA, mB = gA.mean(dim=1), gB.mean(dim=1)
            for j, (i, spread) in enumerate(zip(idx, _spreads(gA, gB, mA, mB))):
                means[i], spreads[i] = (mA[j], mB[j]), spread
        values = torch.stack(spreads).tolist() if spreads else []  # one device-to-host copy, not one per module
        return [ModuleUpdate(gA, gB, {"domain_spread": v}) for (gA, gB), v in zip(means, values)]

    def combine_module(self, module: ModuleGrads, step: int) -> ModuleUpdate:
        return self.combine([module], step)[0]


def _spreads(gA: torch.Tensor, gB: torch.Tensor, mA: torch.Tensor, mB: torch.Tensor) -> torch.Tensor:
    """Per module of a stack (M x N x ...): sqrt(mean over n of ||g[n] - mean||^2 / ||mean||^2)."""
    deviation = ((gA - mA.unsqueeze(1)).double().pow(2).sum(dim=(1, 2, 3))
                 + (gB - mB.unsqueeze(1)).double().pow(2).sum(dim=(1, 2, 3)))
    mean = mA.double().pow(2).sum(dim=(1, 2)) + mB.double().pow(2).sum(dim=(1, 2))
    ratio = deviation / gA.shape[1] / torch.where(mean > 0, mean, 1)
    return torch.where(mean > 0, ratio.sqrt(), 0.0)
