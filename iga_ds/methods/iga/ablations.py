"""Ablations of IGA (the paper's Table 3): each changes one step of the update."""
from __future__ import annotations

import torch

from iga_ds.methods.base import ModuleGrads, ModuleUpdate
from iga_ds.methods.iga.common import DEFAULT_DAMPING, DEFAULT_FACTORS, DEFAULT_NORMALIZE, DEFAULT_PROJECTION
from iga_ds.methods.iga.method import IGA, MaskedProjectionMethod
from iga_ds.methods.iga.reference import mask_stats, normalize_variance


class IGABinaryMask(MaskedProjectionMethod):
    """IGA with a hard mask: keep an element where exp(-tau V') >= 1/2, drop it otherwise."""

    name = "iga_binary"
    paper = "IGA ablation (Table 3: binary mask)"
    mask_kind = "binary"


class IGANoProjection(MaskedProjectionMethod):
    """IGA without the SVD: the masked matrix reaches the factors by the chain rule,
    dB = s * g @ A^T, dA = s * B^T @ g, as if it were the gradient with respect to dW."""

    name = "iga_no_projection"
    paper = "IGA ablation (Table 3: no SVD projection)"
    fixed_projection = "chain"


class MeanNoMask(IGA):
    """The reconstructed mean projected back to the factors, no mask: what IGA is at tau = 0.

    With the default ``tangent`` projection this is ERM exactly; with ``projection: svd`` it
    isolates what the rank-r truncation and the factor map do without the mask. It runs IGA's
    paths (the fused one on GPUs) at tau = 0, where the mask is exactly one.
    """

    name = "mean_no_mask"
    paper = "IGA ablation (tau -> 0 with the projection kept)"
    mask_kind = "none"

    def __init__(self, rank: int | None = None, svd: str = "randomized", oversample: int = 10, power_iters: int = 2,
                 seed: int = 0, implementation: str = "auto", precision: str = "auto", factors: str = DEFAULT_FACTORS,
                 projection: str = DEFAULT_PROJECTION, damping: float = DEFAULT_DAMPING):
        super().__init__(0.0, DEFAULT_NORMALIZE, rank, svd, oversample, power_iters, seed, implementation, precision,
                         factors, projection, damping)


class IGALoRASpace(MaskedProjectionMethod):
    """The variance mask applied to gA and gB directly, without reconstruction or SVD."""

    name = "iga_lora_space"
    paper = "IGA ablation (Table 3: mask in LoRA space only)"
    variances = ("batch",)  # its mask is of gA and gB themselves, not of reconstructions

    def combine_module(self, module: ModuleGrads, step: int) -> ModuleUpdate:
        out, masks, variances = [], [], []
        for g in (module.gA, module.gB):
            mean = g.mean(dim=0)
            var = g.var(dim=0, unbiased=False)
            mask = torch.exp(-self.tau * normalize_variance(var, mean, self.normalize))
            out.append(mean * mask)
            masks.append(mask.reshape(-1))
            variances.append(var.reshape(-1))
        # the module's figures in IGA's keys, over both factors' elements together
        return ModuleUpdate(out[0], out[1], mask_stats(torch.cat(masks), torch.cat(variances)))
