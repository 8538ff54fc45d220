"""IGA for many LoRA modules at once, without the N full-rank per-domain gradients.

Same result as :func:`iga_ds.methods.iga.reference.iga_update` with the continuous mask, under
either projection: the ``tangent`` one (the default; :func:`tangent_stack`: the tile pass stores
the masked matrices and takes ``masked @ A^T``, one more pass ``B^T @ masked``, no sketch), or
the paper's randomized (or single-pass) SVD truncation (the stages below), computed differently:

- Each per-domain reconstruction is a rank-2r product,
  ``G[n] = s * (gB[n] @ A + B @ gA[n]) = [s gB[n], s B] @ [A; gA[n]]``, so the mean Gbar and
  the deviations ``D[n] = G[n] - Gbar`` are rebuilt one row tile at a time from the factors;
  only the masked matrix ``Gbar * exp(-tau V')`` (out x in per module) is ever stored.
- The module-wide scales the mask needs before any element is masked (mean of V for
  ``normalize="mean"``, mean of Gbar^2 for ``"snr"``) come from r x r Gram matrices:
  ``||L @ R||_F^2 = <L^T L, R R^T>``, in float64.
- Modules of equal (r, in, out) are stacked and handled by batched matmuls, QR and SVD.
- The first sketch ``Y = masked @ omega`` of the randomized SVD (Halko, Martinsson and
  Tropp, SIAM Review 2011, Alg. 4.4) is taken with the tile pass; omega comes from
  each module's own key (or generator) exactly as :func:`iga_ds.methods.iga.rsvd.randomized_svd`
  draws it, so both paths agree up to float rounding; keyed modules are drawn all at once
  (:mod:`iga_ds.methods.iga.sketch`).
- With ``svd="single_pass"`` (:func:`iga_ds.methods.iga.rsvd.single_pass_svd`) the tile pass also
  takes the co-range sketch ``W = psi @ masked`` and the masked matrix is not stored at all:
  no pass over it after the tile pass, and no out x in matrix per module in memory.

On CUDA, the tile pass can run as one Triton kernel (:mod:`iga_ds.methods.iga.triton_kernels`)
when Triton is installed; everywhere else it is plain PyTorch, and this file is the
reference for that kernel.

Stages. :func:`batched_iga` is the entry point; the stages it runs are public too, so that
benchmarks can time one at a time and tests can check one against its reference. In order:

1. :func:`stack_modules`: modules of one shape stacked into :class:`Stack` batches that fit
   ``batch_bytes`` (:func:`resolve_batch_bytes` checks and resolves that argument);
2. :func:`stack_factors`: the rank-2r factors of the mean and the deviations (on CUDA one
   kernel pair, :func:`iga_ds.methods.iga.triton_kernels.stack_factors_triton`);
3. :func:`mask_scales` (:func:`mean_square`, :func:`mean_variance`): the module-wide scalars
   the mask needs up front;
4. the tile pass: :func:`tile_pass_torch` or :func:`iga_ds.methods.iga.triton_kernels.tile_pass_triton`
   (masked matrices or co-range sketch, first sketch, mask statistics);
5. :func:`project`: CholeskyQR (:func:`orthonormalize`), power iterations, ``Q^T M``;
   :func:`project_stack` runs stages 2 to 5 on one stack;
6. the eigendecomposition of each small matrix's Gram, then the factor gradients: by the
   chain rule from the projector onto the kept vectors (:func:`_chain_rule_gradients`), or
   the SVD split (:func:`svd_from_projection`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Sequence

import torch

from iga_ds.methods.base import ModuleGrads
from iga_ds.methods.device_copies import host_to_device, stacked_view
from iga_ds.methods.iga import jacobi, triton_kernels
from iga_ds.methods.iga.common import (
    DEFAULT_VARIANCE, NORMALIZATIONS, SNR_EPS, VARIANCES, check_choice, check_module,
)
from iga_ds.methods.iga.options import IGAOptions
from iga_ds.methods.iga.reference import tangent_from_products
from iga_ds.methods.iga.rsvd import canonical_signs, single_pass_widths
from iga_ds.methods.iga.sketch import SketchKey, SketchKeys, gaussian, gaussian_stack
from iga_ds.methods.iga.tiles import StableModules, StatsTable, TiledResults

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# the stacked masked matrices of one batch of equal-shape modules stay under this many bytes
DEFAULT_BATCH_BYTES = 1 << 30
# batch_bytes="auto" on CUDA grows stacks up to this into memory the step has already peaked at
# (larger stacks mean fewer, longer launches)
MAX_AUTO_BATCH_BYTES = 4 << 30
# row tiles are sized so that the per-tile temporaries stay under this many elements
DEFAULT_TILE_ELEMENTS = 1 << 24


@dataclass
class Stack:
    """A batch of modules with the same (r, in, out), stacked along a leading module axis
    (built by :func:`stack_modules`)."""

    positions: list[int]  # where each module sits in the caller's list
    A: torch.Tensor  # M x r x in
    B: torch.Tensor  # M x out x r
    gA: torch.Tensor  # M x N x r x in
    gB: torch.Tensor  # M x N x out x r
    scaling: torch.Tensor  # M
    generators: Sequence[SketchKey | torch.Generator | None]  # a SketchKeys for keyed modules


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def auto_batch_bytes(headroom: int) -> int:
    """Stack size for ``batch_bytes="auto"``: half of ``headroom``, the bytes between the
    device's peak so far and what is allocated now, within [1 GiB, 4 GiB].

    A stack's extra memory is a little more than its masked matrices plus a part that grows
    with the number of modules, so half the headroom keeps the method under the peak that
    forward and backward already set; with less than 2 GiB of headroom the 1 GiB default
    stays."""
    return int(min(MAX_AUTO_BATCH_BYTES, max(DEFAULT_BATCH_BYTES, headroom // 2)))


def resolve_batch_bytes(batch_bytes, device: torch.device) -> int:
    """The stack size in bytes that :func:`batched_iga` uses for its ``batch_bytes`` argument:
    ``"auto"`` as :func:`auto_batch_bytes` on CUDA (1 GiB elsewhere), else the positive whole
    number given. Raises ValueError for anything else (benchmarks check their option with it)."""
    if batch_bytes == "auto":
        if device.type != "cuda":
            return DEFAULT_BATCH_BYTES
        # one read of the allocator's counters: memory_allocated() and max_memory_allocated()
        # each flatten all of them in Python, every step, while the device waits
        allocated = torch.cuda.memory_stats_as_nested_dict(device).get("allocated_bytes", {}).get("all", {})
        return auto_batch_bytes(allocated.get("peak", 0) - allocated.get("current", 0))
    if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 1:
        raise ValueError(f"batch_bytes must be 'auto' or a positive number of bytes, got {batch_bytes!r}")
    return batch_bytes


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``, as a view without a copy where :func:`stacked_view` finds one:
    the hook's gradient buffer and its float32 copies of the factors lay equal modules out one
    after another, and stacking 128 of them one by one cost the host more than the device's
    copy took."""
    view = stacked_view(tensors)
    return torch.stack(tensors) if view is None else view


