"""IGA for one LoRA module, step by step: the reference every faster path is tested against.

PEFT layout: lora_A.weight is r x in, lora_B.weight is out x r, dW = s * B @ A. A step
(dA, dB) changes dW, to first order, by s * (dB @ A + B @ dA); that is the reconstruction
G[n] of a domain's factor gradients. (The paper's g^B A^T + B^T g^A does not type-check.)
The update: mean Gbar and population variance V of the G[n], mask exp(-tau V'), rank-r
truncation of Gbar * mask, factor gradients from the truncation.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from iga_ds.methods.iga.common import FACTOR_MAPS, NORMALIZATIONS, SNR_EPS, check_choice, check_module, check_tau
from iga_ds.methods.iga.rsvd import truncated_svd
from iga_ds.methods.iga.sketch import SketchKey

Normalize = Literal["none", "mean", "snr"]


def reconstruct(A: torch.Tensor, B: torch.Tensor, gA: torch.Tensor, gB: torch.Tensor, scaling: float) -> torch.Tensor:
    """G = s * (gB @ A + B @ gA); broadcasts over a leading domain dimension of gA, gB."""
    return scaling * (gB @ A + B @ gA)


def mean_and_variance(
    A: torch.Tensor, B: torch.Tensor, gA: torch.Tensor, gB: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over domains of G[n] and the per-element population variance (1/N).

    Reconstruction is linear, so the mean is the reconstruction of the mean factor
    gradients. The variance accumulates one domain at a time: at most three out x in
    matrices are alive, whatever N.
    """
    gA_mean = gA.mean(dim=0)
    gB_mean = gB.mean(dim=0)
    mean = reconstruct(A, B, gA_mean, gB_mean, scaling)
    var = torch.zeros_like(mean)
    for n in range(gA.shape[0]):
        dev = reconstruct(A, B, gA[n] - gA_mean, gB[n] - gB_mean, scaling)
        var.addcmul_(dev, dev)
    var.div_(gA.shape[0])
    return mean, var


def normalize_variance(var: torch.Tensor, mean: torch.Tensor, normalize: str) -> torch.Tensor:
    """V' for the mask exp(-tau V').

    ``none`` is the paper taken literally: at LLM gradient scale V is ~1e-10 and the mask is 1.
    ``mean`` divides by the module's mean variance, so tau acts on relative disagreement.
    ``snr`` divides by the squared mean gradient: disagreement relative to the signal.
    """
    if normalize == "none":
        return var
    if normalize == "mean":
        scale = var.mean()
        return var / scale if scale > 0 else torch.zeros_like(var)
    if normalize == "snr":
        sq = mean * mean
        eps = SNR_EPS * sq.mean() + torch.finfo(var.dtype).tiny
        return var / (sq + eps)
    raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")


def mask_stats(mask: torch.Tensor, var: torch.Tensor) -> dict[str, float]:
    return {
        "mask_mean": float(mask.mean()),
        "mask_frac_below_half": float((mask < 0.5).float().mean()),
        "mask_min": float(mask.min()),
        "gir": float(var.sum()),
    }


