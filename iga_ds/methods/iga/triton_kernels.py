"""Triton kernels for the IGA tile pass on CUDA: reconstruct, mean, variance, mask, in registers.

Each program owns a BM x BN tile of one module's out x in matrix. From the rank-2r factors it
forms the tile of Gbar and, for every domain n, the tile of the deviation D[n] (the last as
minus the sum of the others: they sum to zero); it squares and sums them into V, applies
exp(-tau V'), writes only ``Gbar * mask`` and per-tile partial sums for the mask statistics.
The N full-rank gradients never exist in device memory. A second pair of kernels builds
those factors from the per-domain gradients (:func:`stack_factors_triton`). The sketching kernel
(``svd="single_pass"``) writes not even that: only each tile's share of the two sketches of
the single-pass SVD. The PyTorch tile pass in :mod:`iga_ds.methods.iga.batched` is the reference this
kernel is tested against.

Import-guarded: without Triton, :func:`available` is False and nothing here is compiled.
Only float32 inputs run here (float64 stays on the PyTorch path). ``precision`` is Triton's
``input_precision`` of ``tl.dot``: ``"ieee"`` (default, true float32), ``"tf32x3"`` (three
TF32 products, close to float32 and faster on tensor cores) or ``"tf32"``; or ``"bf16"``:
the factors arrive rounded to bfloat16 (half the bytes to load), the products run on bf16
tensor cores with float32 accumulation, the mask and statistics stay float32, and the masked
matrix is stored in whatever dtype ``out`` has (bfloat16 on that path).
"""
from __future__ import annotations

import math
import os

import torch

from iga_ds.methods.device_copies import host_to_device
from iga_ds.methods.iga import sketch
from iga_ds.methods.iga.common import SNR_EPS

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs lack it
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

_NORM_CODE = {"none": 0, "mean": 1, "snr": 2}
PRECISIONS = ("ieee", "tf32x3", "tf32", "bf16")
# the factors' dtype in memory for each precision (bf16: rounded once on the host, half the loads)
FACTOR_DTYPES = {"ieee": torch.float32, "tf32x3": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}


# partial sums per program of the tile kernels: mask, mask below 1/2, masked^2 (the sum of V,
# the "gir" statistic, comes from the factors' Grams: iga_ds.methods.iga.batched.mask_scales)
STAT_SLOTS = 3

# tiles per program of the tile kernel, by precision. bf16: a strip of 32 tiles along a row (a
# longer strip amortizes the left factors' loads over more tiles); float32
# keeps one: its dot inside the loop compiled many times slower
STRIP_TILES = {"bf16": 32}


# domains whose left factors the tile kernel can hold for a whole strip (HOIST)
MAX_HOISTED_DOMAINS = 5

# compiler options of every launch: multiply-adds fused, as the kernels were measured and tested
# (recent Tritons leave it off unless asked for, which would split each multiply-add in two and
# move the results by a rounding)
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


def mask_coefficients(mean_var: torch.Tensor, tau: float, num_domains: int, normalize: str) -> torch.Tensor:
    """Each module's multiplier of N V in the exponent of the kernels' mask (``mean_var`` gives
    the modules' count and device where ``normalize`` is not "mean"):
    ``exp(-tau V') = exp2(c N V [/ (Gbar^2 + eps)])`` with ``c = -tau log2(e) / N``, divided by
    the mean of V for ``normalize="mean"`` (0 where that mean is 0: V' is 0 there), float32."""
    c = -float(tau) * math.log2(math.e) / num_domains
    if normalize != "mean":
        return torch.full(mean_var.shape, c, dtype=torch.float32, device=mean_var.device)
    positive = mean_var > 0
    return torch.where(positive, c / torch.where(positive, mean_var, 1.0), 0.0).float().contiguous()


def fast_math() -> bool:
    """Whether the kernels may use the device library's approximate arithmetic (:func:`_divide`):
    on a GPU, not under Triton's interpreter (``TRITON_INTERPRET=1``), which runs the kernels
    on the CPU without that library."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def strip_tiles(precision: str) -> int:
    """Tiles along a row that one program of the tile kernel handles at ``precision``."""
    return STRIP_TILES.get(precision, 1)


def available() -> bool:
    return triton is not None


def masked_dtype(precision: str) -> torch.dtype:
    """The dtype the masked matrices are stored in: bfloat16 for ``"bf16"`` (half the bytes for
    every later pass over them), else float32."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