def stack_modules(modules: Sequence[ModuleGrads], generators, batch_bytes: int,
                  element_bytes: int | None = None) -> list[Stack]:
    """Stage 1: group modules of equal shape, dtype and device, then split groups to fit
    ``batch_bytes`` (bytes of the stacked masked matrices at ``element_bytes`` each; None:
    the work dtype's size). ``generators``: one per module, kept with it. Returns the stacks,
    each knowing its modules' positions."""
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(modules):
        key = (m.A.shape, m.B.shape, m.num_domains, m.gA.dtype, m.gA.device)
        groups.setdefault(key, []).append(i)
    out = []
    for key, idx in groups.items():
        (r, d_in), (d_out, _), _, dtype, _ = key
        per_module = d_out * d_in * (element_bytes or torch.empty((), dtype=_work_dtype(dtype)).element_size())
        size = max(1, batch_bytes // max(per_module, 1))
        for start in range(0, len(idx), size):
            part = idx[start: start + size]
            wd = _work_dtype(dtype)
            out.append(Stack(
                positions=part,
                A=_stacked([modules[i].A for i in part]).to(wd),
                B=_stacked([modules[i].B for i in part]).to(wd),
                gA=_stacked([modules[i].gA for i in part]).to(wd),
                gB=_stacked([modules[i].gB for i in part]).to(wd),
                scaling=host_to_device(torch.tensor([float(modules[i].scaling) for i in part], dtype=wd),
                                       modules[part[0]].gA.device),
                generators=_select(generators, part),
            ))
    return out


def _check(modules: Sequence[ModuleGrads], generators, svd: str, precision: str) -> None:
    # the options themselves were checked when made (IGAOptions)
    check_choice(precision, triton_kernels.PRECISIONS, "triton_precision")
    if svd not in ("randomized", "single_pass"):
        raise ValueError(f"svd must be 'randomized' or 'single_pass' (the batched form), got {svd!r}")
    if len(generators) != len(modules):
        raise ValueError(f"one generator per module: got {len(generators)} for {len(modules)} modules")


def _check_shapes(modules: Sequence[ModuleGrads], rank: int | None) -> None:
    # the checks depend on the shapes alone: once per distinct set, naming its first module
    checked = set()
    for m in modules:
        shapes = (m.A.shape, m.B.shape, m.gA.shape, m.gB.shape)
        if shapes not in checked:
            check_module(m.A, m.B, m.gA, m.gB, rank, m.name)
            checked.add(shapes)


def _stacks(modules: Sequence[ModuleGrads], generators, rank: int | None, batch_bytes: int,
            element_bytes: int | None) -> list[Stack]:
    """Stage 1 with its shape checks: :func:`stack_modules`, or, for :class:`StableModules`
    whose stacks are all views of their tensors, the stacks built on an earlier call with this
    call's generators (checking and stacking every module each step is host time while the
    device waits)."""
    # one entry, replaced when the settings change ("auto" stack sizes follow the memory
    # headroom): stacks of other settings are not kept
    settings = (rank, batch_bytes, element_bytes)
    kept = modules.derived.get("iga.batched.stacks") if isinstance(modules, StableModules) else None
    template = kept[1] if kept is not None and kept[0] == settings else None
    if template is None:
        _check_shapes(modules, rank)
        template = stack_modules(modules, [None] * len(modules), batch_bytes, element_bytes)
        if isinstance(modules, StableModules) and all(_views_of(st, modules) for st in template):
            modules.derived["iga.batched.stacks"] = (settings, template)
    return [dataclasses.replace(st, generators=_select(generators, st.positions)) for st in template]


def _select(generators, positions: Sequence[int]):
    """The generators (or keys) at ``positions``: a :class:`SketchKeys` stays one."""
    if isinstance(generators, SketchKeys):
        return generators.take(positions)
    return [generators[i] for i in positions]


def _views_of(st: Stack, modules: Sequence[ModuleGrads]) -> bool:
    """Whether the stack's tensors are views of its modules' own (no copy that a later call
    would find stale)."""
    first = modules[st.positions[0]]
    return all(stacked.untyped_storage().data_ptr() == own.untyped_storage().data_ptr()
               for stacked, own in ((st.A, first.A), (st.B, first.B), (st.gA, first.gA), (st.gB, first.gB)))


def _frobenius_sq(L: torch.Tensor, R: torch.Tensor, wide: bool = True) -> torch.Tensor:
    """||L @ R||_F^2 over the last two dims without forming L @ R: <L^T L, R R^T>, in float64;
    ``wide=False``: the Grams in the factors' own dtype (no float64 copy of them; bfloat16
    factors give float32 Grams), summed in float64."""
    if wide:
        L, R = L.double(), R.double()
    with _tf32_matmuls(False):
        return (_gram_product(L.mT, L) * _gram_product(R, R.mT)).sum(dim=(-2, -1), dtype=torch.float64)


def _gram_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` over the last two dims, in float32 for bfloat16 or float16 operands (float32
    accumulation, the result not rounded back to 16 bits), else in their dtype."""
    if a.dtype not in _LOW_PRECISION:
        return a @ b
    batch = a.shape[:-2]
    if a.is_cuda:  # cuBLAS writes the float32 result directly: no float32 copy of the operands
        with contextlib.suppress(RuntimeError, NotImplementedError):
            out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
            return out.view(*batch, a.shape[-2], b.shape[-1])
    return a.float() @ b.float()


def stack_factors(st: Stack, dev_dtype: torch.dtype | None = None):
    """Stage 2: left and right factors of Gbar and of the deviations D[n] (each a rank-2r
    product): ``(left_mean M x out x 2r, right_mean M x 2r x in, left_dev M x N x out x 2r,
    right_dev M x N x 2r x in)``, the inputs of both tile passes.

    The scaling s is applied to the left factors. ``dev_dtype`` (default the stack's): the
    deviation factors' dtype; bfloat16 (the bf16 tile kernel's, which would round them anyway)
    writes them as the stack's dtype rounded once, without a full-precision copy. The mean's
    factors stay in the stack's dtype: the mask's floor comes from their Grams."""
    M, N, r, d_in = st.gA.shape
    d_out = st.B.shape[1]
    s = st.scaling.view(-1, 1, 1)
    gA_mean, gB_mean = st.gA.mean(dim=1), st.gB.mean(dim=1)
    left_mean = torch.cat([gB_mean, st.B], dim=-1) * s  # M x out x 2r
    right_mean = torch.cat([st.A, gA_mean], dim=-2)  # M x 2r x in
    # each half written in place: no concatenation, and no second pass to scale it
    dev_dtype = st.A.dtype if dev_dtype is None else dev_dtype
    left_dev = st.B.new_empty((M, N, d_out, 2 * r), dtype=dev_dtype)
    right_dev = st.A.new_empty((M, N, 2 * r, d_in), dtype=dev_dtype)
    torch.mul(st.gB - gB_mean.unsqueeze(1), s.unsqueeze(1), out=left_dev[..., :r])
    left_dev[..., r:].copy_((st.B * s).unsqueeze(1).expand(-1, N, -1, -1))
    right_dev[:, :, :r].copy_(st.A.unsqueeze(1).expand(-1, N, -1, -1))
    torch.sub(st.gA, gA_mean.unsqueeze(1), out=right_dev[:, :, r:])
    return left_mean, right_mean, left_dev, right_dev


@dataclass
class VarianceTerms:
    """What a departure's variance (``ema``, ``debiased``; :mod:`iga_ds.methods.iga.variance`)
    changes in the tile pass: V = sum over terms t of ``weights[t] * (left_dev[t] @ right_dev[t])^2``
    (clamped at zero where a weight is negative), and ``snr`` divides by the square of
    ``spread[0] @ spread[1]`` (None: the step's mean, the masked one)."""

    weights: tuple[float, ...]
    spread: tuple[torch.Tensor, torch.Tensor] | None = None


def variance_terms(st: Stack, variance: str, averaged: Stack | None = None):
    """Stage 2 for the departures: ``(left_mean, right_mean, left_dev, right_dev, terms)``, the
    mean being this step's (the masked one) and the terms those of :class:`VarianceTerms`.

    ``ema``: ``averaged`` holds the bias-corrected moving averages of the per-domain factor
    gradients at the stack's positions; V and the ``snr`` mean are theirs, reconstructed at this
    step's factors. ``debiased``: the stack holds 2N per-(domain, half) means, domain n's halves
    at n and N + n; V is that of the domains' means less (N - 1) / (4 N^2) times the sum of
    the reconstructed half differences squared (each domain's noise), clamped at zero."""
    if variance == "ema":
        left_mean, right_mean, _, _ = stack_factors(st)
        spread_left, spread_right, left_dev, right_dev = stack_factors(averaged)
        N = left_dev.shape[1]
        return left_mean, right_mean, left_dev, right_dev, VarianceTerms((1.0 / N,) * N, (spread_left, spread_right))
    if variance != "debiased":
        raise ValueError(f"variance_terms: variance must be 'ema' or 'debiased', got {variance!r}")
    N = st.gA.shape[1] // 2
    h1A, h2A, h1B, h2B = st.gA[:, :N], st.gA[:, N:], st.gB[:, :N], st.gB[:, N:]
    domains = dataclasses.replace(st, gA=(h1A + h2A) / 2, gB=(h1B + h2B) / 2)
    left_mean, right_mean, left_dev, right_dev = stack_factors(domains)
    # the half differences' factors: [s (h1B - h2B), s B] @ [A; h1A - h2A]
    s = st.scaling.view(-1, 1, 1, 1)
    left_diff = torch.cat([(h1B - h2B) * s, (st.B.unsqueeze(1) * s).expand(-1, N, -1, -1)], dim=-1)
    right_diff = torch.cat([st.A.unsqueeze(1).expand(-1, N, -1, -1), h1A - h2A], dim=-2)
    weights = (1.0 / N,) * N + (-(N - 1) / (4.0 * N * N),) * N
    return (left_mean, right_mean, torch.cat([left_dev, left_diff], dim=1), torch.cat([right_dev, right_diff], dim=1),
            VarianceTerms(weights))


def mask_scales(left_mean, right_mean, left_dev, right_dev, numel: int, exact_var: bool = True,
                exact_mean: bool = True):
    """Stage 3: per-module scalars the mask needs before the tile pass, float64, from r x r
    Grams of the factors of :func:`stack_factors`: ``(mean of V, mean of Gbar^2)`` over the
    ``numel`` (out x in) elements (:func:`mean_variance`, :func:`mean_square`)."""
    return mean_variance(left_dev, right_dev, numel, exact_var), mean_square(left_mean, right_mean, numel, exact_mean)


def mean_variance(left_dev, right_dev, numel: int, exact: bool = True) -> torch.Tensor:
    """The mean of V per module, float64. ``exact=False`` takes the deviations' Grams in their own
    dtype: enough where the mean of V scales no mask (normalize "snr" or "none") and only gives
    the ``gir`` statistic, and it spares float64 copies of the N deviation factors."""
    return _frobenius_sq(left_dev, right_dev, wide=exact).sum(dim=1) / (left_dev.shape[1] * numel)


def mean_square(left_mean, right_mean, numel: int, exact: bool = True) -> torch.Tensor:
    """The mean of Gbar^2 per module, float64: it sets the "snr" floor. ``exact=False`` takes
    the Grams in float32: the float32 path keeps them in float64 (where the mask is tiny the
    exponent amplifies the floor's rounding, 44 times at a mask of 6e-20), bf16's rounding of
    the factors is a thousand times coarser than float32's."""
    return _frobenius_sq(left_mean, right_mean, wide=exact) / numel


def _masked_tile(G, var, normalize, tau, mean_var, mean_sq, dtype):
    """mask = exp(-tau V') for one tile; V' as in iga_ds.methods.iga.reference.normalize_variance."""
    if normalize == "none":
        vn = var
    elif normalize == "mean":
        scale = mean_var.to(dtype).view(-1, 1, 1)
        vn = torch.where(scale > 0, var / torch.where(scale > 0, scale, 1), torch.zeros_like(var))
    else:  # snr
        eps = (SNR_EPS * mean_sq).to(dtype).view(-1, 1, 1) + torch.finfo(dtype).tiny
        vn = var / (G * G + eps)
    return torch.exp(-tau * vn)


def _tile_variance(G, left_dev, right_dev, sl: slice, terms: "VarianceTerms | None"):
    """One row tile's V and the mean ``snr`` divides by: the paper's (terms None), else the
    weighted terms', clamped at zero where a weight is negative."""
    var = torch.zeros_like(G)
    if terms is None:
        N = left_dev.shape[1]
        for n in range(N):
            dev = torch.bmm(left_dev[:, n, sl], right_dev[:, n])
            var.addcmul_(dev, dev)
        return var.div_(N), G
    for n, weight in enumerate(terms.weights):
        dev = torch.bmm(left_dev[:, n, sl], right_dev[:, n])
        var.addcmul_(dev, dev, value=weight)
    if min(terms.weights) < 0:
        var.clamp_min_(0)
    return var, (G if terms.spread is None else torch.bmm(terms.spread[0][:, sl], terms.spread[1]))


def tile_pass_torch(left_mean, right_mean, left_dev, right_dev, omega, *, tau, normalize, mean_var,
                    mean_sq, tile_elements, psi=None, precision="ieee", terms: "VarianceTerms | None" = None):
    """Stage 4 in PyTorch: masked matrices, first sketch and mask statistics, one row tile at a time.

    Returns ``(masked M x out x in, sketch masked @ omega, stats, sum of masked^2 per module)``,
    ``stats`` the mask's mean, share below 1/2 and minimum per module;
    the reference of :func:`iga_ds.methods.iga.triton_kernels.tile_pass_triton`, which has the
    same contract. With ``psi`` (M x l x out) the co-range sketch ``psi @ masked`` is
    accumulated tile by tile and returned in place of the masked matrices, which are then
    never stored. ``precision="bf16"`` is the Triton kernel's bf16 contract: factors rounded to
    bfloat16, arithmetic in float32, masked matrices stored and multiplied in bfloat16; any
    other precision computes in the inputs' dtype. ``terms`` (the departures' variances,
    :func:`variance_terms`; not the kernel's contract): V as their weighted sum, clamped at zero
    where a weight is negative, ``snr`` divided by their mean's square, and the ``gir``
    statistic summed over the tiles."""
    M, N, d_out, _ = left_dev.shape
    d_in = right_mean.shape[-1]
    dtype, device = right_mean.dtype, right_mean.device
    store = triton_kernels.masked_dtype(precision) if precision == "bf16" else dtype
    if precision == "bf16":
        left_mean, right_mean, left_dev, right_dev = (
            t.to(torch.bfloat16).to(dtype) for t in (left_mean, right_mean, left_dev, right_dev))
    if psi is None:
        masked = torch.empty(M, d_out, d_in, dtype=store, device=device)
    else:
        co_sketch = torch.zeros(M, psi.shape[1], d_in, dtype=dtype, device=device)
    sketch = torch.empty(M, d_out, omega.shape[-1], dtype=dtype, device=device)
    acc = torch.zeros(4, M, dtype=torch.float64, device=device)  # mask sum, count below 0.5, sum of masked^2, V
    mask_min = torch.full((M,), math.inf, dtype=torch.float64, device=device)
    rows = max(1, min(d_out, tile_elements // max(1, M * d_in)))
    for start in range(0, d_out, rows):
        sl = slice(start, min(d_out, start + rows))
        G = torch.bmm(left_mean[:, sl], right_mean)
        var, spread = _tile_variance(G, left_dev, right_dev, sl, terms)
        if terms is not None:
            acc[3] += var.sum(dim=(1, 2), dtype=torch.float64)
        mask = _masked_tile(spread, var, normalize, tau, mean_var, mean_sq, dtype)
        acc[0] += mask.sum(dim=(1, 2), dtype=torch.float64)
        acc[1] += (mask < 0.5).sum(dim=(1, 2)).double()
        mask_min = torch.minimum(mask_min, mask.amin(dim=(1, 2)).double())
        tile = G * mask
        acc[2] += tile.pow(2).sum(dim=(1, 2), dtype=torch.float64)
        if psi is None:
            masked[:, sl] = tile
        # the stored values times omega rounded alike, summed in the work dtype (the kernels' contract)
        sketch[:, sl] = torch.bmm(tile.to(store).to(dtype), omega.to(store).to(dtype))
        if psi is not None:
            co_sketch.baddbmm_(psi[:, :, sl].to(store).to(dtype), tile.to(store).to(dtype))
    numel = d_out * d_in
    stats = {
        "mask_mean": acc[0] / numel,
        "mask_frac_below_half": acc[1] / numel,
        "mask_min": mask_min,
    }
    if terms is not None:
        stats["gir"] = acc[3]
    return (masked if psi is None else co_sketch), sketch, stats, acc[2]


def orthonormalize(Y: torch.Tensor, final: bool = True, out_dtype: torch.dtype | None = None,
                   use_triton: bool = False) -> torch.Tensor:
    """Orthonormal basis of the columns of each Y (M x m x k, k small) by CholeskyQR with float64
    Grams (part of stage 5; benchmarks time it with one pass and with two).

    Householder QR of tall-skinny matrices is a chain of small kernels on GPUs (it dominated
    the method's time); CholeskyQR needs one k x k Gram matrix, a batched Cholesky and a
    product with the inverse factor. Run twice (CholeskyQR2), with the Gram in float64 and a
    tiny shift for rank-deficient sketches, it is orthonormal to the rounding of the data's
    dtype for the condition numbers a few power iterations produce. The k x k factor is
    inverted on its own and applied as one batched product: a triangular solve against the
    m x k matrix is a slow kernel on GPUs. The factor's condition number is the square root of the Gram's, at most 1e8 where
    CholeskyQR works at all, so its float64 inverse adds an error below float32 rounding.

    ``final=False`` marks a basis that only feeds the next power iteration: there any basis
    of the same span will do, and one pass suffices for float32 or bfloat16 data, whose
    float64 Gram leaves a loss of orthogonality near cond(Y)^2 * 1e-16, under float32
    rounding up to a condition number of 1e4 (and the next pass repairs what a worse one
    leaves). float64 data have no such headroom and keep two passes. ``out_dtype`` (default
    Y's) is the result's dtype.

    Data in float32 or bfloat16 are multiplied by the inverse factor in true float32 (the
    factor rounded to float32): that product adds an error of float32 rounding times the
    factor's condition number, which the second pass of a final basis brings back to float32
    rounding, and which a basis rounded to bfloat16 for the next product would not show; it
    moves half the bytes of a float64 product and spares the float64 copy of its result.
    ``use_triton`` (CUDA): that product by Triton's skinny product, which writes ``out_dtype``
    directly (no conversion pass after it), and the Gram by
    :func:`iga_ds.methods.iga.triton_kernels.gram64`, from the float32 data themselves.
    """
    out_dtype = Y.dtype if out_dtype is None else out_dtype
    wide = Y.dtype == torch.float64
    Q = Y if wide or Y.dtype == torch.float32 else Y.float()
    k = Q.shape[-1]
    eye = torch.eye(k, dtype=torch.float64, device=Q.device)
    passes = 1 if not final and not wide else 2
    on_triton = use_triton and Q.is_cuda and not wide
    for i in range(passes):
        gram = _gram64(Q.mT, on_triton)
        trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
        shift = (1e-13 * trace / k).view(-1, 1, 1)
        L, _ = torch.linalg.cholesky_ex(gram + shift * eye)
        inv_LT = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False).mT  # L^-T, k x k
        if wide:
            Q = Q @ inv_LT
        elif on_triton:
            dtype = out_dtype if i == passes - 1 else torch.float32
            Q = triton_kernels.skinny_product(Q, inv_LT.float(), precision="ieee", out_dtype=dtype)
        else:
            with _tf32_matmuls(False):
                Q = Q @ inv_LT.float()
    return Q.to(out_dtype)


def _gram64(short: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """``short @ short^T`` in float64 for stacks of short-wide matrices (M x w x n): by
    :func:`iga_ds.methods.iga.triton_kernels.gram64` with ``use_triton`` for float32 CUDA data
    whose transpose is contiguous (it reads them in place), else through a float64 copy."""
    if use_triton and short.is_cuda and short.dtype == torch.float32 and short.mT.is_contiguous():
        return triton_kernels.gram64(short.mT)
    s64 = short.double()
    return s64 @ s64.mT


def _gram_eigh(smalls: Sequence[torch.Tensor], use_triton: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Eigendecompositions of the w x w Grams of several stacks of short-wide matrices, float64
    (the Grams by :func:`_gram64`).

    With ``use_triton`` on CUDA by :func:`iga_ds.methods.iga.jacobi.eigh`, which does not wait
    for the device; ``torch.linalg.eigh`` (elsewhere, and for Grams past the kernel's size)
    checks its result on the host, so each call stalls the device until its queue drains:
    stacks of equal w share one call, so a method call stalls once, not once per stack."""
    grams = [_gram64(small, use_triton) for small in smalls]
    by_width: dict[int, list[int]] = {}
    for i, gram in enumerate(grams):
        by_width.setdefault(gram.shape[-1], []).append(i)
    solve = jacobi.eigh if use_triton else torch.linalg.eigh
    out: list = [None] * len(grams)
    for idx in by_width.values():
        evals, evecs = solve(torch.cat([grams[i] for i in idx]))  # ascending
        sizes = [grams[i].shape[0] for i in idx]
        for i, values, vectors in zip(idx, evals.split(sizes), evecs.split(sizes)):
            out[i] = (values, vectors)
    return out


def _small_svd(small: torch.Tensor, rank: int, eig=None):
    """Top-`rank` SVD of short-wide matrices (M x w x n, w small) from the w x w Gram, in float64.
    ``eig``: the Gram's eigendecomposition from :func:`_gram_eigh`, when already computed."""
    S64 = small.double()
    evals, evecs = eig if eig is not None else _gram_eigh([small])[0]
    evals, evecs = evals[..., -rank:].flip(-1), evecs[..., -rank:].flip(-1)  # descending
    S = evals.clamp_min(0).sqrt()
    # 1/S, 0 where S is: the rows of Vh for zero singular values are zero. Few operators: after
    # torch.linalg.eigh (off the Triton path) the device waits for each launch
    inverse = torch.where(S > 0, S.reciprocal(), 0.0)
    Vh = (evecs.mT @ S64) * inverse.unsqueeze(-1)
    return evecs.to(small.dtype), S.to(small.dtype), Vh.to(small.dtype)


@contextlib.contextmanager
def _tf32_matmuls(allowed: bool | None):
    """float32 matrix products on TF32 tensor cores inside the block (``allowed``), in true
    float32 (False), or as the process has it (None)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = previous if allowed is None else allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _times(masked, factor, transpose: bool, skinny: bool, tf32: bool):
    """``masked @ factor`` (``masked^T @ factor``): with ``skinny`` Triton's skinny product
    (float32 result), else a batched matrix product."""
    if skinny:
        return triton_kernels.skinny_product(masked, factor, transpose=transpose, precision="tf32" if tf32 else "ieee")
    return (masked.mT if transpose else masked) @ factor


def project(masked, sketch, power_iters: int, tf32: bool = False, use_triton: bool = False):
    """Stage 5, HMT Alg. 4.4 up to the small matrix: orthonormalize the first sketch, power
    iterations, then ``small = Q^T M``; returns ``(Q, small)`` in the sketch's dtype, and the
    SVD of ``small`` finishes it (:func:`svd_from_projection`).

    With ``tf32`` the power iterations (which only refine the range estimate) use TF32
    tensor cores; the final projection Q^T M stays in float32. Masked matrices stored in
    bfloat16 are multiplied with bfloat16 bases (float32 accumulation), each product read
    back in the sketch's dtype: every pass moves half the bytes. ``use_triton`` (CUDA): the
    products go through :func:`iga_ds.methods.iga.triton_kernels.skinny_product` where it is
    the faster, which keeps them in float32.
    """
    work, store = sketch.dtype, masked.dtype
    # Triton's skinny product where it is the faster (triton_kernels.SKINNY_DTYPES)
    skinny = use_triton and store in triton_kernels.SKINNY_DTYPES
    # each basis comes out in the dtype of the product it feeds (no extra copy); the
    # products' results go to orthonormalize as they are (it takes their Grams in float64)
    Q = orthonormalize(sketch, final=power_iters == 0, out_dtype=store if power_iters else work,
                       use_triton=use_triton)
    with _tf32_matmuls(True if tf32 else None):
        for i in range(power_iters):
            last = i == power_iters - 1
            Z = orthonormalize(_times(masked, Q, True, skinny, tf32), final=False, out_dtype=store,
                               use_triton=use_triton)
            Q = orthonormalize(_times(masked, Z, False, skinny, tf32), final=last, out_dtype=work if last else store,
                               use_triton=use_triton)
    if skinny:  # the final projection in float32, as Q^T M is below
        return Q, _times(masked, Q.to(store), True, skinny, False).mT.to(work)  # M x width x in
    return Q, (Q.to(store).mT @ masked).to(work)


def _project_single_pass(sketch, co_sketch, psi):
    """Tropp et al. 2017 from both sketches: Q = orth(Y), X = (psi Q)^+ W; the SVD of the
    small X finishes it.

    psi Q (l x k, l = 2k + 1, Gaussian times orthonormal) is well conditioned, so the least
    squares solve goes through its normal equations, in float64."""
    Q = orthonormalize(sketch)
    P = psi.double() @ Q.double()  # M x l x k
    gram = P.mT @ P
    L, _ = torch.linalg.cholesky_ex(gram)
    return Q, torch.cholesky_solve(P.mT @ co_sketch.double(), L)  # M x k x in


def svd_from_projection(Q, small, rank: int, eig=None):
    """Stage 6, the small SVD: U S Vh of Q @ small, truncated to ``rank``, in Q's dtype, signs
    made canonical. ``eig``: the w x w Gram's eigendecomposition of ``small`` when already
    computed (:func:`batched_iga` computes those of all stacks in one call)."""
    Ub, S, Vh = _small_svd(small, rank, eig)
    U = Q @ Ub.to(Q.dtype)
    U, Vh = canonical_signs(U, Vh.to(Q.dtype))
    return U, S.to(Q.dtype), Vh


def _draw_sketches(generators, d_in: int, width: int, dtype, device, d_out: int | None = None,
                   co_width: int = 0):
    """Gaussian test matrices per module, drawn as the reference draws them: omega (in x
    width), then psi (co_width x out) when co_width > 0. Modules keyed by
    :class:`iga_ds.methods.iga.sketch.SketchKey` (the IGA method's) are drawn all at once, by
    one Triton launch per matrix on CUDA in float32; ``torch.Generator`` ones one at a time,
    in order."""
    if isinstance(generators, SketchKeys) or (generators and all(isinstance(g, SketchKey) for g in generators)):
        on_gpu = device.type == "cuda" and dtype == torch.float32 and triton_kernels.available()
        draw = triton_kernels.gaussian_stack_triton if on_gpu else functools.partial(gaussian_stack, dtype=dtype)
        omega = draw(generators, d_in, width, device=device)
        return omega, (draw(generators, co_width, d_out, device=device, offset=d_in * width) if co_width else None)
    omegas, psis = [], []
    for g in generators:
        omegas.append(gaussian(g, d_in, width, dtype=dtype, device=device))
        if co_width:
            psis.append(gaussian(g, co_width, d_out, dtype=dtype, device=device, offset=d_in * width))
    return torch.stack(omegas), (torch.stack(psis) if co_width else None)


@dataclass
class Projected:
    """A stack after its pass over the masked matrices (:func:`project_stack`): all that the
    small SVD and the factor gradients still need."""

    Q: torch.Tensor  # M x out x width, orthonormal columns
    small: torch.Tensor  # M x width x in: Q^T masked (single pass: its least-squares estimate)
    rank: int
    stats: dict
    energy_total: torch.Tensor  # M: ||masked||_F^2, float64
    use_triton: bool = False  # the stack ran on the Triton path: its small matrix's Gram may too


def project_stack(st: Stack, *, tau, normalize, rank, oversample, power_iters, tile_elements, use_triton,
                  triton_precision, svd, variance: str = DEFAULT_VARIANCE, averaged: Stack | None = None) -> Projected:
    """Stages 2 to 5 on one stack: factors, mask scales, tile pass (Triton with
    ``use_triton``), projection; what a stack costs up to the small SVD, which waits for
    nothing on the host. Keywords as :func:`batched_iga`'s; ``averaged``: ``ema``'s averages
    stacked as ``st`` (:func:`variance_terms`)."""
    M, N, r, d_in = st.gA.shape
    d_out, numel = st.B.shape[1], st.B.shape[1] * d_in
    k = r if rank is None else int(rank)
    width, co_width = single_pass_widths(k, oversample, d_out, d_in)
    if svd != "single_pass":
        co_width = 0
    dtype, device = st.A.dtype, st.A.device
    # the bf16 kernel reads bfloat16 factors; "mean" scales the mask by the mean of V, whose
    # Grams want the factors in full precision
    low = use_triton and triton_precision == "bf16" and normalize != "mean"
    left_mean, right_mean, left_dev, right_dev, terms, mean_sq = _stage2(st, use_triton, low, variance, averaged)
    # elsewhere than "mean" the mean of V only gives the gir statistic: taken while the kernel runs
    mean_var = mean_variance(left_dev, right_dev, numel) if normalize == "mean" else None
    # the Triton tile kernel does not take the first sketch: its test matrices are drawn, like
    # the Grams above, while the kernel runs, and the host issues less before the kernel starts
    after = use_triton and co_width == 0
    omega, psi = (None, None) if after else _draw_sketches(st.generators, d_in, width, dtype, device, d_out, co_width)
    kwargs = dict(tau=tau, normalize=normalize, mean_var=mean_var, mean_sq=mean_sq, psi=psi,
                  precision=triton_precision, **({} if terms is None else {"terms": terms}))
    if use_triton:
        masked, sketch, stats, energy_total = triton_kernels.tile_pass_triton(
            left_mean, right_mean, left_dev, right_dev, omega, **kwargs)
    else:
        masked, sketch, stats, energy_total = tile_pass_torch(
            left_mean, right_mean, left_dev, right_dev, omega, tile_elements=tile_elements, **kwargs)
    _set_gir(stats, mean_var, left_dev, right_dev, numel)
    if after:
        omega, _ = _draw_sketches(st.generators, d_in, width, dtype, device)
        sketch = triton_kernels.first_sketch(masked, omega)
    if psi is None:
        Q, small = project(masked, sketch, power_iters, tf32=use_triton and triton_precision == "tf32",
                           use_triton=use_triton)
    else:  # `masked` holds the co-range sketch here
        Q, small = _project_single_pass(sketch, masked, psi)
    return Projected(Q, small, k, stats, energy_total, use_triton)


def _factors(st: Stack, use_triton: bool, dev_dtype: torch.dtype | None):
    """Stage 2 by the factor kernels where they take the stack, else :func:`stack_factors`."""
    if use_triton and triton_kernels.factors_fit(st.A, st.B, st.gA, st.gB):
        return triton_kernels.stack_factors_triton(st.A, st.B, st.gA, st.gB, st.scaling, dev_dtype or st.A.dtype)
    return stack_factors(st, dev_dtype)


def _stage2(st: Stack, use_triton: bool, low: bool, variance: str, averaged: Stack | None):
    """Stage 2 and the mask's floor: ``(left_mean, right_mean, left_dev, right_dev, terms,
    mean_sq)``, ``terms`` None for the paper's variance (:func:`variance_terms` otherwise)."""
    if variance == DEFAULT_VARIANCE:
        factors = _factors(st, use_triton, torch.bfloat16 if low else None)
        terms = None
    else:
        *factors, terms = variance_terms(st, variance, averaged)
    left_mean, right_mean = factors[:2]
    spread = (left_mean, right_mean) if terms is None or terms.spread is None else terms.spread
    return (*factors, terms, mean_square(*spread, st.B.shape[1] * st.A.shape[-1], exact=not low))


def _set_gir(stats: dict, mean_var, left_dev, right_dev, numel: int) -> None:
    """gir, the sum of V over the elements: numel times the mean of V, unless the tile pass
    summed it (the departures' V, which a clamp takes out of the Grams' reach)."""
    if "gir" not in stats:
        if mean_var is None:
            mean_var = mean_variance(left_dev, right_dev, numel, exact=False)
        stats["gir"] = mean_var * numel


def _factor_gradients(st: Stack, proj: Projected, small64: torch.Tensor, eig):
    """``(gA_new, gB_new, energy_kept)`` of a stack from its projection (``small64``: its small
    matrix in float64) and the eigendecomposition of that matrix's Gram."""
    U, S, Vh = svd_from_projection(proj.Q, small64, proj.rank, eig)
    M, _, r, d_in = st.gA.shape
    d_out, k = st.B.shape[1], proj.rank
    energy_kept = _energy_kept(proj, eig[0])
    # gB = U S^1/2 / sqrt(s), gA = S^1/2 Vh / sqrt(s): s * gB @ gA = U S Vh (factors_from_svd)
    root = (S / st.scaling.view(-1, 1)).sqrt()
    gB_new = U * root.unsqueeze(-2)
    gA_new = root.unsqueeze(-1) * Vh
    if k < r:
        gB_new = torch.cat([gB_new, gB_new.new_zeros(M, d_out, r - k)], dim=-1)
        gA_new = torch.cat([gA_new, gA_new.new_zeros(M, r - k, d_in)], dim=-2)
    return gA_new, gB_new, energy_kept


def tangent_stack(st: Stack, *, tau, normalize, damping, tile_elements, use_triton, triton_precision,
                  variance: str = DEFAULT_VARIANCE, averaged: Stack | None = None):
    """The ``tangent`` projection on one stack: the tile pass stores the masked matrices and
    takes ``masked @ A^T``; one more pass takes ``B^T @ masked``. What the mask removed is that
    minus the same products of Gbar, which come from the factors. Returns
    ``(gA_new, gB_new, stats, energy_kept)`` in the work dtype.

    At tau = 0 the mask is one and the update is ERM's mean, exactly: the products are not
    subtracted (their rounding would be all that is left)."""
    M, N, r, d_in = st.gA.shape
    d_out, numel = st.B.shape[1], st.B.shape[1] * d_in
    low = use_triton and triton_precision == "bf16" and normalize != "mean"
    left_mean, right_mean, left_dev, right_dev, terms, mean_sq = _stage2(st, use_triton, low, variance, averaged)
    mean_var = mean_variance(left_dev, right_dev, numel) if normalize == "mean" else None
    omega = st.A.mT  # the "first sketch" of the tile pass is masked @ A^T
    kwargs = dict(tau=tau, normalize=normalize, mean_var=mean_var, mean_sq=mean_sq, precision=triton_precision,
                  **({} if terms is None else {"terms": terms}))
    if use_triton:
        masked, GAt, stats, energy_total = triton_kernels.tile_pass_triton(
            left_mean, right_mean, left_dev, right_dev, omega.contiguous(), **kwargs)
    else:
        masked, GAt, stats, energy_total = tile_pass_torch(
            left_mean, right_mean, left_dev, right_dev, omega, tile_elements=tile_elements, **kwargs)
    _set_gir(stats, mean_var, left_dev, right_dev, numel)
    work = st.A.dtype
    gA_mean, gB_mean = st.gA.mean(dim=1), st.gB.mean(dim=1)
    s = st.scaling.view(-1, 1, 1)
    if tau == 0:
        gA_new, gB_new = gA_mean, gB_mean
    else:
        skinny = use_triton and masked.dtype in triton_kernels.SKINNY_DTYPES
        BtG = _times(masked, st.B.to(masked.dtype), True, skinny, False).mT.to(work)  # r x in
        # the same products of Gbar = s (gB_mean A + B gA_mean), from the factors
        GAt_mean = s * (gB_mean @ (st.A @ st.A.mT) + st.B @ (gA_mean @ st.A.mT))
        BtG_mean = s * ((st.B.mT @ gB_mean) @ st.A + (st.B.mT @ st.B) @ gA_mean)
        dA, dB = tangent_from_products(st.A, st.B, GAt.to(work) - GAt_mean, BtG - BtG_mean, s, damping)
        gA_new, gB_new = gA_mean + dA, gB_mean + dB
    return gA_new, gB_new, stats, _reconstruction_energy(st, gA_new, gB_new) / energy_total.clamp_min(
        torch.finfo(torch.float64).tiny)


def _reconstruction_energy(st: Stack, gA: torch.Tensor, gB: torch.Tensor) -> torch.Tensor:
    """||s (gB A + B gA)||_F^2 per module, float64, from r x r Grams."""
    A, B, gA, gB = (t.double() for t in (st.A, st.B, gA, gB))
    s2 = st.scaling.double() ** 2
    cross = ((gB.mT @ B) * (gA @ A.mT).mT).sum(dim=(-2, -1))  # <gB A, B gA>
    total = ((gB.mT @ gB) * (A @ A.mT)).sum(dim=(-2, -1)) + ((B.mT @ B) * (gA @ gA.mT)).sum(dim=(-2, -1))
    return s2 * (total + 2 * cross)


def _tangent_results(modules: Sequence[ModuleGrads], stacks: Sequence[Stack], outs: Sequence[tuple]) -> TiledResults:
    """One ``(gA_new, gB_new, stats)`` per module in the caller's order from the stacks'
    :func:`tangent_stack` results, cast to each module's dtype."""
    device = modules[0].gA.device if modules else torch.device("cpu")
    keys = [*outs[0][2], "energy_kept"] if outs else []
    values = torch.empty(len(keys), len(modules), dtype=torch.float64, device=device)
    outputs, start = [], 0
    for st, (gA_new, gB_new, stats, energy_kept) in zip(stacks, outs):
        dtype = modules[st.positions[0]].gA.dtype
        outputs.append((start, gA_new.to(dtype), gB_new.to(dtype)))
        values[:, start: start + len(st.positions)].copy_(
            torch.stack([*(v.double() for v in stats.values()), energy_kept.double()]))
        start += len(st.positions)
    table = StatsTable(keys, values, send=False)
    results = _in_caller_order(modules, stacks, outputs, table)
    if modules:
        table.send()
    return TiledResults(results, [t for _, gA, gB in outputs for t in (gA, gB)])


def _chain_rule_operands(st: Stack, proj: Projected):
    """``(s B^T Q, s small A^T, small)`` of a stack in the work dtype: the chain-rule products
    that do not need the eigendecomposition, queued before it waits for the device."""
    work = proj.Q.dtype
    small = proj.small.to(work)  # the single pass solves for it in float64
    s = st.scaling.view(-1, 1, 1).to(work)
    return (st.B.mT @ proj.Q) * s, (small @ st.A.mT) * s, small


def _chain_rule_gradients(proj: Projected, operands, eig, gA_out: torch.Tensor, gB_out: torch.Tensor):
    """A stack's factor gradients by the chain rule, written into ``gA_out`` and ``gB_out``, from
    the projector onto the top eigenvectors W of small's Gram: the rank-k truncation is
    ``g~ = U S Vh = Q W W^T small``, so ``dA = s B^T g~ = (s B^T Q)(W W^T) small`` and
    ``dB = s g~ A^T = Q (W W^T)(s small A^T)``. Same result as the SVD split mapped by
    :func:`iga_ds.methods.iga.reference.chain_rule_factors`, in a third of the operators.
    Returns the kept energy."""
    left, right, small = operands
    evals, evecs = eig
    top = evecs[..., -proj.rank:]  # ascending order: the last k; W W^T does not depend on order or signs
    projector = (top @ top.mT).to(small.dtype)
    _product_into(left @ projector, small, gA_out)
    _product_into(proj.Q, projector @ right, gB_out)
    return _energy_kept(proj, evals)


def _product_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b``, written in place (cast where ``out`` has another dtype)."""
    if out.dtype == a.dtype:
        torch.matmul(a, b, out=out)
    else:
        out.copy_(a @ b)


def _energy_kept(proj: Projected, evals: torch.Tensor) -> torch.Tensor:
    """The share of ||masked||_F^2 the rank-k truncation keeps: the top k eigenvalues of
    small's Gram (S^2, float64) over the total."""
    kept = evals[..., -proj.rank:].clamp_min(0).sum(dim=-1)
    total = proj.energy_total
    return torch.where(total > 0, kept / total, 1.0)


def batched_iga(
    modules: Sequence[ModuleGrads],
    options: IGAOptions = IGAOptions(),
    *,
    generators: Sequence[SketchKey | torch.Generator | None],
    averages: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    batch_bytes: int | str = "auto",
    tile_elements: int = DEFAULT_TILE_ELEMENTS,
    use_triton: bool | None = None,
    triton_precision: str = "ieee",
) -> list[tuple[torch.Tensor, torch.Tensor, MutableMapping[str, float]]]:
    """IGA (continuous mask) for every module, in the order given, as
    :func:`iga_ds.methods.iga.reference.iga_update` with the same options and each module's
    generator would (``generators``: one per module, read by the ``svd`` projection only: the
    registered method passes None each under ``tangent``); one ``(gA_new, gB_new, stats)`` per module, ``stats`` a
    :class:`iga_ds.methods.iga.tiles.PendingStats` (its copy to the host queued, not waited for).
    ``projection="tangent"``: :func:`tangent_stack`; ``"svd"``: the randomized (or
    ``single_pass``) SVD of the stages above, its factors by ``factors``.
    Peak memory per module is one out x in matrix plus row-tile temporaries, not N.
    ``batch_bytes`` caps the bytes of masked matrices stacked at once (``"auto"``: 1 GiB on
    the CPU, on CUDA up to 4 GiB of what the device's peak leaves free; the result does not
    depend on it); ``tile_elements`` caps a row tile's temporaries. ``use_triton``: None picks
    Triton for float32 CUDA tensors when it imports. ``triton_precision``: the kernels'
    ``tl.dot`` precision (``options.precision`` resolved: :meth:`IGA.precision_for`), "ieee",
    "tf32x3", "tf32" or "bf16" (masked matrices stored and multiplied in bfloat16, float32
    accumulation; docs/PERFORMANCE.md has the precision rule).
    float16/bfloat16 inputs are computed in float32 and returned in their own dtype. ``variance``:
    ``ema`` takes ``averages`` (one ``(gA, gB)`` pair per module), ``debiased`` 2N per-(domain,
    half) means; both run the PyTorch tile pass (:class:`VarianceTerms`)."""
    o = options
    _check(modules, generators, o.svd, triton_precision)
    _check_variance(modules, o.normalize, o.variance, averages)
    device = modules[0].gA.device if modules else torch.device("cpu")
    use_triton = use_triton if o.variance == DEFAULT_VARIANCE else False
    if o.projection == "tangent":
        return _batched_tangent(modules, generators, tau=o.tau, normalize=o.normalize, damping=o.damping,
                                batch_bytes=batch_bytes, tile_elements=int(tile_elements), use_triton=use_triton,
                                triton_precision=triton_precision, variance=o.variance, averages=averages)
    # bf16 masked matrices take half the bytes: twice the modules per stack, half the launches
    element_bytes = triton_kernels.masked_dtype(triton_precision).itemsize
    stacks = _stacks(modules, generators, o.rank, resolve_batch_bytes(batch_bytes, device),
                     element_bytes if triton_precision == "bf16" else None)
    projected = []
    for st in stacks:  # the masked matrices of one stack are freed before the next is built
        # the kernel computes in float32; float64 stays on the PyTorch path
        triton_ok = _triton_wanted(use_triton, st.A.device) and st.A.dtype == torch.float32
        projected.append(project_stack(
            st, tau=o.tau, normalize=o.normalize, rank=o.rank, oversample=o.oversample,
            power_iters=o.power_iters, tile_elements=int(tile_elements), use_triton=triton_ok,
            triton_precision=triton_precision, svd=o.svd, variance=o.variance, averaged=_averaged(st, averages),
        ))
    return _finish_stacks(modules, stacks, projected, o.factors)


def _check_variance(modules: Sequence[ModuleGrads], normalize: str, variance: str, averages) -> None:
    check_choice(variance, VARIANCES, "variance")
    if variance == "ema" and (averages is None or len(averages) != len(modules)):
        raise ValueError(f"variance 'ema' needs one (gA, gB) pair of averages per module: got "
                         f"{'none' if averages is None else len(averages)} for {len(modules)} modules")
    if variance != "ema" and averages is not None:
        raise ValueError(f"averages act only with variance 'ema', and variance is {variance!r}")
    if variance == "debiased":
        if normalize == "mean":
            raise ValueError("variance 'debiased' with normalize 'mean' has no batched form (the clamped V's mean "
                             "needs a pass of its own): use the reference implementation")
        for m in modules:
            if m.num_domains % 2:
                raise ValueError(f"variance 'debiased' needs 2N per-(domain, half) gradients, got {m.num_domains} "
                                 f"for module {m.name}")


def _averaged(st: Stack, averages) -> Stack | None:
    """``ema``'s averages at the stack's positions, stacked as the stack (None without them)."""
    if averages is None:
        return None
    work = st.A.dtype
    return dataclasses.replace(st, gA=torch.stack([averages[i][0] for i in st.positions]).to(work),
                               gB=torch.stack([averages[i][1] for i in st.positions]).to(work))


def _batched_tangent(modules, generators, *, tau, normalize, damping, batch_bytes, tile_elements, use_triton,
                     triton_precision, variance=DEFAULT_VARIANCE, averages=None) -> TiledResults:
    device = modules[0].gA.device if modules else torch.device("cpu")
    element_bytes = triton_kernels.masked_dtype(triton_precision).itemsize
    stacks = _stacks(modules, generators, None, resolve_batch_bytes(batch_bytes, device),
                     element_bytes if triton_precision == "bf16" else None)
    outs = []
    for st in stacks:
        triton_ok = _triton_wanted(use_triton, st.A.device) and st.A.dtype == torch.float32
        outs.append(tangent_stack(st, tau=tau, normalize=normalize, damping=damping, tile_elements=tile_elements,
                                  use_triton=triton_ok, triton_precision=triton_precision, variance=variance,
                                  averaged=_averaged(st, averages)))
    return _tangent_results(modules, stacks, outs)


def _finish_stacks(modules: Sequence[ModuleGrads], stacks: Sequence[Stack], projected: Sequence[Projected],
                   factors: str) -> list:
    """The small SVDs and the factor gradients of every stack: one ``(gA_new, gB_new, stats)``
    per module in the caller's order, each in its module's dtype, ``stats`` a column of one
    :class:`iga_ds.methods.iga.tiles.StatsTable` for all modules (read when first used); a
    :class:`iga_ds.methods.iga.tiles.TiledResults` whose bases are the stacks' result buffers.

    On the Triton path nothing here waits for the device (the eigendecompositions are
    :func:`iga_ds.methods.iga.jacobi.eigh`'s). Elsewhere ``torch.linalg.eigh`` waits for it, and
    the device then waits for each launch the host issues: so what does not need its result
    and costs the host time (the small matrices in float64 for the SVD split, the results'
    storage and per-module views, the statistics' table) is built before it, and the chain
    rule's first products, which do not need it either, are issued after it, where the device
    runs them while the host issues what follows."""
    chain_rule = factors == "chain_rule"
    # the SVD split needs the small matrices in float64; the chain rule only their Grams
    smalls64 = [None if chain_rule else proj.small.double() for proj in projected]
    device = modules[0].gA.device if modules else torch.device("cpu")
    keys = [*projected[0].stats, "energy_kept"] if projected else []
    values = torch.empty(len(keys), len(modules), dtype=torch.float64, device=device)
    outputs, start = [], 0
    for st, proj in zip(stacks, projected):
        M, _, r, d_in = st.gA.shape
        dtype = modules[st.positions[0]].gA.dtype  # a stack holds modules of one dtype
        outputs.append((start, st.A.new_empty((M, r, d_in), dtype=dtype),
                        st.B.new_empty((M, st.B.shape[1], r), dtype=dtype)))
        values[:-1, start: start + M].copy_(torch.stack([v.double() for v in proj.stats.values()]))
        start += M
    table = StatsTable(keys, values, send=False)
    results = _in_caller_order(modules, stacks, outputs, table)
    eigs = _gram_eigh([proj.small for proj in projected], any(proj.use_triton for proj in projected))
    operands = [_chain_rule_operands(st, proj) if chain_rule else None for st, proj in zip(stacks, projected)]
    for st, proj, small64, eig, ops, (start, gA_out, gB_out) in zip(stacks, projected, smalls64, eigs, operands,
                                                                    outputs):
        if chain_rule:
            energy_kept = _chain_rule_gradients(proj, ops, eig, gA_out, gB_out)
        else:
            gA_new, gB_new, energy_kept = _factor_gradients(st, proj, small64, eig)
            gA_out.copy_(gA_new)
            gB_out.copy_(gB_new)
        values[-1, start: start + len(st.positions)].copy_(energy_kept)
    if modules:
        table.send()
    return TiledResults(results, [t for _, gA_out, gB_out in outputs for t in (gA_out, gB_out)])


def _in_caller_order(modules: Sequence[ModuleGrads], stacks: Sequence[Stack], outputs, table: StatsTable) -> list:
    """One ``(gA_new, gB_new, stats)`` per module in the caller's order: views of the stacks'
    result buffers ``outputs`` (``(first column, gA, gB)`` per stack) and columns of ``table``."""
    results: list = [None] * len(modules)
    # one unbind per stack, not one indexing operator per module
    for st, (start, gA_out, gB_out) in zip(stacks, outputs):
        for column, (pos, gA, gB) in enumerate(zip(st.positions, gA_out.unbind(0), gB_out.unbind(0)), start):
            results[pos] = (gA, gB, table.column(column))
    return results


def _triton_wanted(use_triton: bool | None, device: torch.device) -> bool:
    if use_triton is False or device.type != "cuda":
        if use_triton and device.type != "cuda":
            raise ValueError("use_triton=True needs CUDA tensors")
        return False
    if use_triton and not triton_kernels.available():
        raise ValueError("use_triton=True but Triton is not installed")
    return triton_kernels.available()
