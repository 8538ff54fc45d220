"""The fused method's GPU parts one at a time, against the card's measured ceilings.

    python tools/tune_method.py [--out tune_method.json]

On one stack of 16 modules of LLaMA-2-7B shape (4096 x 4096, r 16, N 4, sketch width 26):

- the ceilings: device-to-device copy bandwidth (bytes read + written) and float32 / TF32
  matrix-product rates, measured here rather than taken from a datasheet;
- the bf16 tile kernel's variants on all 128 modules (:data:`KERNEL_VARIANTS`: the left
  factors loaded once per strip or per tile, tiles per program, pipeline stages, block rows,
  warps, the mask's division exact or approximate, a cap on registers), each output checked
  against the first's;
- the tile pass for several block shapes and warp counts, for each of ``--precisions``
  (default ieee and tf32x3), each checked against the default one, and the tile kernel alone
  with and without its statistics;
- CholeskyQR's product of a basis by its inverse factor (float32, 128 modules, bfloat16
  out), by cuBLAS and by Triton's skinny product for several block shapes;
- the power iterations' products ``X @ Z`` and ``X^T @ Q``, float32 and bfloat16, by cuBLAS
  and by Triton's skinny product for several block shapes, checked against float64 on one
  module, against the bandwidth ceiling;
- the eigendecompositions of the small matrices' Grams (:data:`EIGH_SHAPES`), by the Jacobi
  kernel and by ``torch.linalg.eigh``: device time, the host's time to issue one call while
  the device is still busy (``eigh`` waits for the device, the kernel does not), error against
  float64 ``eigh`` on the CPU;
- CholeskyQR of the sketches, two passes (a final basis) and one (a basis that feeds the next
  power iteration);
- the whole ``batched_iga`` on 128 modules (the first of ``--precisions``) for several stack
  sizes (``batch_bytes``), with the
  peak memory each adds and the device's busy time (summed kernel time) against the wall time.

Variants measured once and not kept (a row-sweep tile kernel, a first Triton kernel for the
skinny products on float32 matrices, CholeskyQR2 through the inverted factor) are in the git
history, not here.

Medians of CUDA-event timings (``triton.testing.do_bench``). Needs CUDA and Triton.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/common.py: the shared shapes and timers
from common import (
    LLAMA2_7B, do_bench_ms, environment, environment_line, gpu_busy_ms, lora_shapes, make_modules, peak_extra_mib,
    tf32_matmuls,
)
from iga_ds.files import atomic_write_json
from iga_ds.methods import sketch_key
from iga_ds.methods.iga import jacobi, triton_kernels
from iga_ds.methods.iga.common import SNR_EPS
from iga_ds.methods.iga.batched import batched_iga, mask_scales, orthonormalize, stack_factors, stack_modules
from iga_ds.methods.iga.options import IGAOptions


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def ceilings() -> dict:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = do_bench_ms(lambda: dst.copy_(src))
    a, b = torch.randn(8192, 8192, device="cuda"), torch.randn(8192, 8192, device="cuda")
    flops = 2 * 8192 ** 3
    out = {"copy_GBps": 2 * src.numel() * 4 / copy_ms / 1e6}
    for name, tf32 in (("fp32_TFLOPs", False), ("tf32_TFLOPs", True)):
        with tf32_matmuls(tf32):
            out[name] = flops / do_bench_ms(lambda: a @ b) / 1e9
    a16, b16 = a.bfloat16(), b.bfloat16()
    out["bf16_TFLOPs"] = flops / do_bench_ms(lambda: a16 @ b16) / 1e9
    return out


def tile_pass(stack_args, omega, precisions) -> list[dict]:
    factors, kw = stack_args
    ref_masked, ref_sketch, *_ = triton_kernels.tile_pass_triton(*factors, omega, **kw)
    rows = []
    for precision in precisions:
        for bm, bn, warps in ((64, 64, 4), (64, 64, 8), (128, 64, 4), (128, 64, 8), (64, 128, 8), (128, 128, 8),
                              (128, 128, 16), (256, 64, 8), (32, 64, 4)):
            run = functools.partial(triton_kernels.tile_pass_triton, *factors, omega, block_m=bm, block_n=bn,
                                    num_warps=warps, precision=precision, **kw)
            try:
                masked, sketch, *_ = run()
                rows.append(dict(block_m=bm, block_n=bn, warps=warps, precision=precision, ms=do_bench_ms(run),
                                 err_masked=rel(masked, ref_masked), err_sketch=rel(sketch, ref_sketch)))
            except Exception as exc:  # a block shape may not fit the card's registers or shared memory
                rows.append(dict(block_m=bm, block_n=bn, warps=warps, precision=precision,
                                 error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            print(rows[-1], flush=True)
    for precision in precisions:
        rows += kernel_alone(factors, kw["mean_var"], precision)
    return rows


def kernel_outputs(M: int, d_out: int, d_in: int, dtype, block_m: int, cols: int):
    """What :func:`triton_kernels.launch_tile_kernel` writes into, for blocks of ``block_m`` rows
    and 64 columns, ``cols`` tiles per program: masked matrices, partial sums, minima."""
    programs = -(-d_out // block_m) * triton_kernels.strip_count(d_in, 64, cols)
    return (torch.empty(M, d_out, d_in, device="cuda", dtype=dtype),
            torch.empty(M, programs, triton_kernels.STAT_SLOTS, device="cuda"),
            torch.empty(M, programs, device="cuda"))


def kernel_alone(factors, mean_var, precision: str = "ieee") -> list[dict]:
    """The statistics' cost: the tile kernel alone (default blocks and tiles per program,
    normalize="mean"), with and without them, on buffers allocated once."""
    wanted = triton_kernels.FACTOR_DTYPES[precision]
    left_mean, right_mean, left_dev, right_dev = (t.to(wanted).contiguous() for t in factors)
    M, N, d_out, k2 = left_dev.shape
    d_in = right_mean.shape[-1]
    cols = triton_kernels.strip_tiles(precision)
    out, parts, mins = kernel_outputs(M, d_out, d_in, triton_kernels.masked_dtype(precision), 64, cols)
    coefficients = triton_kernels.mask_coefficients(mean_var, 0.5, N, "mean")
    eps = torch.ones(M, device="cuda")
    rows = []
    for stats in (True, False):
        kernel = functools.partial(triton_kernels.launch_tile_kernel, left_mean, right_mean, left_dev, right_dev,
                                   coefficients, eps, out, parts, mins, normalize="mean", block_m=64, block_n=64,
                                   precision=precision, num_warps=4, stats=stats, cols=cols)
        rows.append(dict(kernel_only=True, precision=precision, stats=stats, ms=do_bench_ms(kernel)))
        print(rows[-1], flush=True)
    return rows


# block shapes of the skinny product swept by products(): (rows per program, contraction step,
# warps, stages); the bfloat16 default (triton_kernels.SKINNY_BLOCKS) comes from this sweep
SKINNY_SWEEP = {
    torch.bfloat16: [(64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 256, 8, 3), (256, 64, 8, 3),
                     (64, 256, 4, 3), (128, 128, 4, 4), (64, 64, 4, 4)],
    torch.float32: [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (32, 128, 4, 4), (128, 32, 4, 4)],
}


def products(masked, width: int) -> list[dict]:
    """The power iterations' skinny products, float32 and with the masked matrix in bfloat16
    (the ``bf16`` precision: half the bytes), against float64 on one module: cuBLAS, then
    Triton's skinny product for each block shape of :data:`SKINNY_SWEEP`."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    M, d_out, d_in = masked.shape
    Z = torch.randn(M, d_in, width, device="cuda", generator=gen)
    Q = torch.randn(M, d_out, width, device="cuda", generator=gen)
    want = {False: (masked[0].double() @ Z[0].double()), True: (masked[0].double().mT @ Q[0].double())}
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        X = masked.to(dtype)
        for transpose in (False, True):
            w = (Q if transpose else Z).to(dtype)
            runs = {"cublas": lambda: (X.mT if transpose else X) @ w}
            for blocks in SKINNY_SWEEP[dtype]:
                runs[f"triton {blocks}"] = functools.partial(triton_kernels.skinny_product, X, w,
                                                             transpose=transpose, blocks=blocks)
            for kind, run in runs.items():
                ms = do_bench_ms(run)
                rows.append(dict(kind=kind, dtype=str(dtype).removeprefix("torch."), transpose=transpose, ms=ms,
                                 GBps=X.numel() * X.element_size() / ms / 1e6, err=rel(run()[0], want[transpose])))
                print(rows[-1], flush=True)
    return rows


