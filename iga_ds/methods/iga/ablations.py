"""Ablations of IGA (the paper's Table 3): each changes one step of the update."""
from __future__ import annotations

import torch

from iga_ds.methods.base import ModuleGrads, ModuleUpdate
from iga_ds.methods.iga.method import IGA, MASK_STATISTICS, MaskedProjectionMethod
from iga_ds.methods.iga.options import OPTION_NAMES
from iga_ds.methods.iga.reference import mask_stats, normalize_variance

# the mask's own options, which every masked ablation takes
MASK_OPTIONS = ("tau", "normalize", "variance", "variance_decay")
# the batched path's switches, which only the methods that run it take
BATCHED_OPTIONS = ("implementation", "precision")


class IGABinaryMask(MaskedProjectionMethod):
    """IGA with a hard mask: keep an element where exp(-tau V') >= 1/2, drop it otherwise."""

    name = "iga_binary"
    paper = "IGA ablation (Table 3: binary mask)"
    mask_kind = "binary"
    takes = tuple(name for name in OPTION_NAMES if name not in BATCHED_OPTIONS)  # the reference path only


class IGANoProjection(MaskedProjectionMethod):
    """IGA without the SVD: the masked matrix reaches the factors by the chain rule,
    dB = s * g @ A^T, dA = s * B^T @ g, as if it were the gradient with respect to dW."""

    name = "iga_no_projection"
    paper = "IGA ablation (Table 3: no SVD projection)"
    takes = MASK_OPTIONS
    fixes = {"projection": "chain"}


class MeanNoMask(IGA):
    """The reconstructed mean projected back to the factors, no mask: what IGA is at tau = 0.

    With the default ``tangent`` projection this is ERM exactly (so it takes no ``damping``);
    with ``projection: svd`` it isolates what the rank-r truncation and the factor map do
    without the mask. It runs IGA's paths (the fused one on GPUs) at tau = 0, where the mask
    is exactly one.
    """

    name = "mean_no_mask"
    paper = "IGA ablation (tau -> 0 with the projection kept)"
    mask_kind = "none"
    # no mask: nothing for the mask's options to act on, nor for the tangent projection's ridge
    # (at tau = 0 it returns ERM's gradients whatever the damping)
    takes = tuple(name for name in OPTION_NAMES if name not in (*MASK_OPTIONS, "damping"))
    fixes = {"tau": 0.0}


class IGALoRASpace(MaskedProjectionMethod):
    """The variance mask applied to gA and gB directly, without reconstruction or SVD."""

    name = "iga_lora_space"
    paper = "IGA ablation (Table 3: mask in LoRA space only)"
    # its mask is of gA and gB themselves: no reconstruction, no projection, this step's variance
    takes = ("tau", "normalize")
    fixes = {"variance": "batch"}
    statistics = tuple(s for s in MASK_STATISTICS if s.name != "energy_kept")  # nothing is projected

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
