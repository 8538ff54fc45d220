"""Ablations of IGA (the paper's Table 3): each changes one step of the update."""
from __future__ import annotations

import torch

from iga_ds.methods.base import ModuleGrads, ModuleUpdate
from iga_ds.methods.iga.method import MaskedProjectionMethod
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
    projection = "chain"


class MeanNoMask(MaskedProjectionMethod):
    """The reconstructed mean projected to rank r, no mask: what IGA is at tau = 0.

    Differs from ERM by the projection (ERM's factor gradients need not come from a rank-r
    truncation of their reconstruction).
    """

    name = "mean_no_mask"
    paper = "IGA ablation (tau -> 0 with the projection kept)"
    mask_kind = "none"


class IGALoRASpace(MaskedProjectionMethod):
    """The variance mask applied to gA and gB directly, without reconstruction or SVD."""

    name = "iga_lora_space"
    paper = "IGA ablation (Table 3: mask in LoRA space only)"

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
