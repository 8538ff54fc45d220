"""Ablations of IGA (the paper's Table 3): each changes one step of the update."""
from __future__ import annotations

import torch

from iga_ds.methods import register
from iga_ds.methods.base import ModuleGrads, ModuleUpdate
from iga_ds.methods.iga import _MaskedProjectionMethod, mask_stats, normalize_variance


@register
class IGABinaryMask(_MaskedProjectionMethod):
    """IGA with a hard mask: keep an element where exp(-tau V') >= 1/2, drop it otherwise."""

    name = "iga_binary"
    paper = "IGA ablation (Table 3: binary mask)"
    mask_kind = "binary"


@register
class IGANoProjection(_MaskedProjectionMethod):
    """IGA without the SVD: the masked matrix reaches the factors by the chain rule,
    dB = s * g @ A^T, dA = s * B^T @ g, as if it were the gradient with respect to dW."""

    name = "iga_no_projection"
    paper = "IGA ablation (Table 3: no SVD projection)"
    projection = "chain"


@register
class MeanNoMask(_MaskedProjectionMethod):
    """The reconstructed mean projected to rank r, no mask: what IGA is at tau = 0.

    Differs from ERM by the projection (ERM's factor gradients need not come from a rank-r
    truncation of their reconstruction).
    """

    name = "mean_no_mask"
    paper = "IGA ablation (tau -> 0 with the projection kept)"
    mask_kind = "none"


@register
class IGALoRASpace(_MaskedProjectionMethod):
    """The variance mask applied to gA and gB directly, without reconstruction or SVD."""

    name = "iga_lora_space"
    paper = "IGA ablation (Table 3: mask in LoRA space only)"

    def combine_module(self, module: ModuleGrads, step: int) -> ModuleUpdate:
        out, stats = [], {}
        for label, g in (("A", module.gA), ("B", module.gB)):
            mean = g.mean(dim=0)
            var = g.var(dim=0, unbiased=False)
            mask = torch.exp(-self.tau * normalize_variance(var, mean, self.normalize))
            out.append(mean * mask)
            stats.update({f"{k}_{label}": v for k, v in mask_stats(mask, var).items()})
        # whole-module summary in the same keys as IGA, weighted by element count
        nA, nB = module.gA[0].numel(), module.gB[0].numel()
        for key in ("mask_mean", "mask_frac_below_half"):
            stats[key] = (stats[f"{key}_A"] * nA + stats[f"{key}_B"] * nB) / (nA + nB)
        stats["mask_min"] = min(stats["mask_min_A"], stats["mask_min_B"])
        stats["gir"] = stats["gir_A"] + stats["gir_B"]
        return ModuleUpdate(out[0], out[1], stats)
