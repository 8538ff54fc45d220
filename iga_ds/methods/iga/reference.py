"""IGA for one LoRA module, step by step: the reference every faster path is tested against.

PEFT layout: lora_A.weight is r x in, lora_B.weight is out x r, dW = s * B @ A. A step
(dA, dB) changes dW, to first order, by s * (dB @ A + B @ dA); that is the reconstruction
G[n] of a domain's factor gradients. (The paper's g^B A^T + B^T g^A does not type-check.)
The update: mean Gbar and population variance V of the G[n], mask exp(-tau V'), then the
``tangent`` projection (the default): ERM's factor gradients plus the pseudo-inverse of the
reconstruction applied to what the mask removed, Gbar * (mask - 1), so that tau = 0 is ERM.
The paper's rank-r truncation of Gbar * mask (``projection="svd"``: the method ``iga_svd``) and
the chain rule without one (the ``iga_no_projection`` ablation) are computed here too.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from iga_ds.methods.iga.common import NORMALIZATIONS, SNR_EPS, check_module
from iga_ds.methods.iga.options import OPTION_DEFAULTS as DEFAULTS
from iga_ds.methods.iga.options import IGAOptions
from iga_ds.methods.iga.rsvd import truncated_svd
from iga_ds.methods.iga.sketch import SketchKey

Normalize = Literal["none", "mean", "snr"]
# the binary mask (iga_binary) keeps an element where exp(-tau V') reaches this
BINARY_THRESHOLD = 0.5


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


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1/x where x is above rounding level (relative to the largest entry), else 0: the
    pseudo-inverse's convention for directions the reconstruction does not reach."""
    floor = x.amax(dim=-1, keepdim=True) * (x.shape[-1] * torch.finfo(x.dtype).eps)
    ok = x > floor
    return torch.where(ok, 1.0 / torch.where(ok, x, torch.ones_like(x)), torch.zeros_like(x))


def tangent_from_products(A, B, GAt, BtG, scaling, damping: float = 0.0):
    """:func:`tangent_factors` from the two products it needs, ``G @ A^T`` (out x r) and
    ``B^T @ G`` (r x in): the batched path takes them in its one pass over G.

    With the Grams A A^T = U2 diag(d2) U2^T and B^T B = U1 diag(d1) U1^T, the reconstruction
    decouples into r x r blocks, and the ridge solution of min ||s (b A + B a) - G||^2 +
    lam (||a||^2 + ||b||^2) is, with K = U1^T B^T G A^T U2, c = 1/(s^2 d + lam) and
    D_ij = s^2 (d1_i + d2_j) + lam:
        b = s (G A^T) U2 c2 U2^T - s^3 B U1 (K c2_j / D_ij) U2^T
        a = s U1 c1 U1^T (B^T G) - s^3 U1 (K c1_i / D_ij) U2^T A.
    lam = damping * s^2 * (tr(A A^T) + tr(B^T B)) / r; lam = 0 is the pseudo-inverse. The
    small matrices are handled in float64. Batched over leading dimensions (``scaling`` a
    number or a tensor that broadcasts like M x 1 x 1).
    """
    work = GAt.dtype
    s = torch.as_tensor(scaling, dtype=torch.float64, device=A.device)
    s = s.reshape(s.shape[:-2] if s.ndim >= 2 else s.shape)  # M x 1 x 1 -> M
    A64, B64 = A.double(), B.double()
    d2, U2 = torch.linalg.eigh(A64 @ A64.mT)
    d1, U1 = torch.linalg.eigh(B64.mT @ B64)
    d1, d2 = d1.clamp_min(0), d2.clamp_min(0)
    s2 = (s * s)[..., None]
    lam = damping * s2 * (d1.sum(-1, keepdim=True) + d2.sum(-1, keepdim=True)) / d1.shape[-1]
    c1, c2 = _safe_reciprocal(s2 * d1 + lam), _safe_reciprocal(s2 * d2 + lam)
    den = _safe_reciprocal(s2[..., None] * (d1[..., :, None] + d2[..., None, :]) + lam[..., None])
    K = U1.mT @ (B64.mT @ GAt.double()) @ U2
    s3 = (s2 * s[..., None])[..., None]
    right_b = (U2 * c2[..., None, :]) @ U2.mT  # U2 c2 U2^T
    inner_b = U1 @ (K * c2[..., None, :] * den) @ U2.mT
    left_a = (U1 * c1[..., None, :]) @ U1.mT
    inner_a = U1 @ (K * c1[..., :, None] * den) @ U2.mT
    sc = s[..., None, None]
    gB = (GAt @ (sc * right_b).to(work)) - B @ (s3 * inner_b).to(work)
    gA = ((sc * left_a).to(work) @ BtG) - (s3 * inner_a).to(work) @ A
    return gA, gB


def tangent_factors(A, B, G, scaling, damping: float = 0.0):
    """Factor gradients (gA, gB) whose reconstruction s (gB A + B gA) is the least-squares fit of
    G (out x in), of least norm: the pseudo-inverse of the reconstruction, so that
    ``reconstruct(gA, gB)`` is G's projection onto the tangent space at s B A of the rank-r
    matrices. For G the reconstruction of gradients of a LoRA loss (gA = s B^T gW, gB =
    s gW A^T), it returns them exactly. ``damping`` > 0 adds a ridge (see
    :func:`tangent_from_products`)."""
    return tangent_from_products(A, B, G @ A.mT, B.mT @ G, scaling, damping)


