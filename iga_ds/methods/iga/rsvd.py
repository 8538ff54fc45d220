"""Truncated SVD: exact, randomized (Halko, Martinsson and Tropp, SIAM Review 2011), or
single-pass (Tropp, Yurtsever, Udell and Cevher, SIAM J. Matrix Anal. Appl. 2017).

Singular vectors are defined up to sign; both paths flip each pair (u_i, v_i) so that the
largest-magnitude entry of u_i is positive, which makes factor gradients reproducible.
"""
from __future__ import annotations

import torch

from iga_ds.methods.iga.sketch import SketchKey, gaussian

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def canonical_signs(U: torch.Tensor, Vh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flip each pair (u_i, v_i) so that the largest-magnitude entry of u_i is positive;
    batched over leading dimensions (U: ... x m x k, Vh: ... x k x n)."""
    idx = U.abs().argmax(dim=-2, keepdim=True)
    # -1 where that entry is negative, else +1 (a zero column keeps its sign); two operators,
    # not four: on the batched path they run while the device waits for the host
    signs = torch.where(torch.gather(U, -2, idx) < 0, -1.0, 1.0).to(U.dtype)  # ... x 1 x k
    return U * signs, Vh * signs.mT


def exact_svd(M: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-`rank` truncation of the full SVD (the reference)."""
    work = M.float() if M.dtype in _LOW_PRECISION else M
    U, S, Vh = torch.linalg.svd(work, full_matrices=False)
    U, Vh = canonical_signs(U[:, :rank], Vh[:rank])
    return U.to(M.dtype), S[:rank].to(M.dtype), Vh.to(M.dtype)


def randomized_svd(
    M: torch.Tensor,
    rank: int,
    *,
    oversample: int = 10,
    power_iters: int = 2,
    generator: SketchKey | torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-`rank` SVD from a Gaussian sketch of width rank + oversample.

    Power iterations (with re-orthonormalization, HMT Algorithm 4.4) sharpen the range
    estimate when the spectrum decays slowly; each costs two passes over M. ``generator``:
    where omega comes from, a module's :class:`iga_ds.methods.iga.sketch.SketchKey` (what the
    IGA method passes) or a ``torch.Generator``.
    """
    work = M.float() if M.dtype in _LOW_PRECISION else M
    m, n = work.shape
    width = min(rank + oversample, m, n)
    omega = gaussian(generator, n, width, dtype=work.dtype, device=work.device)
    Q, _ = torch.linalg.qr(work @ omega)
    for _ in range(power_iters):
        Z, _ = torch.linalg.qr(work.mT @ Q)
        Q, _ = torch.linalg.qr(work @ Z)
    small = Q.mT @ work  # width x n
    Ub, S, Vh = torch.linalg.svd(small, full_matrices=False)
    U = Q @ Ub[:, :rank]
    U, Vh = canonical_signs(U, Vh[:rank])
    return U.to(M.dtype), S[:rank].to(M.dtype), Vh.to(M.dtype)


def single_pass_widths(rank: int, oversample: int, m: int, n: int) -> tuple[int, int]:
    """(range width k, co-range width l) of the single-pass sketches of an m x n matrix."""
    width = min(rank + oversample, m, n)
    return width, min(2 * width + 1, m)


def single_pass_svd(
    M: torch.Tensor,
    rank: int,
    *,
    oversample: int = 10,
    generator: SketchKey | torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-`rank` SVD from one pass over M (Tropp et al. 2017, Algorithms 1, 3 and 7).

    A range sketch Y = M Omega (width k = rank + oversample) and a co-range sketch
    W = Psi M (l = 2k + 1 rows) are both taken in the same pass; then Q = orth(Y),
    X = (Psi Q)^+ W and M ~ Q X, truncated through the SVD of the small X. Exact when
    rank(M) <= k. No power iterations: the batched path never has to store M (it sketches
    each tile as it is formed), at the price of a looser approximation when the spectrum
    decays slowly. Omega is drawn first, then Psi, from ``generator`` (a key's psi starts
    where its omega ended).
    """
    work = M.float() if M.dtype in _LOW_PRECISION else M
    m, n = work.shape
    width, co_width = single_pass_widths(rank, oversample, m, n)
    omega = gaussian(generator, n, width, dtype=work.dtype, device=work.device)
    psi = gaussian(generator, co_width, m, dtype=work.dtype, device=work.device, offset=n * width)
    Y, W = work @ omega, psi @ work
    Q, _ = torch.linalg.qr(Y)
    X = torch.linalg.lstsq(psi @ Q, W).solution  # width x n
    Ub, S, Vh = torch.linalg.svd(X, full_matrices=False)
    U = Q @ Ub[:, :rank]
    U, Vh = canonical_signs(U, Vh[:rank])
    return U.to(M.dtype), S[:rank].to(M.dtype), Vh.to(M.dtype)


SVD_METHODS = ("randomized", "single_pass", "exact")


def truncated_svd(
    M: torch.Tensor,
    rank: int,
    *,
    method: str = "randomized",
    oversample: int = 10,
    power_iters: int = 2,
    generator: SketchKey | torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if method == "exact":
        return exact_svd(M, rank)
    if method == "randomized":
        return randomized_svd(M, rank, oversample=oversample, power_iters=power_iters, generator=generator)
    if method == "single_pass":
        return single_pass_svd(M, rank, oversample=oversample, generator=generator)
    raise ValueError(f"svd must be one of {SVD_METHODS}, got {method!r}")