if triton is not None:

    @triton.jit
    def _load_factor(ptr, rows, cols, n_rows, n_cols, row_stride):
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)

    @triton.jit
    def _dot(a, b, PRECISION: tl.constexpr):
        """a @ b with float32 accumulation: bf16 operands for "bf16", else tl.dot's input_precision."""
        if PRECISION == "bf16":
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        else:
            return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def _divide(a, b, FAST: tl.constexpr):
        """``a / b``; ``FAST``: the approximate reciprocal and one multiply, 2 instructions
        where ``/`` takes 8 (its range checks), within 2 ulp for ``|b|`` in [2^-126, 2^126],
        where the mask's denominator (``Gbar^2`` plus a floor of at least 2^-126) stays: the
        tile kernel's time follows its elementwise instructions. Not in Triton's interpreter,
        which has no device library."""
        if FAST:
            return libdevice.fast_dividef(a, b)
        else:
            return a / b

    @triton.jit
    def _mask(gbar, var, total, coef_ptr, eps_ptr, mod, NORM: tl.constexpr, FAST: tl.constexpr):
        """exp(-tau V') of a tile from Gbar and the deviations' sum of squares ``var`` and sum
        ``total``: N V = var + total^2 (the last deviation is minus the sum of the others).
        ``coef_ptr`` holds each module's multiplier of N V in base 2 (:func:`mask_coefficients`):
        one multiply and an exp2 per element, the division only for "snr"."""
        v = (var + total * total) * tl.load(coef_ptr + mod)
        if NORM == 2:
            v = _divide(v, gbar * gbar + tl.load(eps_ptr + mod), FAST)
        return tl.exp2(v)

    @triton.jit
    def _deviation(lhs, right_dev, mod, n, ks, cols, d_in, k2, N: tl.constexpr, PRECISION: tl.constexpr):
        """Deviation n's tile from its left factor (loaded) and its right factor."""
        rhs = _load_factor(right_dev + (mod * N + n) * k2 * d_in, ks, cols, k2, d_in, d_in)
        return _dot(lhs, rhs, PRECISION)

    @triton.jit
    def _apply_mask(gbar, var, total, coef_ptr, eps_ptr, mod, rows, cols, d_out, d_in, NORM: tl.constexpr,
                    EVEN: tl.constexpr, FAST: tl.constexpr):
        """``(Gbar * mask, mask, valid)`` of a tile; ``EVEN``: the tile lies inside the matrix
        (no element to mask out, no select per element: the kernel's arithmetic is per element)."""
        mask = _mask(gbar, var, total, coef_ptr, eps_ptr, mod, NORM, FAST)
        valid = (rows[:, None] < d_out) & (cols[None, :] < d_in)
        if EVEN:
            masked = gbar * mask
        else:
            masked = tl.where(valid, gbar * mask, 0.0)
        return masked, mask, valid

    @triton.jit
    def _masked_tile(left_mean, right_mean, left_dev, right_dev, coef_ptr, eps_ptr, mod, rows, cols,
                     d_out, d_in, k2, N: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr = False,
                     FAST: tl.constexpr = False):
        """One BM x BN tile of Gbar * exp(-tau V') and its mask, from the rank-2r factors."""
        ks = tl.arange(0, KP)  # 2r padded to a power of two >= 16 (tl.dot's minimum); pads load as 0
        lhs = _load_factor(left_mean + mod * d_out * k2, rows, ks, d_out, k2, k2)
        rhs = _load_factor(right_mean + mod * k2 * d_in, ks, cols, k2, d_in, d_in)
        gbar = _dot(lhs, rhs, PRECISION)
        # the deviations from the mean sum to zero, so the last is minus the sum of the others:
        # one product of N + 1 fewer (the products are the kernel's arithmetic); the sums start
        # from the first deviation (the compiler keeps an addition to zero: 0 + x is not x for -0)
        if N > 1:
            dev = _deviation(_load_factor(left_dev + mod * N * d_out * k2, rows, ks, d_out, k2, k2), right_dev,
                             mod, 0, ks, cols, d_in, k2, N, PRECISION)
            var, total = dev * dev, dev
        else:
            var = tl.zeros((BM, BN), dtype=tl.float32)
            total = tl.zeros((BM, BN), dtype=tl.float32)
        for n in tl.static_range(1, N - 1):
            lhs = _load_factor(left_dev + (mod * N + n) * d_out * k2, rows, ks, d_out, k2, k2)
            dev = _deviation(lhs, right_dev, mod, n, ks, cols, d_in, k2, N, PRECISION)
            var, total = var + dev * dev, total + dev
        return _apply_mask(gbar, var, total, coef_ptr, eps_ptr, mod, rows, cols, d_out, d_in, NORM, EVEN, FAST)

    @triton.jit
    def _left_deviation(left_dev, mod, n: tl.constexpr, rows, ks, d_out, k2, N: tl.constexpr,
                        BM: tl.constexpr, KP: tl.constexpr):
        """Deviation n's left factor on these rows, or zeros past the N - 1 the kernel multiplies
        (never used, so never computed)."""
        if n < N - 1:
            return _load_factor(left_dev + (mod * N + n) * d_out * k2, rows, ks, d_out, k2, k2)
        else:
            return tl.zeros((BM, KP), dtype=left_dev.dtype.element_ty)

    @triton.jit
    def _hoisted_tile(lhs_mean, lhs0, lhs1, lhs2, lhs3, right_mean, right_dev, coef_ptr, eps_ptr, mod, rows, cols,
                      ks, d_out, d_in, k2, N: tl.constexpr, NORM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      PRECISION: tl.constexpr, EVEN: tl.constexpr, FAST: tl.constexpr):
        """:func:`_masked_tile` from left factors loaded once per strip (N <= 5)."""
        gbar = _dot(lhs_mean, _load_factor(right_mean + mod * k2 * d_in, ks, cols, k2, d_in, d_in), PRECISION)
        if N > 1:
            dev = _deviation(lhs0, right_dev, mod, 0, ks, cols, d_in, k2, N, PRECISION)
            var, total = dev * dev, dev
        else:
            var = tl.zeros((BM, BN), dtype=tl.float32)
            total = tl.zeros((BM, BN), dtype=tl.float32)
        if N > 2:
            dev = _deviation(lhs1, right_dev, mod, 1, ks, cols, d_in, k2, N, PRECISION)
            var, total = var + dev * dev, total + dev
        if N > 3:
            dev = _deviation(lhs2, right_dev, mod, 2, ks, cols, d_in, k2, N, PRECISION)
            var, total = var + dev * dev, total + dev
        if N > 4:
            dev = _deviation(lhs3, right_dev, mod, 3, ks, cols, d_in, k2, N, PRECISION)
            var, total = var + dev * dev, total + dev
        return _apply_mask(gbar, var, total, coef_ptr, eps_ptr, mod, rows, cols, d_out, d_in, NORM, EVEN, FAST)

    @triton.jit
    def _program_tile(left_mean, right_mean, left_dev, right_dev, coef_ptr, eps_ptr, d_out, d_in, k2,
                      N: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      PRECISION: tl.constexpr, FAST: tl.constexpr):
        """This program's tile: grid (row tiles, column tiles, modules)."""
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        mod = tl.program_id(2).to(tl.int64)
        rows = pid_r * BM + tl.arange(0, BM)
        cols = pid_c * BN + tl.arange(0, BN)
        masked, mask, valid = _masked_tile(
            left_mean, right_mean, left_dev, right_dev, coef_ptr, eps_ptr, mod, rows, cols, d_out, d_in, k2,
            N, NORM, KP, BM, BN, PRECISION, False, FAST)
        return pid_r, pid_c, mod, rows, cols, masked, mask, valid

    @triton.jit
    def _store_tile_stats(part_ptr, min_ptr, mod, masked, mask, valid, pid_r, pid_c):
        # per-tile partial sums, reduced in float64 on the host side of the kernel: deterministic
        tile = pid_r * tl.num_programs(1) + pid_c
        n_tiles = tl.num_programs(0) * tl.num_programs(1)
        base = part_ptr + (mod * n_tiles + tile) * 3
        tl.store(base + 0, tl.sum(tl.sum(tl.where(valid, mask, 0.0), axis=1), axis=0))
        tl.store(base + 1, tl.sum(tl.sum(tl.where(valid & (mask < 0.5), 1.0, 0.0), axis=1), axis=0))
        tl.store(base + 2, tl.sum(tl.sum(masked * masked, axis=1), axis=0))
        tl.store(min_ptr + mod * n_tiles + tile, tl.min(tl.min(tl.where(valid, mask, float("inf")), axis=1), axis=0))

    @triton.jit
    def _accumulate_stats(acc_mask, acc_low, acc_min, acc_sq, masked, mask, valid, EVEN: tl.constexpr):
        """A tile's statistics summed along its rows into the strip's accumulators."""
        if EVEN:
            acc_mask += tl.sum(mask, axis=1)
            acc_low += tl.sum((mask < 0.5).to(tl.float32), axis=1)
            acc_min = tl.minimum(acc_min, tl.min(mask, axis=1))
        else:
            acc_mask += tl.sum(tl.where(valid, mask, 0.0), axis=1)
            acc_low += tl.sum(tl.where(valid & (mask < 0.5), 1.0, 0.0), axis=1)
            acc_min = tl.minimum(acc_min, tl.min(tl.where(valid, mask, float("inf")), axis=1))
        acc_sq += tl.sum(masked * masked, axis=1)
        return acc_mask, acc_low, acc_min, acc_sq

    @triton.jit
    def _iga_tile_kernel(
        left_mean, right_mean, left_dev, right_dev, coef_ptr, eps_ptr, out_ptr, part_ptr, min_ptr,
        d_out, d_in, k2,
        N: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        PRECISION: tl.constexpr, STATS: tl.constexpr = True, COLS: tl.constexpr = 1, EVEN: tl.constexpr = False,
        HOIST: tl.constexpr = False, FAST: tl.constexpr = False,
    ):
        """Writes Gbar * mask for a strip of ``COLS`` tiles along a row (the randomized SVD reads
        it afterwards). The statistics are summed along each row of the strip as it goes and
        reduced to one partial sum per program at the end: a reduction across the whole tile
        per tile cost more than the tile's arithmetic. ``STATS`` False skips them
        (tools/tune_method.py times their cost). ``EVEN``: the strips tile the matrix exactly.
        ``HOIST`` (N <= 5): the strip's left factors are loaded once, not once per tile, which
        saves their loads where registers hold them. ``FAST``: the
        mask's division by the approximate reciprocal (:func:`_divide`)."""
        pid_r = tl.program_id(0)
        pid_g = tl.program_id(1)
        mod = tl.program_id(2).to(tl.int64)
        rows = pid_r * BM + tl.arange(0, BM)
        ks = tl.arange(0, KP)
        acc_mask = tl.zeros((BM,), dtype=tl.float32)
        acc_low = tl.zeros((BM,), dtype=tl.float32)
        acc_sq = tl.zeros((BM,), dtype=tl.float32)
        acc_min = tl.full((BM,), float("inf"), dtype=tl.float32)
        if HOIST:
            lhs_mean = _load_factor(left_mean + mod * d_out * k2, rows, ks, d_out, k2, k2)
            lhs0 = _left_deviation(left_dev, mod, 0, rows, ks, d_out, k2, N, BM, KP)
            lhs1 = _left_deviation(left_dev, mod, 1, rows, ks, d_out, k2, N, BM, KP)
            lhs2 = _left_deviation(left_dev, mod, 2, rows, ks, d_out, k2, N, BM, KP)
            lhs3 = _left_deviation(left_dev, mod, 3, rows, ks, d_out, k2, N, BM, KP)
        for c in range(COLS):
            cols = (pid_g * COLS + c) * BN + tl.arange(0, BN)
            if HOIST:
                masked, mask, valid = _hoisted_tile(
                    lhs_mean, lhs0, lhs1, lhs2, lhs3, right_mean, right_dev, coef_ptr, eps_ptr, mod, rows, cols, ks,
                    d_out, d_in, k2, N, NORM, BM, BN, PRECISION, EVEN, FAST)
            else:
                masked, mask, valid = _masked_tile(
                    left_mean, right_mean, left_dev, right_dev, coef_ptr, eps_ptr, mod, rows, cols, d_out, d_in,
                    k2, N, NORM, KP, BM, BN, PRECISION, EVEN, FAST)
            target = out_ptr + mod * d_out * d_in + rows[:, None] * d_in + cols[None, :]
            if EVEN:
                tl.store(target, masked)
            else:
                tl.store(target, masked, mask=valid)
            if STATS:
                acc_mask, acc_low, acc_min, acc_sq = _accumulate_stats(acc_mask, acc_low, acc_min, acc_sq, masked,
                                                                       mask, valid, EVEN)
        if STATS:
            program = pid_r * tl.num_programs(1) + pid_g
            n_programs = tl.num_programs(0) * tl.num_programs(1)
            base = part_ptr + (mod * n_programs + program) * 3
            tl.store(base + 0, tl.sum(acc_mask, axis=0))
            tl.store(base + 1, tl.sum(acc_low, axis=0))
            tl.store(base + 2, tl.sum(acc_sq, axis=0))
            tl.store(min_ptr + mod * n_programs + program, tl.min(acc_min, axis=0))

    @triton.jit
    def _iga_sketch_kernel(
        left_mean, right_mean, left_dev, right_dev, coef_ptr, eps_ptr, omega_ptr, psi_ptr, y_part, w_part,
        part_ptr, min_ptr, d_out, d_in, k2, width, co_width,
        N: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        WP: tl.constexpr, LP: tl.constexpr, PRECISION: tl.constexpr, FAST: tl.constexpr = False,
    ):
        """Single pass: both sketches of the tile, nothing of the masked matrix stored.

        The tile's share of Y = masked @ omega goes to slot pid_c of ``y_part`` (modules x
        column tiles x out x width) and its share of W = psi @ masked to slot pid_r of
        ``w_part`` (modules x row tiles x co_width x in); the host sums the slots, so the result
        does not depend on the order programs run in (no atomics).
        """
        pid_r, pid_c, mod, rows, cols, masked, mask, valid = _program_tile(
            left_mean, right_mean, left_dev, right_dev, coef_ptr, eps_ptr, d_out, d_in, k2,
            N, NORM, KP, BM, BN, PRECISION, FAST)
        ws = tl.arange(0, WP)  # width padded to a power of two >= 16; pads load as 0
        omega = _load_factor(omega_ptr + mod * d_in * width, cols, ws, d_in, width, width)
        y = _dot(masked, omega, PRECISION)  # BM x WP
        n_col_tiles = tl.num_programs(1)
        y_base = y_part + (mod * n_col_tiles + pid_c) * d_out * width
        tl.store(y_base + rows[:, None] * width + ws[None, :], y,
                 mask=(rows[:, None] < d_out) & (ws[None, :] < width))
        ls = tl.arange(0, LP)
        psi = _load_factor(psi_ptr + mod * co_width * d_out, ls, rows, co_width, d_out, d_out)
        w = _dot(psi, masked, PRECISION)  # LP x BN
        n_row_tiles = tl.num_programs(0)
        w_base = w_part + (mod * n_row_tiles + pid_r) * co_width * d_in
        tl.store(w_base + ls[:, None] * d_in + cols[None, :], w,
                 mask=(ls[:, None] < co_width) & (cols[None, :] < d_in))
        _store_tile_stats(part_ptr, min_ptr, mod, masked, mask, valid, pid_r, pid_c)


    @triton.jit
    def _left_factors_kernel(gB, B, scaling, left_mean, left_dev, d_out, r, stride_gB, stride_B,
                             N: tl.constexpr, RP: tl.constexpr, BR: tl.constexpr):
        """BR rows of one module's left factors, as :func:`iga_ds.methods.iga.batched.stack_factors`
        forms them: ``left_mean = [mean_n gB[n], B] s`` (float32) and ``left_dev[n] =
        [(gB[n] - mean) s, B s]`` (in ``left_dev``'s dtype), gB read once more from cache."""
        mod = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cs = tl.arange(0, RP)
        inside = (rows[:, None] < d_out) & (cs[None, :] < r)
        at = rows[:, None] * r + cs[None, :]
        s = tl.load(scaling + mod)
        total = tl.zeros((BR, RP), dtype=tl.float32)
        for n in tl.static_range(N):
            total += tl.load(gB + mod * stride_gB + n * d_out * r + at, mask=inside, other=0.0)
        mean = total / N
        b = tl.load(B + mod * stride_B + at, mask=inside, other=0.0) * s
        k2 = 2 * r
        out = rows[:, None] * k2 + cs[None, :]
        tl.store(left_mean + mod * d_out * k2 + out, mean * s, mask=inside)
        tl.store(left_mean + mod * d_out * k2 + out + r, b, mask=inside)
        dev_type = left_dev.dtype.element_ty
        for n in tl.static_range(N):
            g = tl.load(gB + mod * stride_gB + n * d_out * r + at, mask=inside, other=0.0)
            base = left_dev + (mod * N + n) * d_out * k2 + out
            tl.store(base, ((g - mean) * s).to(dev_type), mask=inside)
            tl.store(base + r, b.to(dev_type), mask=inside)

    @triton.jit
    def _right_factors_kernel(gA, A, right_mean, right_dev, d_in, r, stride_gA, stride_A,
                              N: tl.constexpr, RP: tl.constexpr, BC: tl.constexpr):
        """BC columns of one module's right factors: ``right_mean = [A; mean_n gA[n]]`` (float32)
        and ``right_dev[n] = [A; gA[n] - mean]`` (in ``right_dev``'s dtype)."""
        mod = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0) * BC + tl.arange(0, BC)
        ks = tl.arange(0, RP)
        inside = (ks[:, None] < r) & (cols[None, :] < d_in)
        at = ks[:, None] * d_in + cols[None, :]
        total = tl.zeros((RP, BC), dtype=tl.float32)
        for n in tl.static_range(N):
            total += tl.load(gA + mod * stride_gA + n * r * d_in + at, mask=inside, other=0.0)
        mean = total / N
        a = tl.load(A + mod * stride_A + at, mask=inside, other=0.0)
        k2 = 2 * r
        tl.store(right_mean + mod * k2 * d_in + at, a, mask=inside)
        tl.store(right_mean + mod * k2 * d_in + r * d_in + at, mean, mask=inside)
        dev_type = right_dev.dtype.element_ty
        for n in tl.static_range(N):
            g = tl.load(gA + mod * stride_gA + n * r * d_in + at, mask=inside, other=0.0)
            base = right_dev + (mod * N + n) * k2 * d_in + at
            tl.store(base, a.to(dev_type), mask=inside)
            tl.store(base + r * d_in, (g - mean).to(dev_type), mask=inside)

    @triton.jit
    def _skinny_kernel(m_ptr, x_ptr, y_ptr, n_rows, n_cols, k, TRANSPOSE: tl.constexpr, BR: tl.constexpr,
                       BK: tl.constexpr, KP: tl.constexpr, PRECISION: tl.constexpr):
        """BR rows of Y = M @ X (M n_rows x n_cols, X n_cols x k) or, with TRANSPOSE, of
        Y = M^T @ X (X n_rows x k), for the module of program axis 1: the contraction runs
        in a loop of BK, so each program streams its BR rows (columns) of M once."""
        pid = tl.program_id(0)
        mod = tl.program_id(1).to(tl.int64)
        out = pid * BR + tl.arange(0, BR)
        ks = tl.arange(0, KP)  # k padded to a power of two >= 16; pads load as 0
        m_base = m_ptr + mod * n_rows * n_cols
        inner_len = n_rows if TRANSPOSE else n_cols
        out_len = n_cols if TRANSPOSE else n_rows
        x_base = x_ptr + mod * inner_len * k
        acc = tl.zeros((BR, KP), dtype=tl.float32)
        for start in range(0, inner_len, BK):
            inner = start + tl.arange(0, BK)
            x = _load_factor(x_base, inner, ks, inner_len, k, k)
            if TRANSPOSE:
                acc += _dot(tl.trans(_load_factor(m_base, inner, out, n_rows, n_cols, n_cols)), x, PRECISION)
            else:
                acc += _dot(_load_factor(m_base, out, inner, n_rows, n_cols, n_cols), x, PRECISION)
        tl.store(y_ptr + mod * out_len * k + out[:, None] * k + ks[None, :], acc,
                 mask=(out[:, None] < out_len) & (ks[None, :] < k))


    @triton.jit
    def _gram64_kernel(x_ptr, out_ptr, K, a, chunk, sx_m, sx_k, sx_a, BK: tl.constexpr, AP: tl.constexpr):
        """One chunk of the contraction of X^T X (X K x a, float32, any strides) in float64 for
        the module of program axis 1: its partial sum goes to slot ``program_id(0)``."""
        split = tl.program_id(0)
        mod = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, AP)
        acc = tl.zeros((AP, AP), dtype=tl.float64)
        for start in range(split * chunk, split * chunk + chunk, BK):
            rows = start + tl.arange(0, BK)
            x = tl.load(x_ptr + mod * sx_m + rows[:, None] * sx_k + cols[None, :] * sx_a,
                        mask=(rows[:, None] < K) & (cols[None, :] < a), other=0.0).to(tl.float64)
            acc += tl.dot(tl.trans(x), x)  # products of float32 values are exact in float64
        slot = mod * tl.num_programs(0) + split
        tl.store(out_ptr + slot * AP * AP + cols[:, None] * AP + cols[None, :], acc)

    @triton.jit
    def _gaussian_kernel(keys_ptr, out_ptr, n, offset, BLOCK: tl.constexpr):
        """BLOCK elements of the stream of the key of program axis 1, as
        :func:`iga_ds.methods.iga.sketch.gaussian_stack` computes them (unsigned 64-bit
        arithmetic here, the same bits)."""
        pid = tl.program_id(0)
        mod = tl.program_id(1).to(tl.int64)
        e = pid * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(keys_ptr + mod).to(tl.uint64, bitcast=True)
        z = key + (e + offset + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        u1 = ((z >> 40).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
        u2 = ((z >> 16) & 0xFFFFFF).to(tl.float32) * 5.9604644775390625e-08
        g = tl.sqrt(-2.0 * tl.log(u1)) * tl.cos(6.283185307179586 * u2)
        tl.store(out_ptr + mod * n + e, g, mask=e < n)


def launch_tile_kernel(left_mean, right_mean, left_dev, right_dev, coefficients, eps, out, parts, mins, *,
                       normalize, block_m: int = 64, block_n: int = 64, precision: str = "ieee", num_warps: int = 4,
                       stats: bool = True, cols: int = 1, hoist: bool = True, num_stages: int | None = None,
                       fast: bool | None = None, max_registers: int | None = None) -> None:
    """The tile kernel alone: writes ``Gbar * exp(-tau V')`` into ``out`` (M x out x in) and, with
    ``stats``, each program's partial sums (mask, mask below 0.5, masked^2) into ``parts``
    (M x programs x :data:`STAT_SLOTS`) and its smallest mask into ``mins`` (M x programs), programs numbered
    row-major; a program covers ``cols`` tiles along a row (:func:`strip_count` per row).

    Inputs as :func:`tile_pass_triton` prepares them: contiguous factors in the precision's
    dtype, ``coefficients`` from :func:`mask_coefficients`, ``eps`` the floor of the ``"snr"``
    denominator per module. ``hoist``: a strip of several tiles loads its left factors once
    (with at most :data:`MAX_HOISTED_DOMAINS` domains). ``fast``: the approximate division
    (default :func:`fast_math`). ``max_registers``: a cap on each thread's registers, which
    sets how many programs share a multiprocessor (None: the compiler's choice).
    :func:`tile_pass_triton` is the stage
    to call; this launch is public so that benchmarks can time the kernel without the
    allocations, the sketch and the reduction around it (``tools/tune_method.py``)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    M, N, d_out, k2 = left_dev.shape
    d_in = right_mean.shape[-1]
    kp = max(16, triton.next_power_of_2(k2))
    grid = (triton.cdiv(d_out, block_m), strip_count(d_in, block_n, cols), M)
    even = d_out % block_m == 0 and d_in % (block_n * cols) == 0
    extra = {} if num_stages is None else {"num_stages": num_stages}
    if max_registers is not None:
        extra["maxnreg"] = max_registers
    _iga_tile_kernel[grid](
        left_mean, right_mean, left_dev, right_dev, coefficients, eps, out, parts, mins, d_out, d_in, k2,
        N=N, NORM=_NORM_CODE[normalize], KP=kp, BM=block_m, BN=block_n, PRECISION=precision, STATS=stats,
        COLS=cols, EVEN=even, HOIST=hoist and cols > 1 and N <= MAX_HOISTED_DOMAINS,
        FAST=fast_math() if fast is None else fast, num_warps=num_warps, **extra, **LAUNCH_OPTIONS)


_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def compile_tile_kernel(*, arch: int = 90, num_domains: int = 4, rank: int = 16, normalize: str = "snr",
                        precision: str = "bf16", cols: int | None = None, fast: bool = True, num_warps: int = 4):
    """The tile kernel compiled for CUDA architecture ``arch`` (90: H100, H200) without a GPU,
    specialized as :func:`launch_tile_kernel` specializes it for LLaMA-like modules (sizes and
    addresses multiples of 16, strips that tile the matrix exactly, 64 x 64 tiles): Triton's
    compiled kernel, whose ``asm`` holds its PTX and machine code, for reading what each element
    costs (``tools/kernel_sass.py``)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    factor = _TRITON_TYPES[FACTOR_DTYPES[precision]]
    names = ("left_mean", "right_mean", "left_dev", "right_dev", "coef_ptr", "eps_ptr", "out_ptr", "part_ptr",
             "min_ptr", "d_out", "d_in", "k2")
    types = [f"*{factor}"] * 4 + ["*fp32", "*fp32", f"*{_TRITON_TYPES[masked_dtype(precision)]}", "*fp32", "*fp32",
                                  "i32", "i32", "i32"]
    cols = strip_tiles(precision) if cols is None else cols
    constants = dict(N=num_domains, NORM=_NORM_CODE[normalize], KP=max(16, triton.next_power_of_2(2 * rank)),
                     BM=64, BN=64, PRECISION=precision, STATS=True, COLS=cols, EVEN=True,
                     HOIST=cols > 1 and num_domains <= MAX_HOISTED_DOMAINS, FAST=fast)
    signature = dict(zip(names, types), **{name: "constexpr" for name in constants})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}
    source = ASTSource(fn=_iga_tile_kernel, signature=signature, constexprs=constants, attrs=aligned)
    options = {"num_warps": num_warps, **LAUNCH_OPTIONS}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def strip_count(d_in: int, block_n: int, cols: int) -> int:
    """Programs along a row of the tile kernel: strips of ``cols`` tiles of ``block_n`` columns."""
    return triton.cdiv(triton.cdiv(d_in, block_n), cols)


def tile_pass_triton(left_mean, right_mean, left_dev, right_dev, omega, *, tau, normalize, mean_var, mean_sq,
                     psi=None, block_m: int = 64, block_n: int = 64, precision: str = "ieee", num_warps: int = 4,
                     partial_bytes: int = 1 << 30, cols: int | None = None, hoist: bool = True):
    """Stage 4 of :mod:`iga_ds.methods.iga.batched` on CUDA, same contract as its PyTorch
    reference :func:`iga_ds.methods.iga.batched.tile_pass_torch`: (masked, or with ``psi`` the
    co-range sketch psi @ masked), first sketch, stats, sum of masked^2. With ``psi`` the
    modules go through the sketching kernel in chunks whose per-tile partial sketches stay
    under ``partial_bytes``. With ``precision="bf16"`` the masked matrices come back in
    bfloat16 (:func:`masked_dtype`); the mean's factors come in float32, the deviations' in
    float32 or already in the precision's dtype. ``cols``: tiles along a row per program of
    the tile kernel (default :func:`strip_tiles`); ``hoist``: as :func:`launch_tile_kernel`'s.
    ``mean_var`` may be None where ``normalize`` is not "mean" (it scales no mask there);
    ``omega`` None (without ``psi``): no first sketch (None in its place), the caller takes it
    with :func:`first_sketch`."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if left_mean.dtype != torch.float32:
        raise ValueError(f"the Triton tile pass runs in float32, got {left_mean.dtype}")
    M, N, d_out, _ = left_dev.shape
    d_in = right_mean.shape[-1]
    cols = strip_tiles(precision) if cols is None else cols
    wanted = FACTOR_DTYPES[precision]
    factors = [t.to(wanted).contiguous() for t in (left_mean, right_mean, left_dev, right_dev)]
    coefficients = mask_coefficients(mean_sq if mean_var is None else mean_var, tau, N, normalize)
    eps = (SNR_EPS * mean_sq + torch.finfo(torch.float32).tiny).float().contiguous()
    device = left_mean.device
    # one partial sum per program: per tile for the sketching kernel, per strip for the tile kernel
    n_tiles = triton.cdiv(d_out, block_m) * (
        triton.cdiv(d_in, block_n) if psi is not None else strip_count(d_in, block_n, cols))
    parts = torch.empty(M, n_tiles, STAT_SLOTS, dtype=torch.float32, device=device)
    mins = torch.empty(M, n_tiles, dtype=torch.float32, device=device)
    blocks = dict(block_m=block_m, block_n=block_n, precision=precision, num_warps=num_warps)
    if psi is None:
        masked = torch.empty(M, d_out, d_in, dtype=masked_dtype(precision), device=device)
        launch_tile_kernel(*factors, coefficients, eps, masked, parts, mins, normalize=normalize, cols=cols,
                           hoist=hoist, **blocks)
        first, sketch = masked, (None if omega is None else first_sketch(masked, omega))
    else:
        first, sketch = _sketch_pass(factors, coefficients, eps, omega, psi, parts, mins, normalize=normalize,
                                     partial_bytes=partial_bytes, **blocks)
    stats, energy = _reduce_tile_stats(parts, mins, d_out * d_in)
    return first, sketch, stats, energy


def first_sketch(masked: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """``masked @ omega`` in float32, omega rounded to the masked matrices' dtype: the skinny
    product for bfloat16, else cuBLAS."""
    omega = omega.to(masked.dtype)
    return skinny_product(masked, omega) if masked.dtype in SKINNY_DTYPES else torch.bmm(masked, omega).float()


def _sketch_pass(factors, coefficients, eps, omega, psi, parts, mins, *, normalize, partial_bytes, block_m, block_n,
                 precision, num_warps):
    """The sketching kernel (single pass) over the modules in chunks: ``(psi @ masked, masked @ omega)``."""
    left_mean, right_mean, left_dev, right_dev = factors
    M, N, d_out, k2 = left_dev.shape
    d_in = right_mean.shape[-1]
    rows_t, cols_t = triton.cdiv(d_out, block_m), triton.cdiv(d_in, block_n)
    width, co_width = omega.shape[-1], psi.shape[1]
    omega, psi = omega.float().contiguous(), psi.float().contiguous()
    device = left_mean.device
    sketch = torch.empty(M, d_out, width, dtype=torch.float32, device=device)
    co_sketch = torch.empty(M, co_width, d_in, dtype=torch.float32, device=device)
    per_module = 4 * (cols_t * d_out * width + rows_t * co_width * d_in)
    chunk = max(1, partial_bytes // per_module)
    for lo in range(0, M, chunk):
        hi = min(M, lo + chunk)
        y_part = torch.empty(hi - lo, cols_t, d_out, width, dtype=torch.float32, device=device)
        w_part = torch.empty(hi - lo, rows_t, co_width, d_in, dtype=torch.float32, device=device)
        _iga_sketch_kernel[(rows_t, cols_t, hi - lo)](
            left_mean[lo:hi], right_mean[lo:hi], left_dev[lo:hi], right_dev[lo:hi], coefficients[lo:hi], eps[lo:hi],
            omega[lo:hi], psi[lo:hi], y_part, w_part, parts[lo:hi], mins[lo:hi], d_out, d_in, k2, width, co_width,
            N=N, NORM=_NORM_CODE[normalize], KP=max(16, triton.next_power_of_2(k2)), BM=block_m, BN=block_n,
            WP=max(16, triton.next_power_of_2(width)), LP=max(16, triton.next_power_of_2(co_width)),
            PRECISION=precision, FAST=fast_math(), num_warps=num_warps, **LAUNCH_OPTIONS)
        torch.sum(y_part, dim=1, out=sketch[lo:hi])
        torch.sum(w_part, dim=1, out=co_sketch[lo:hi])
    return co_sketch, sketch


def factors_fit(A: torch.Tensor, B: torch.Tensor, gA: torch.Tensor, gB: torch.Tensor) -> bool:
    """Whether :func:`stack_factors_triton` takes these stacks: float32 on CUDA, each module's
    tensors contiguous (the stacks may be spaced views of one buffer)."""
    return (triton is not None and all(t.is_cuda and t.dtype == torch.float32 for t in (A, B, gA, gB))
            and all(t[0].is_contiguous() for t in (A, B, gA, gB)))


def stack_factors_triton(A, B, gA, gB, scaling, dev_dtype: torch.dtype = torch.float32, *, block: int = 64):
    """:func:`iga_ds.methods.iga.batched.stack_factors` in two kernels (the left factors, the
    right ones) that read the gradients once and write each factor once, in ``dev_dtype`` for
    the deviations: same values (the mean may differ in its last bit by summation order).
    Stacks as :class:`iga_ds.methods.iga.batched.Stack` holds them (:func:`factors_fit`)."""
    M, N, r, d_in = gA.shape
    d_out = B.shape[1]
    device = A.device
    left_mean = torch.empty(M, d_out, 2 * r, dtype=torch.float32, device=device)
    right_mean = torch.empty(M, 2 * r, d_in, dtype=torch.float32, device=device)
    left_dev = torch.empty(M, N, d_out, 2 * r, dtype=dev_dtype, device=device)
    right_dev = torch.empty(M, N, 2 * r, d_in, dtype=dev_dtype, device=device)
    if M:
        rp = triton.next_power_of_2(r)
        _left_factors_kernel[(triton.cdiv(d_out, block), M)](
            gB, B, scaling.float().contiguous(), left_mean, left_dev, d_out, r, gB.stride(0), B.stride(0),
            N=N, RP=rp, BR=block, **LAUNCH_OPTIONS)
        _right_factors_kernel[(triton.cdiv(d_in, block), M)](
            gA, A, right_mean, right_dev, d_in, r, gA.stride(0), A.stride(0), N=N, RP=rp, BC=block, **LAUNCH_OPTIONS)
    return left_mean, right_mean, left_dev, right_dev


# the masked matrices' dtypes whose products with skinny factors go through skinny_product
# rather than cuBLAS
SKINNY_DTYPES = (torch.bfloat16,)
# block sizes of the skinny product by the matrices' dtype: (rows of Y per program, contraction
# step, warps, pipeline stages). float32 is CholeskyQR's product by the inverse factor (32 or 26
# columns): a short contraction step keeps more programs resident (tools/tune_method.py's
# QR_PRODUCT_SWEEP picks the blocks)
SKINNY_BLOCKS = {torch.bfloat16: (128, 128, 8, 3), torch.float32: (128, 16, 4, 4)}


def skinny_product(matrix: torch.Tensor, factor: torch.Tensor, *, transpose: bool = False,
                   precision: str = "ieee", blocks: tuple[int, int, int, int] | None = None,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``matrix @ factor`` (``matrix^T @ factor`` with ``transpose``) for stacks of matrices
    (M x rows x cols, contiguous) and skinny factors (M x cols x k or M x rows x k, k up to a
    few dozen), summed in float32 whatever the operands' dtype.

    The products of the randomized SVD read every masked matrix once per product and do
    little arithmetic per element: memory-bound, with k far below the tiles cuBLAS picks
    for it. One program streams a block of rows (or, transposed, of columns) of one matrix
    and keeps its k-wide slab of the result in registers. bfloat16 operands multiply on bf16
    tensor cores with float32 accumulation and the result stays float32 (cuBLAS would round it
    back to bfloat16); float32 operands use ``precision`` (Triton's ``input_precision``).
    ``blocks``: (rows per program, contraction step, warps, stages), default
    :data:`SKINNY_BLOCKS` for the dtype. ``out_dtype``: the result's dtype (the float32 sums
    rounded once as they are stored)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if matrix.dtype != factor.dtype or matrix.dim() != 3 or factor.dim() != 3:
        raise ValueError(f"skinny_product needs stacks of one dtype, got {tuple(matrix.shape)} {matrix.dtype} "
                         f"and {tuple(factor.shape)} {factor.dtype}")
    M, rows, cols = matrix.shape
    inner, out_len = (rows, cols) if transpose else (cols, rows)
    if factor.shape[:2] != (M, inner):
        raise ValueError(f"factor {tuple(factor.shape)} does not fit matrix {tuple(matrix.shape)} "
                         f"(transpose={transpose})")
    k = factor.shape[-1]
    block_rows, block_inner, num_warps, num_stages = blocks or SKINNY_BLOCKS[matrix.dtype]
    matrix, factor = matrix.contiguous(), factor.contiguous()
    out = torch.empty(M, out_len, k, dtype=out_dtype, device=matrix.device)
    _skinny_kernel[(triton.cdiv(out_len, block_rows), M)](
        matrix, factor, out, rows, cols, k, TRANSPOSE=transpose, BR=block_rows, BK=block_inner,
        KP=max(16, triton.next_power_of_2(k)), PRECISION="bf16" if matrix.dtype == torch.bfloat16 else precision,
        num_warps=num_warps, num_stages=num_stages, **LAUNCH_OPTIONS)
    return out


# programs of a float64 Gram per call: the contraction is split until there are about this many
GRAM_PROGRAMS = 1024


def gram64(x: torch.Tensor, *, block: int = 32, programs: int = GRAM_PROGRAMS) -> torch.Tensor:
    """``x^T @ x`` in float64 for stacks of tall float32 matrices (M x K x a, any strides, a
    up to a few dozen), without a float64 copy of ``x``: CholeskyQR's Grams and the small
    matrices' Grams before ``eigh``.

    A float64 copy followed by a batched product moves three times the bytes, and cuBLAS walks all K rows
    with one small tile per module. Here the contraction is split into chunks of ``block``
    rows' multiples, each program sums one in float64 (the products of float32 values are
    exact there), and the chunks' sums are added in a fixed order."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if x.dim() != 3 or x.dtype != torch.float32:
        raise ValueError(f"gram64 needs a float32 stack M x K x a, got {tuple(x.shape)} {x.dtype}")
    M, K, a = x.shape
    if not (M and K and a):
        return torch.zeros(M, a, a, dtype=torch.float64, device=x.device)
    ap = max(16, triton.next_power_of_2(a))
    splits = max(1, min(triton.cdiv(K, block), triton.cdiv(programs, M)))
    chunk = triton.cdiv(triton.cdiv(K, splits), block) * block
    splits = triton.cdiv(K, chunk)
    parts = torch.empty(M, splits, ap, ap, dtype=torch.float64, device=x.device)
    _gram64_kernel[(splits, M)](x, parts, K, a, chunk, *x.stride(), BK=block, AP=ap, **LAUNCH_OPTIONS)
    return parts[:, :, :a, :a].sum(dim=1)