def masked_projection(
    A, B, gA, gB, *, scaling, options: IGAOptions, generator, mask_kind: str = "continuous", spread=None,
    projection: str | None = None,
):
    """IGA with the steps that its ablations change made explicit: the mask (``continuous``,
    ``binary`` or ``none``) and the projection back to the factors: ``tangent`` (ERM's factor
    gradients plus the pseudo-inverse of the reconstruction applied to what the mask removed),
    rank-r ``svd`` then ``factors`` (``split`` or ``chain_rule``), or the ``chain`` rule without
    truncation. ``spread``: the (variance, mean) the mask is computed from, where they are not
    this step's (:mod:`iga_ds.methods.iga.variance`); the masked mean is this step's either way.
    ``options``: tau, normalize, the projection and its settings; ``projection`` overrides
    theirs with one that is no option value (``chain``, the ``iga_no_projection`` ablation).
    Returns (gA_new, gB_new, stats)."""
    o = options
    projection = o.projection if projection is None else projection
    rank = check_module(A, B, gA, gB, o.rank)
    r = A.shape[0]
    if spread is None:
        mean, var = mean_and_variance(A, B, gA, gB, scaling)
        spread_mean = mean
    else:  # computed as mean_and_variance computes it
        mean = reconstruct(A, B, gA.mean(dim=0), gB.mean(dim=0), scaling)
        var, spread_mean = spread
    if mask_kind == "none":
        mask = torch.ones_like(mean)
    else:
        soft = torch.exp(-o.tau * normalize_variance(var, spread_mean, o.normalize))
        mask = (soft >= BINARY_THRESHOLD).to(mean.dtype) if mask_kind == "binary" else soft
    stats = mask_stats(mask, var)
    if projection == "tangent":
        # what the mask removes, exactly zero where the mask is one: tau = 0 gives ERM bit for bit
        removed = mean * (mask - 1)
        masked_sq = float((mean * mask).pow(2).sum())
        dA, dB = tangent_factors(A, B, removed, scaling, o.damping)
        gA_new, gB_new = gA.mean(dim=0) + dA, gB.mean(dim=0) + dB
        kept = float(reconstruct(A, B, gA_new, gB_new, scaling).pow(2).sum())
        stats["energy_kept"] = kept / masked_sq if masked_sq > 0 else 1.0
        return gA_new, gB_new, stats
    masked = mean * mask
    del mean, var, spread_mean
    total = float(masked.pow(2).sum())
    if projection == "chain":
        # Treat the masked matrix as dL/d(dW): chain rule through dW = s * B @ A.
        gB_new = scaling * masked @ A.mT
        gA_new = scaling * B.mT @ masked
        stats["energy_kept"] = 1.0
        return gA_new, gB_new, stats
    U, S, Vh = truncated_svd(
        masked, rank, method=o.svd, oversample=o.oversample, power_iters=o.power_iters, generator=generator
    )
    stats["energy_kept"] = float(S.double().pow(2).sum() / total) if total > 0 else 1.0
    gA_new, gB_new = factors_from_svd(U, S, Vh, r, scaling)
    if o.factors == "chain_rule":
        gA_new, gB_new = chain_rule_factors(A, B, gA_new, gB_new, scaling)
    return gA_new, gB_new, stats


def iga_update(
    A: torch.Tensor,
    B: torch.Tensor,
    gA: torch.Tensor,
    gB: torch.Tensor,
    *,
    scaling: float,
    tau: float = DEFAULTS["tau"],
    rank: int | None = DEFAULTS["rank"],
    normalize: Normalize = DEFAULTS["normalize"],
    projection: Literal["tangent", "svd"] = DEFAULTS["projection"],
    damping: float = DEFAULTS["damping"],
    svd: Literal["randomized", "single_pass", "exact"] = DEFAULTS["svd"],
    oversample: int = DEFAULTS["oversample"],
    power_iters: int = DEFAULTS["power_iters"],
    generator: SketchKey | torch.Generator | None = None,
    factors: Literal["split", "chain_rule"] = DEFAULTS["factors"],
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The IGA update of one LoRA module: :func:`masked_projection` with these keywords made one
    :class:`~iga_ds.methods.iga.options.IGAOptions` (its defaults, the registered ``iga`` method's).

    A: r x in, B: out x r, gA: N x r x in, gB: N x out x r (per-domain mean gradients).
    Returns (gA_new, gB_new, stats). The masked mean is g = mean_n G[n] * exp(-tau * V'),
    G[n] = scaling * (gB[n] @ A + B @ gA[n]). ``projection="tangent"``: the mean factor
    gradients (ERM's) plus :func:`tangent_factors` of g - mean_n G[n], so that tau = 0 is ERM
    exactly (``damping``: the ridge of that pseudo-inverse). ``"svd"``: the rank-``rank``
    truncation g~ of g (``svd``, ``oversample``, ``power_iters``, ``generator``: how it is
    computed), made factor gradients by ``factors``: ``"split"`` (the paper's, scaling *
    gB_new @ gA_new = g~) or ``"chain_rule"`` (:func:`chain_rule_factors`).
    Computes in the dtype it is given.
    """
    # one IGAOptions: the checks and the defaults are its own
    options = IGAOptions(tau=tau, rank=rank, normalize=normalize, projection=projection, damping=damping, svd=svd,
                         oversample=oversample, power_iters=power_iters, factors=factors)
    return masked_projection(A, B, gA, gB, scaling=scaling, options=options, generator=generator)
