"""One Triton kernel for the IGA tile pass on CUDA: reconstruct, mean, variance, mask, in registers.

Each program owns a BM x BN tile of one module's out x in matrix. From the rank-2r factors it
forms the tile of Gbar and, for every domain n, the tile of the deviation D[n]; it squares and
sums them into V, applies exp(-tau V'), writes only ``Gbar * mask`` and per-tile partial sums
for the mask statistics. The N full-rank gradients never exist in device memory. The PyTorch
tile pass in :mod:`iga_ds.lora.fused` is the reference this kernel is tested against.

Import-guarded: without Triton, :func:`available` is False and nothing here is compiled.
Only float32 runs here (float64 stays on the PyTorch path). ``precision`` is Triton's
``input_precision`` of ``tl.dot``: ``"ieee"`` (default, true float32) or ``"tf32x3"``
(three TF32 products, close to float32 and faster on tensor cores); plain TF32 loses about
three digits and is not offered.
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

_NORM_CODE = {"none": 0, "mean": 1, "snr": 2}
PRECISIONS = ("ieee", "tf32x3", "tf32")


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _load_factor(ptr, rows, cols, n_rows, n_cols, row_stride):
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)

    @triton.jit
    def _iga_tile_kernel(
        left_mean, right_mean, left_dev, right_dev, scale_ptr, eps_ptr, out_ptr, part_ptr, min_ptr,
        d_out, d_in, k2, tau,
        N: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        mod = tl.program_id(2).to(tl.int64)
        rows = pid_r * BM + tl.arange(0, BM)
        cols = pid_c * BN + tl.arange(0, BN)
        ks = tl.arange(0, KP)  # 2r padded to a power of two >= 16 (tl.dot's minimum); pads load as 0
        lhs = _load_factor(left_mean + mod * d_out * k2, rows, ks, d_out, k2, k2)
        rhs = _load_factor(right_mean + mod * k2 * d_in, ks, cols, k2, d_in, d_in)
        gbar = tl.dot(lhs, rhs, input_precision=PRECISION)
        var = tl.zeros((BM, BN), dtype=tl.float32)
        for n in tl.static_range(N):
            lhs = _load_factor(left_dev + (mod * N + n) * d_out * k2, rows, ks, d_out, k2, k2)
            rhs = _load_factor(right_dev + (mod * N + n) * k2 * d_in, ks, cols, k2, d_in, d_in)
            dev = tl.dot(lhs, rhs, input_precision=PRECISION)
            var += dev * dev
        var = var / N
        if NORM == 0:
            vn = var
        elif NORM == 1:
            scale = tl.load(scale_ptr + mod)
            vn = tl.where(scale > 0, var / tl.where(scale > 0, scale, 1.0), 0.0)
        else:
            vn = var / (gbar * gbar + tl.load(eps_ptr + mod))
        mask = tl.exp(-tau * vn)
        masked = gbar * mask
        valid = (rows[:, None] < d_out) & (cols[None, :] < d_in)
        tl.store(out_ptr + mod * d_out * d_in + rows[:, None] * d_in + cols[None, :], masked, mask=valid)
        # per-tile partial sums, reduced in float64 on the host side of the kernel: deterministic
        tile = pid_r * tl.num_programs(1) + pid_c
        n_tiles = tl.num_programs(0) * tl.num_programs(1)
        base = part_ptr + (mod * n_tiles + tile) * 4
        tl.store(base + 0, tl.sum(tl.sum(tl.where(valid, mask, 0.0), axis=1), axis=0))
        tl.store(base + 1, tl.sum(tl.sum(tl.where(valid & (mask < 0.5), 1.0, 0.0), axis=1), axis=0))
        tl.store(base + 2, tl.sum(tl.sum(tl.where(valid, var, 0.0), axis=1), axis=0))
        tl.store(base + 3, tl.sum(tl.sum(tl.where(valid, masked * masked, 0.0), axis=1), axis=0))
        tl.store(min_ptr + mod * n_tiles + tile, tl.min(tl.min(tl.where(valid, mask, float("inf")), axis=1), axis=0))


def tile_pass_triton(left_mean, right_mean, left_dev, right_dev, omega, *, tau, normalize, mean_var, mean_sq,
                     block_m: int = 64, block_n: int = 64, precision: str = "ieee", num_warps: int = 4):
    """Same contract as ``iga_ds.lora.fused._tile_pass_torch``: masked, first sketch, stats, sum of masked^2."""
    from iga_ds.methods.iga import SNR_EPS

    if triton is None:
        raise RuntimeError("Triton is not installed")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if left_mean.dtype != torch.float32:
        raise ValueError(f"the Triton tile pass runs in float32, got {left_mean.dtype}")
    M, N, d_out, k2 = left_dev.shape
    d_in = right_mean.shape[-1]
    kp = max(16, triton.next_power_of_2(k2))
    left_mean, right_mean = left_mean.contiguous(), right_mean.contiguous()
    left_dev, right_dev = left_dev.contiguous(), right_dev.contiguous()
    scale = mean_var.float().contiguous()
    eps = (SNR_EPS * mean_sq + torch.finfo(torch.float32).tiny).float().contiguous()
    masked = torch.empty(M, d_out, d_in, dtype=torch.float32, device=left_mean.device)
    grid = (triton.cdiv(d_out, block_m), triton.cdiv(d_in, block_n), M)
    n_tiles = grid[0] * grid[1]
    parts = torch.empty(M, n_tiles, 4, dtype=torch.float32, device=left_mean.device)
    mins = torch.empty(M, n_tiles, dtype=torch.float32, device=left_mean.device)
    _iga_tile_kernel[grid](
        left_mean, right_mean, left_dev, right_dev, scale, eps, masked, parts, mins,
        d_out, d_in, k2, float(tau),
        N=N, NORM=_NORM_CODE[normalize], KP=kp, BM=block_m, BN=block_n, PRECISION=precision,
        num_warps=num_warps,
    )
    sums = parts.double().sum(dim=1)  # M x 4
    numel = d_out * d_in
    stats = {
        "mask_mean": sums[:, 0] / numel,
        "mask_frac_below_half": sums[:, 1] / numel,
        "mask_min": mins.double().amin(dim=1),
        "gir": sums[:, 2],
    }
    sketch = torch.bmm(masked, omega)
    return masked, sketch, stats, sums[:, 3]