def gaussian_stack_triton(keys, rows: int, cols: int, *, device, offset: int = 0,
                          block: int = 1024) -> torch.Tensor:
    """:func:`iga_ds.methods.iga.sketch.gaussian_stack` in float32 on CUDA, one launch for all
    ``keys`` (a list of :class:`iga_ds.methods.iga.sketch.SketchKey`); the same numbers up to
    the rounding of the logarithm and the cosine."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    mixed = host_to_device(torch.tensor(sketch.mixed_keys(keys), dtype=torch.int64), device)
    out = torch.empty(len(keys), rows, cols, dtype=torch.float32, device=device)
    n = rows * cols
    if n and len(keys):
        _gaussian_kernel[(triton.cdiv(n, block), len(keys))](mixed, out, n, offset, BLOCK=block, **LAUNCH_OPTIONS)
    return out


def _reduce_tile_stats(parts, mins, numel: int):
    """The mask statistics and the sum of masked^2 per module from the kernels' per-tile parts,
    in float64 (a fixed order: deterministic)."""
    sums = parts.double().sum(dim=1)  # M x STAT_SLOTS
    stats = {
        "mask_mean": sums[:, 0] / numel,
        "mask_frac_below_half": sums[:, 1] / numel,
        "mask_min": mins.double().amin(dim=1),
    }
    return stats, sums[:, 2]
