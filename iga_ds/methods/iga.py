"""IGA: variance-masked mean of reconstructed per-domain LoRA gradients, projected to rank r.

Invariant Gradient Alignment (the paper this package implements; not DomainBed's
Inter-environmental Gradient Alignment of Koyama and Yamaguchi, 2020).
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from iga_ds.lora.reconstruct import mean_and_variance
from iga_ds.lora.rsvd import SVD_METHODS, truncated_svd
from iga_ds.methods import register
from iga_ds.methods.base import GradientMethod, ModuleGrads, ModuleUpdate, module_generator

Normalize = Literal["none", "mean", "snr"]
NORMALIZATIONS = ("none", "mean", "snr")
# snr: V / (Gbar^2 + eps), eps relative to the module's mean Gbar^2 so it means the same at any gradient scale
SNR_EPS = 1e-6


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


def _iga_core(
    A, B, gA, gB, *, scaling, tau, rank, normalize, svd, oversample, power_iters, generator,
    mask_kind: str = "continuous", binary_threshold: float = 0.5, projection: str = "svd",
):
    """The steps shared by IGA and its ablations (mask kind, projection kind)."""
    if gA.ndim != 3 or gB.ndim != 3 or gA.shape[0] != gB.shape[0]:
        raise ValueError(f"gA must be N x r x in and gB N x out x r, got {tuple(gA.shape)} and {tuple(gB.shape)}")
    r = A.shape[0]
    if tuple(gA.shape[1:]) != tuple(A.shape) or tuple(gB.shape[1:]) != tuple(B.shape) or B.shape[1] != r:
        raise ValueError(
            f"shapes disagree: A {tuple(A.shape)}, B {tuple(B.shape)}, gA {tuple(gA.shape)}, gB {tuple(gB.shape)}"
        )
    rank = r if rank is None else int(rank)
    if not 1 <= rank <= r:
        raise ValueError(f"rank must be in [1, {r}] (the LoRA rank), got {rank}")

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
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The IGA update of one LoRA module.

    A: r x in, B: out x r, gA: N x r x in, gB: N x out x r (per-domain mean gradients).
    Returns (gA_new, gB_new, stats) with ``scaling * gB_new @ gA_new`` equal to the rank-``rank``
    truncation of mean_n G[n] * exp(-tau * V'), G[n] = scaling * (gB[n] @ A + B @ gA[n]).
    Computes in the dtype it is given.
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    return _iga_core(
        A, B, gA, gB, scaling=scaling, tau=tau, rank=rank, normalize=normalize, svd=svd,
        oversample=oversample, power_iters=power_iters, generator=generator,
    )


FACTOR_MAPS = ("split", "chain_rule")


def chain_rule_factors(A, B, gA_split, gB_split, scaling):
    """Factor gradients of the rank-r direction g~ = s gB_split gA_split by the chain rule through
    dW = s B A: dB = s g~ A^T, dA = s B^T g~, computed from the factors (no out x in matrix).

    Unlike the split U S^1/2, S^1/2 V^T, a factor step along these changes dW, to first order,
    by s^2 (g~ A^T A + B B^T g~): a positive semi-definite map of g~.
    """
    gB = (scaling * scaling) * gB_split @ (gA_split @ A.mT)
    gA = (scaling * scaling) * (B.mT @ gB_split) @ gA_split
    return gA, gB


class _MaskedProjectionMethod(GradientMethod):
    """IGA and the ablations that share its parameters; subclasses pick mask and projection.

    ``factors``: how the rank-r matrix g~ becomes factor gradients. ``chain_rule`` (default)
    maps g~ through dW = s B A like a gradient; ``split`` is the paper's (gB = U S^1/2,
    gA = S^1/2 V^T, scaled so that s gB gA = g~). In this project's runs ``split`` made
    training diverge on every seed (the loss rose after about 100 steps, also without the
    mask) while ``chain_rule`` trained like ERM: see docs/METHOD_NOTES.md.
    """

    scope = "module"
    mask_kind = "continuous"
    projection = "svd"

    def __init__(
        self,
        tau: float = 0.5,
        normalize: Normalize = "snr",
        rank: int | None = None,
        svd: str = "randomized",
        oversample: int = 10,
        power_iters: int = 2,
        seed: int = 0,
        factors: str = "chain_rule",
    ):
        super().__init__(seed)
        if factors not in FACTOR_MAPS:
            raise ValueError(f"factors must be one of {FACTOR_MAPS}, got {factors!r}")
        self.factors = factors
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
        if svd not in SVD_METHODS:
            raise ValueError(f"svd must be one of {SVD_METHODS}, got {svd!r}")
        if tau < 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        self.tau, self.normalize, self.rank = float(tau), normalize, rank
        self.svd, self.oversample, self.power_iters = svd, int(oversample), int(power_iters)

    def combine_module(self, module: ModuleGrads, step: int) -> ModuleUpdate:
        gen = None
        if self.svd != "exact" and self.projection == "svd":  # sketched: seeded per step and module
            gen = module_generator(self.seed, step, module.index, module.gA.device)
        gA, gB, stats = _iga_core(
            module.A, module.B, module.gA, module.gB, scaling=module.scaling, tau=self.tau, rank=self.rank,
            normalize=self.normalize, svd=self.svd, oversample=self.oversample, power_iters=self.power_iters,
            generator=gen, mask_kind=self.mask_kind, projection=self.projection,
        )
        return ModuleUpdate(*self._map_factors(module, gA, gB), stats)

    def _map_factors(self, module: ModuleGrads, gA, gB):
        if self.factors == "chain_rule" and self.projection == "svd":
            return chain_rule_factors(module.A, module.B, gA, gB, module.scaling)
        return gA, gB


IMPLEMENTATIONS = ("auto", "reference", "fused")


@register
class IGA(_MaskedProjectionMethod):
    """Invariant Gradient Alignment: exp(-tau V') mask on reconstructed gradients, rank-r SVD projection.

    ``implementation``: ``reference`` runs :func:`iga_update` module by module; ``fused`` runs
    :func:`iga_ds.lora.fused.batched_iga` (same result up to rounding, no N full-rank
    matrices, modules of equal shape batched); ``auto`` takes ``fused`` on CUDA.
    ``precision``: ``tf32`` lets the fused CUDA path use TF32 tensor cores for the
    reconstruction and the power iterations (faster, about 1e-3 relative error; see
    docs/PERFORMANCE.md); ``ieee`` keeps float32 throughout.
    ``svd``: ``randomized`` (default; HMT with ``power_iters`` power iterations), ``exact``
    (full SVD, reference path only) or ``single_pass`` (Tropp et al. 2017: both sketches in
    one pass, no power iterations; on the fused path the masked matrices are never stored,
    at a larger rank-r error unless ``oversample`` is raised; docs/PERFORMANCE.md).
    """

    name = "iga"
    paper = "Invariant Gradient Alignment (IGA) for logical isomers (this package's paper)"

    def __init__(self, tau: float = 0.5, normalize: Normalize = "snr", rank: int | None = None,
                 svd: str = "randomized", oversample: int = 10, power_iters: int = 2, seed: int = 0,
                 implementation: str = "auto", precision: str = "ieee", factors: str = "chain_rule"):
        super().__init__(tau, normalize, rank, svd, oversample, power_iters, seed, factors)
        if precision not in ("ieee", "tf32"):
            raise ValueError(f"precision must be 'ieee' or 'tf32', got {precision!r}")
        self.precision = precision
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        if implementation == "fused" and svd == "exact":
            raise ValueError("implementation 'fused' needs a sketched svd, 'randomized' or 'single_pass' "
                             "(the exact SVD has no fused form)")
        self.implementation = implementation

    def _fused(self, modules) -> bool:
        if self.implementation == "auto":
            return self.svd != "exact" and bool(modules) and modules[0].gA.device.type == "cuda"
        return self.implementation == "fused"

    def combine(self, modules, step):
        if not self._fused(modules):
            return super().combine(modules, step)
        from iga_ds.lora.fused import batched_iga

        gens = [module_generator(self.seed, step, m.index, m.gA.device) for m in modules]
        # the factor map runs batched inside (this class always projects by SVD)
        out = batched_iga(modules, tau=self.tau, normalize=self.normalize, rank=self.rank,
                          oversample=self.oversample, power_iters=self.power_iters, generators=gens,
                          triton_precision=self.precision, factors=self.factors, svd=self.svd)
        return [ModuleUpdate(gA, gB, stats) for gA, gB, stats in out]