# block shapes of CholeskyQR's product by the inverse factor swept by qr_products(), as
# SKINNY_SWEEP's: the float32 default of triton_kernels.SKINNY_BLOCKS (from this sweep) first
QR_PRODUCT_SWEEP = [(128, 16, 4, 4), (128, 32, 4, 4), (64, 32, 4, 3), (256, 32, 8, 3), (64, 16, 4, 3),
                    (64, 16, 4, 4), (128, 16, 4, 3), (128, 16, 8, 4), (256, 16, 8, 4), (256, 16, 4, 4)]


def qr_products(M: int = 128, rows: int = 4096, width: int = 32) -> list[dict]:
    """CholeskyQR's product of a basis by its inverse factor (float32, ``width`` columns: 32 for
    rank 16 at oversampling 16) for ``M`` modules, written in bfloat16 as the bf16 path writes
    it, for each block shape of :data:`QR_PRODUCT_SWEEP`, against cuBLAS's float32 product;
    bytes read and written over the time, error against float64 on one module."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    Q = torch.randn(M, rows, width, device="cuda", generator=gen)
    inv = torch.randn(M, width, width, device="cuda", generator=gen)
    want = Q[0].double() @ inv[0].double()
    runs = {"cublas": lambda: Q @ inv}
    for blocks in QR_PRODUCT_SWEEP:
        runs[f"triton {blocks}"] = functools.partial(triton_kernels.skinny_product, Q, inv, precision="ieee",
                                                     blocks=blocks, out_dtype=torch.bfloat16)
    rows_out = []
    with tf32_matmuls(False):
        for kind, run in runs.items():
            out = run()
            ms = do_bench_ms(run)
            moved = Q.numel() * (Q.element_size() + out.element_size())
            rows_out.append(dict(kind=kind, width=width, ms=ms, GBps=moved / ms / 1e6, err=rel(out[0], want)))
            print(rows_out[-1], flush=True)
    return rows_out


def whole(modules, precision: str = "ieee") -> list[dict]:
    def run(batch_bytes):
        gens = [sketch_key(0, 1, m.index) for m in modules]
        return batched_iga(modules, IGAOptions(normalize="mean"), generators=gens, batch_bytes=batch_bytes,
                           triton_precision=precision)

    reference = None
    rows = []
    for gib in (1, 2, 4):
        out = run(gib << 30)
        peak = peak_extra_mib(lambda: run(gib << 30), "cuda")
        ms = do_bench_ms(lambda: run(gib << 30), warmup=200, rep=2000)
        busy = gpu_busy_ms(lambda: run(gib << 30)) if gib == 1 else None
        products_out = [m.scaling * (b.double() @ a.double()) for (a, b, _), m in zip(out, modules)]
        if reference is None:
            reference = products_out
        err = max(rel(p, q) for p, q in zip(products_out, reference))
        rows.append(dict(precision=precision, batch_gib=gib, ms=ms, gpu_busy_ms=busy, peak_extra_mib=peak,
                         max_err_vs_first=err))
        print(rows[-1], flush=True)
    return rows


def cholesky_qr(sketch) -> dict:
    """CholeskyQR of the sketches: two passes (a final basis) and one (a basis that only feeds
    the next power iteration)."""
    return {"cholesky_qr2_ms": do_bench_ms(lambda: orthonormalize(sketch)),
            "cholesky_qr1_ms": do_bench_ms(lambda: orthonormalize(sketch, final=False))}


# the bf16 tile kernel's variants swept by kernel_variants(): launch_tile_kernel's settings
# that differ from the first's (the default: the strip's left factors held, the method's tiles
# per program, Triton's pipeline stages, 64 x 64 tiles, 4 warps, the approximate division, the
# compiler's register count)
KERNEL_DEFAULT = dict(hoist=True, cols=triton_kernels.strip_tiles("bf16"), num_stages=None, block_m=64, num_warps=4,
                      fast=True, max_registers=None)
KERNEL_VARIANTS = [{}, dict(fast=False), dict(hoist=False, cols=16), dict(cols=16), dict(cols=64), dict(num_stages=1),
                   dict(num_stages=2), dict(block_m=128, num_warps=8), dict(max_registers=168),
                   dict(max_registers=168, num_stages=2), dict(max_registers=168, cols=64),
                   dict(max_registers=128, num_stages=2)]


# (matrices, size) of the eigendecomposition sweep: the method's 128 Grams at oversampling 16
# and 10 (widths 32 and 26), and the kernel's largest size
EIGH_SHAPES = ((128, 32), (128, 26), (32, 64))
# warps per program swept for the Jacobi kernel (its defaults: jacobi.WARPS)
EIGH_WARPS = (8, 16, 32)


def host_issue_ms(fn, busy_ms: float = 20.0) -> float:
    """Host milliseconds to issue one call of ``fn`` while the device still runs a kernel of
    about ``busy_ms`` queued before it: a call that waits for the device takes about that long,
    one that only queues work takes its launches' cost."""
    fn()
    torch.cuda.synchronize()
    cycles = int(busy_ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    torch.cuda._sleep(cycles)
    start = time.perf_counter()
    fn()
    elapsed = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return elapsed


def eigh_solvers() -> list[dict]:
    """The Jacobi kernel (for each of :data:`EIGH_WARPS` and at its default) against
    ``torch.linalg.eigh`` on Grams of sketch-like small matrices (rows scaled from 1 down to
    1e-3)."""
    rows = []
    for M, n in EIGH_SHAPES:
        X = torch.randn(M, n, 4 * n, dtype=torch.float64) * torch.logspace(0, -3, n, dtype=torch.float64)[:, None]
        grams = X @ X.mT
        ref_values, _ = torch.linalg.eigh(grams)
        on_device = grams.cuda()
        solvers = [(f"jacobi, {warps} warps", functools.partial(jacobi.eigh_jacobi, num_warps=warps))
                   for warps in EIGH_WARPS] + [("jacobi", jacobi.eigh_jacobi), ("torch", torch.linalg.eigh)]
        for name, solve in solvers:
            values, vectors = (t.cpu() for t in solve(on_device))
            scale = ref_values.abs().amax()
            residual = (grams @ vectors - vectors * values.unsqueeze(-2)).abs().amax() / scale
            rows.append(dict(solver=name, matrices=M, size=n, ms=do_bench_ms(lambda: solve(on_device)),
                             host_ms=host_issue_ms(lambda: solve(on_device)),
                             err_values=float((values - ref_values).abs().amax() / scale),
                             residual=float(residual)))
            print(rows[-1], flush=True)
    return rows


def kernel_variants(modules, normalize: str = "snr") -> list[dict]:
    """The bf16 tile kernel alone on one stack of ``modules`` for each of :data:`KERNEL_VARIANTS`
    (:data:`KERNEL_DEFAULT` and what each changes: the strip's left factors loaded once
    (``hoist``) or per tile, tiles per program, pipeline stages, block rows, warps, the mask's
    division, a cap on registers per thread); each output against the first variant's."""
    M = len(modules)
    st = stack_modules(modules, [None] * M, 1 << 40)[0]
    left_mean, right_mean, left_dev, right_dev = stack_factors(st, torch.bfloat16)
    mean_var, mean_sq = mask_scales(left_mean, right_mean, left_dev, right_dev, 4096 * 4096, exact_var=False)
    factors = [t.to(torch.bfloat16).contiguous() for t in (left_mean, right_mean, left_dev, right_dev)]
    coefficients = triton_kernels.mask_coefficients(mean_var, 0.5, left_dev.shape[1], normalize)
    eps = (SNR_EPS * mean_sq + torch.finfo(torch.float32).tiny).float()
    rows, first = [], None
    for change in KERNEL_VARIANTS:
        settings = {**KERNEL_DEFAULT, **change}
        out, parts, mins = kernel_outputs(M, 4096, 4096, torch.bfloat16, settings["block_m"], settings["cols"])
        run = functools.partial(triton_kernels.launch_tile_kernel, *factors, coefficients, eps, out, parts, mins,
                                normalize=normalize, block_n=64, precision="bf16", **settings)
        row = dict(settings)
        try:
            run()
            row["ms"] = do_bench_ms(run)
            sums = parts.double().sum(dim=1)
            if first is None:
                first = (out.clone(), sums)
            row["err_masked"] = rel(out, first[0])
            row["err_stats"] = rel(sums, first[1])
        except Exception as exc:  # a variant may not fit the card's registers or shared memory
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        del out
        rows.append(row)
        print(row, flush=True)
    return rows


def stack_parts(modules, skip: set[str], precisions=("ieee", "tf32x3")) -> dict:
    """The tile pass, the power iterations' products and CholeskyQR on one stack of
    ``modules`` (4096 x 4096, r 16, N 4: sketch width 26), each stage of the batched path alone."""
    M, width = len(modules), 16 + 10
    st = stack_modules(modules, [None] * M, 1 << 31)[0]
    factors = stack_factors(st)
    mean_var, mean_sq = mask_scales(*factors, 4096 * 4096)
    omega = torch.randn(M, 4096, width, device="cuda")
    kw = dict(tau=0.5, normalize="mean", mean_var=mean_var, mean_sq=mean_sq)
    out = {}
    if "tile" not in skip:
        out["tile_pass"] = tile_pass((factors, kw), omega, precisions)
    masked, sketch, *_ = triton_kernels.tile_pass_triton(*factors, omega, **kw)
    if "products" not in skip:
        out["products"] = products(masked, width)
    if "qr" not in skip:
        out.update(cholesky_qr(sketch))
        print({k: out[k] for k in ("cholesky_qr2_ms", "cholesky_qr1_ms")}, flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="tune_method.json")
    p.add_argument("--skip", default="",
                   help="comma-separated parts to skip: variants,qrproducts,eigh,tile,products,qr,whole")
    p.add_argument("--precisions", default="ieee,tf32x3",
                   help=f"tile-pass precisions to sweep, from {', '.join(triton_kernels.PRECISIONS)}; the first "
                        "is also the whole method's")
    args = p.parse_args(argv)
    if not (torch.cuda.is_available() and triton_kernels.available()):
        print("tune_method.py needs CUDA and Triton", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    result = {"environment": environment(torch.device("cuda")), "ceilings": ceilings()}
    print(environment_line(result["environment"]), flush=True)
    print(result["ceilings"], flush=True)
    modules = make_modules(lora_shapes(LLAMA2_7B), rank=16, alpha=32.0, domains=4, device=torch.device("cuda"))
    precisions = [x for x in args.precisions.split(",") if x]
    unknown = [x for x in precisions if x not in triton_kernels.PRECISIONS]
    if unknown or not precisions:
        p.error(f"--precisions: expected names from {', '.join(triton_kernels.PRECISIONS)}, got {args.precisions!r}")
    if "variants" not in skip:
        result["kernel_variants"] = kernel_variants(modules)
    if "qrproducts" not in skip:
        result["qr_products"] = [row for width in (32, 26) for row in qr_products(width=width)]
    if "eigh" not in skip:
        result["eigh"] = eigh_solvers()
    result.update(stack_parts(modules[:16], skip, precisions))
    if "whole" not in skip:
        result["whole"] = whole(modules, precisions[0])
    atomic_write_json(args.out, result, indent=1)
    print(json.dumps(result["ceilings"]))
    for part in ("kernel_variants", "qr_products", "eigh", "tile_pass", "products", "whole"):
        for row in sorted(result.get(part, []), key=lambda r: r.get("ms", 1e9))[:6]:
            print(part, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