def factors_from_svd(
    U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, r: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """gB = U S^1/2 / sqrt(s), gA = S^1/2 Vh / sqrt(s): s * gB @ gA = U S Vh.

    The scaling is split evenly between the factors; rank below r pads with zeros.
    """
    root = S.clamp_min(0).sqrt() / math.sqrt(scaling)
    gB = U * root
    gA = root[:, None] * Vh
    k = S.shape[0]
    if k < r:
        gB = torch.cat([gB, gB.new_zeros(gB.shape[0], r - k)], dim=1)
        gA = torch.cat([gA, gA.new_zeros(r - k, gA.shape[1])], dim=0)
    return gA, gB


def chain_rule_factors(A, B, gA_split, gB_split, scaling):
    """Factor gradients of the rank-r direction g~ = s gB_split gA_split by the chain rule through
    dW = s B A: dB = s g~ A^T, dA = s B^T g~, computed from the factors (no out x in matrix).
    Batched over leading dimensions (``scaling`` then broadcasts, e.g. M x 1 x 1).

    Unlike the split U S^1/2, S^1/2 V^T, a factor step along these changes dW, to first order,
    by s^2 (g~ A^T A + B B^T g~): a positive semi-definite map of g~.
    """
    gB = (scaling * scaling) * gB_split @ (gA_split @ A.mT)
    gA = (scaling * scaling) * (B.mT @ gB_split) @ gA_split
    return gA, gB


def masked_projection(
    A, B, gA, gB, *, scaling, tau, rank, normalize, svd, oversample, power_iters, generator,
    mask_kind: str = "continuous", binary_threshold: float = 0.5, projection: str = "svd",
    factors: str = "split",
):
    """IGA with the step that its ablations change made explicit: the mask (``continuous``,
    ``binary`` or ``none``) and the projection (rank-r ``svd`` or the ``chain`` rule without
    truncation). Returns (gA_new, gB_new, stats)."""
    rank = check_module(A, B, gA, gB, rank)
    r = A.shape[0]
    mean, var = mean_and_variance(A, B, gA, gB, scaling)
    if mask_kind == "none":
        mask = torch.ones_like(mean)
    else:
        soft = torch.exp(-tau * normalize_variance(var, mean, normalize))
        mask = (soft >= binary_threshold).to(mean.dtype) if mask_kind == "binary" else soft
    stats = mask_stats(mask, var)
    masked = mean * mask
    del mean, var

    total = float(masked.pow(2).sum())
    if projection == "chain":
        # Treat the masked matrix as dL/d(dW): chain rule through dW = s * B @ A.
        gB_new = scaling * masked @ A.mT
        gA_new = scaling * B.mT @ masked
        stats["energy_kept"] = 1.0
        return gA_new, gB_new, stats
    U, S, Vh = truncated_svd(
        masked, rank, method=svd, oversample=oversample, power_iters=power_iters, generator=generator
    )
    stats["energy_kept"] = float(S.double().pow(2).sum() / total) if total > 0 else 1.0
    gA_new, gB_new = factors_from_svd(U, S, Vh, r, scaling)
    if factors == "chain_rule":
        gA_new, gB_new = chain_rule_factors(A, B, gA_new, gB_new, scaling)
    return gA_new, gB_new, stats


def iga_update(
    A: torch.Tensor,
    B: torch.Tensor,
    gA: torch.Tensor,
    gB: torch.Tensor,
    *,
    scaling: float,
    tau: float = 0.5,
    rank: int | None = None,
    normalize: Normalize = "snr",
    svd: Literal["randomized", "single_pass", "exact"] = "randomized",
    oversample: int = 10,
    power_iters: int = 2,
    generator: SketchKey | torch.Generator | None = None,
    factors: Literal["split", "chain_rule"] = "split",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The IGA update of one LoRA module.

    A: r x in, B: out x r, gA: N x r x in, gB: N x out x r (per-domain mean gradients).
    Returns (gA_new, gB_new, stats). With ``factors="split"`` (the paper's form)
    ``scaling * gB_new @ gA_new`` equals the rank-``rank`` truncation g~ of
    mean_n G[n] * exp(-tau * V'), G[n] = scaling * (gB[n] @ A + B @ gA[n]); with
    ``"chain_rule"`` they are the factor gradients of g~ through dW = s B A
    (:func:`chain_rule_factors`, what the registered ``iga`` method trains with).
    Computes in the dtype it is given. ``generator``: the sketch's source, a
    :class:`iga_ds.methods.iga.sketch.SketchKey` (the method's, one per module and step) or a
    ``torch.Generator``.
    """
    check_choice(normalize, NORMALIZATIONS, "normalize")
    check_choice(factors, FACTOR_MAPS, "factors")
    check_tau(tau)
    return masked_projection(
        A, B, gA, gB, scaling=scaling, tau=tau, rank=rank, normalize=normalize, svd=svd,
        oversample=oversample, power_iters=power_iters, generator=generator, factors=factors,
    )
