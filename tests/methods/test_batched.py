"""batched_iga (the fast path) against iga_update (the per-module reference) and float64 numpy."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from iga_ds.methods.iga.batched import batched_iga
from iga_ds.methods.iga.options import IGAOptions
from iga_ds.methods import ModuleGrads, get_method
from iga_ds.methods.iga.reference import iga_update
from reference_impl import iga_reference
from triton_interpreter import run_interpreted

# float32: observed worst 7e-6 on these problems (rounding amplified by the SVD), so ~1e-5 with margin
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
FACTOR_TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
STAT_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def make_module(index, N=4, r=4, d_in=48, d_out=40, dtype=torch.float64, scaling=2.0, seed=0, shared=0.7):
    """Per-domain gradients near 1e-4 that share a common part, as real isomer gradients do."""
    g = torch.Generator().manual_seed(1000 * seed + index)
    A = torch.randn(r, d_in, generator=g, dtype=torch.float64) / d_in**0.5
    B = torch.randn(d_out, r, generator=g, dtype=torch.float64) * 0.05
    gA = shared * torch.randn(1, r, d_in, generator=g, dtype=torch.float64) + torch.randn(N, r, d_in, generator=g, dtype=torch.float64)
    gB = shared * torch.randn(1, d_out, r, generator=g, dtype=torch.float64) + torch.randn(N, d_out, r, generator=g, dtype=torch.float64)
    return ModuleGrads(f"m{index}", index, A.to(dtype), B.to(dtype), (gA * 1e-4).to(dtype), (gB * 1e-4).to(dtype), scaling)


def generators(modules, base=100):
    return [torch.Generator().manual_seed(base + m.index) for m in modules]


def svd_split(**options) -> IGAOptions:
    """The paper's truncation with its split factors, as :func:`reference` computes it."""
    return IGAOptions(projection="svd", factors="split", **options)


def reference(m, base=100, **kw):
    kw.setdefault("svd", "randomized")
    return iga_update(m.A, m.B, m.gA, m.gB, scaling=m.scaling,
                      generator=torch.Generator().manual_seed(base + m.index), **kw, projection="svd", factors="split")


def product(gA, gB, s):
    return (s * gB.double() @ gA.double())


def rel(a, b):
    return float((a - b).norm() / b.norm())


def assert_matches_reference(modules, results, dtype, loosen=1.0, **kw):
    for m, (gA, gB, stats) in zip(modules, results):
        gA_ref, gB_ref, stats_ref = reference(m, **kw)
        assert gA.shape == m.A.shape and gB.shape == m.B.shape and gA.dtype == m.A.dtype
        assert rel(product(gA, gB, m.scaling), product(gA_ref, gB_ref, m.scaling)) < loosen * TOL[dtype], m.name
        # the factors themselves (what AdamW sees), not only their product: signs must agree
        assert rel(gA.double(), gA_ref.double()) < loosen * FACTOR_TOL[dtype], m.name
        assert rel(gB.double(), gB_ref.double()) < loosen * FACTOR_TOL[dtype], m.name
        for key in ("mask_mean", "mask_min", "gir", "energy_kept"):
            assert stats[key] == pytest.approx(stats_ref[key], rel=STAT_TOL[dtype], abs=1e-300), key
        # the reference averages the indicator in float32: compare with its rounding
        assert stats["mask_frac_below_half"] == pytest.approx(stats_ref["mask_frac_below_half"], abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("normalize,tau", [("none", 1e8), ("mean", 0.5), ("snr", 0.5), ("mean", 3.0)])
@pytest.mark.parametrize("shape", [(4, 48, 40), (8, 24, 64), (2, 33, 17)])
def test_matches_iga_update(dtype, normalize, tau, shape):
    r, d_in, d_out = shape
    mods = [make_module(i, r=r, d_in=d_in, d_out=d_out, dtype=dtype) for i in range(3)]
    out = batched_iga(mods, svd_split(tau=tau, normalize=normalize), generators=generators(mods))
    assert_matches_reference(mods, out, dtype, tau=tau, normalize=normalize)
    # the mask acts in these settings, so the comparison is not of an unmasked mean
    assert all(s["mask_mean"] < 0.99 for _, _, s in out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("normalize,tau", [("mean", 0.5), ("snr", 0.5)])
@pytest.mark.parametrize("shape", [(4, 48, 40), (2, 33, 17), (8, 24, 64)])
def test_single_pass_matches_iga_update(dtype, normalize, tau, shape):
    """Both sketches taken in the tile pass, the masked matrix never stored, small row tiles:
    the reference's single_pass_svd on the whole masked matrix gives the same factors."""
    r, d_in, d_out = shape
    mods = [make_module(i, r=r, d_in=d_in, d_out=d_out, dtype=dtype) for i in range(3)]
    out = batched_iga(mods, svd_split(tau=tau, normalize=normalize, svd="single_pass"), generators=generators(mods), tile_elements=3 * 7 * d_in)
    # float32: the reference solves its least squares in float32 (the batched path in float64);
    # observed worst 2.5e-5 on the factors
    assert_matches_reference(mods, out, dtype, loosen=2.5 if dtype == torch.float32 else 1.0,
                             tau=tau, normalize=normalize, svd="single_pass")
    randomized = batched_iga(mods, svd_split(tau=tau, normalize=normalize), generators=generators(mods))
    # not the randomized path under another name: same sketch omega, a different answer
    assert any(rel(product(a[0], a[1], 1.0), product(b[0], b[1], 1.0)) > 1e-3 for a, b in zip(out, randomized))


def test_single_pass_stores_no_masked_matrix(monkeypatch):
    from iga_ds.methods.iga import batched

    mods = [make_module(i, r=4, d_in=48, d_out=40) for i in range(2)]
    allocated = []
    real_empty = torch.empty

    def spy(*shape, **kw):
        allocated.append(tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        return real_empty(*shape, **kw)

    monkeypatch.setattr(batched.torch, "empty", spy)
    batched_iga(mods, svd_split(svd="single_pass"), generators=generators(mods))
    assert (2, 40, 48) not in allocated  # M x out x in: the stored masked matrices
    allocated.clear()
    batched_iga(mods, svd_split(), generators=generators(mods))
    assert (2, 40, 48) in allocated  # the randomized path does store them (the spy sees it)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mixed_shapes_tiles_and_batches(dtype):
    # three shapes interleaved, scalings that differ, tiny tiles and batches: order must be kept
    shapes = [(4, 48, 40), (6, 30, 50), (4, 48, 40), (4, 40, 48), (6, 30, 50), (4, 48, 40)]
    mods = [make_module(i, r=r, d_in=a, d_out=b, dtype=dtype, scaling=1.0 + i / 4) for i, (r, a, b) in enumerate(shapes)]
    for tile, batch in ((300, 1), (5000, 2 * 48 * 40 * 8), (1 << 24, 1 << 30)):
        out = batched_iga(mods, svd_split(tau=0.5, normalize="mean"), generators=generators(mods), tile_elements=tile, batch_bytes=batch)
        assert_matches_reference(mods, out, dtype, tau=0.5, normalize="mean")


def test_auto_stack_size_takes_half_the_headroom_within_bounds():
    from iga_ds.methods.iga.batched import DEFAULT_BATCH_BYTES, MAX_AUTO_BATCH_BYTES, auto_batch_bytes

    GiB = 1 << 30
    assert auto_batch_bytes(0) == auto_batch_bytes(GiB) == DEFAULT_BATCH_BYTES == GiB
    assert auto_batch_bytes(5 * GiB) == 5 * GiB // 2
    assert auto_batch_bytes(64 * GiB) == MAX_AUTO_BATCH_BYTES == 4 * GiB


@pytest.mark.parametrize("bad", [0, -1, 1.5, "big", True])
def test_bad_stack_size_is_refused(bad):
    m = make_module(0)
    with pytest.raises(ValueError, match="batch_bytes must be 'auto' or a positive number of bytes"):
        batched_iga([m], svd_split(), generators=generators([m]), batch_bytes=bad)


def test_small_eigendecompositions_share_one_call_per_width(monkeypatch):
    # linalg.eigh checks its result on the host (a device stall per call): stacks of one
    # sketch width share one call, whatever the number of stacks
    calls = []
    real = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda a, *args, **kw: calls.append(tuple(a.shape)) or real(a, *args, **kw))
    shapes = [(4, 48, 40)] * 3 + [(6, 30, 50)] * 2
    mods = [make_module(i, r=r, d_in=a, d_out=b) for i, (r, a, b) in enumerate(shapes)]
    out = batched_iga(mods, svd_split(tau=0.5, normalize="mean"), generators=generators(mods), batch_bytes=1)  # one per stack
    assert sorted(calls) == [(2, 16, 16), (3, 14, 14)]
    assert_matches_reference(mods, out, torch.float64, tau=0.5, normalize="mean")


@pytest.mark.parametrize("dtype,calls", [(torch.float32, 6), (torch.float64, 10)])
def test_bases_that_feed_a_power_iteration_take_one_cholesky_pass_in_float32(monkeypatch, dtype, calls):
    # 2 power iterations orthonormalize 5 times; in float32 only the last basis needs CholeskyQR2
    count = []
    real = torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda a, *args, **kw: count.append(1) or real(a, *args, **kw))
    mods = [make_module(i, dtype=dtype) for i in range(2)]  # one stack
    out = batched_iga(mods, svd_split(tau=0.5, normalize="mean", power_iters=2), generators=generators(mods))
    assert len(count) == calls
    assert_matches_reference(mods, out, dtype, tau=0.5, normalize="mean")


def test_one_pass_bases_lose_nothing_on_an_ill_conditioned_float32_matrix():
    # 8 singular values from 1 to 0.5, 10 from 1e-3 down to 1e-6, the rest 1e-7: every sketch
    # of width 18 has a condition number far above 1e4, where one CholeskyQR pass loses
    # orthogonality (0.03 if every basis took one pass); the final two-pass basis repairs it
    from iga_ds.methods.iga.batched import project, svd_from_projection

    g = torch.Generator().manual_seed(3)
    m, n, rank, width = 300, 200, 8, 18
    U, _ = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    S = torch.cat([torch.linspace(1, 0.5, rank, dtype=torch.float64),
                   torch.logspace(-3, -6, width - rank, dtype=torch.float64),
                   torch.full((n - width,), 1e-7, dtype=torch.float64)])
    exact = (U * S) @ V.T
    best = (U[:, :rank] * S[:rank]) @ V[:, :rank].T
    omega = torch.randn(n, width, generator=g, dtype=torch.float64)
    matrix = exact.float()[None]
    Q, small = project(matrix, matrix @ omega.float()[None], power_iters=2)
    u, s, vh = svd_from_projection(Q, small, rank)
    approx = ((u * s.unsqueeze(-2)) @ vh)[0].double()
    assert float((Q[0].double().T @ Q[0].double() - torch.eye(width, dtype=torch.float64)).abs().max()) < 1e-5
    # as close to the best rank-8 approximation as float32 rounding of the matrix allows
    assert rel(approx, best) < 1e-5


def test_float32_bases_are_orthonormal_to_float32_rounding_with_float32_products(monkeypatch):
    # float32 data are multiplied by the inverse factor in float32 (no float64 copy of the
    # m x k basis, no float64 product): the two-pass basis of a sketch with condition number
    # 1e5 is still orthonormal and spans the sketch to float32 rounding
    from iga_ds.methods.iga.batched import orthonormalize

    Y = _conditioned_sketch(torch.Generator().manual_seed(4), 500, 20, 1e-5)
    products = []  # (rows of the left operand, its dtype) of each matrix product
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__",
                        lambda a, b: products.append((a.shape[-2], a.dtype)) or real(a, b))
    Q = orthonormalize(Y)
    assert (500, torch.float64) not in products and products.count((500, torch.float32)) == 2
    assert Q.dtype == torch.float32
    _assert_orthonormal_basis_of(Q, Y, 1e-5)


def _conditioned_sketch(g: torch.Generator, m: int, k: int, smallest: float) -> torch.Tensor:
    """A float32 1 x m x k matrix with singular values from 1 down to ``smallest``."""
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(k, k, generator=g, dtype=torch.float64))
    return ((U * torch.logspace(0, math.log10(smallest), k, dtype=torch.float64)) @ V.T).float()[None]


def _assert_orthonormal_basis_of(Q: torch.Tensor, Y: torch.Tensor, tol: float) -> None:
    Q64, Y64 = Q[0].double().cpu(), Y[0].double().cpu()
    assert float((Q64.T @ Q64 - torch.eye(Q64.shape[1], dtype=torch.float64)).abs().max()) < tol
    assert rel(Q64 @ (Q64.T @ Y64), Y64) < tol


def test_cholesky_qr_solves_only_against_its_small_factor(monkeypatch):
    # a triangular solve against the tall m x k basis was a slow GPU kernel: the k x k factor is
    # inverted on its own and applied by one product; the bases stay orthonormal and the
    # method equal to the reference (float64, two passes each)
    from iga_ds.methods.iga.batched import orthonormalize

    shapes = []
    real = torch.linalg.solve_triangular
    monkeypatch.setattr(torch.linalg, "solve_triangular",
                        lambda A, B, *args, **kw: shapes.append(tuple(B.shape[-2:])) or real(A, B, *args, **kw))
    Y = torch.randn(3, 200, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    Q = orthonormalize(Y)
    assert shapes and set(shapes) == {(12, 12)}
    # 1e-13: the shift CholeskyQR adds for rank-deficient sketches (the triangular solve gave the same)
    assert float((Q.mT @ Q - torch.eye(12, dtype=torch.float64)).abs().max()) < 1e-12
    assert float((Q @ (Q.mT @ Y) - Y).abs().max()) < 1e-12  # the same span
    assert orthonormalize(Y.float(), final=False, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    mods = [make_module(i) for i in range(2)]
    out = batched_iga(mods, svd_split(tau=0.5, normalize="snr"), generators=generators(mods))
    assert_matches_reference(mods, out, torch.float64, tau=0.5, normalize="snr")


@pytest.mark.parametrize("rank,power_iters,oversample", [(2, 2, 10), (4, 0, 10), (4, 1, 3), (3, 2, 100)])
def test_rank_power_iterations_and_sketch_width(rank, power_iters, oversample):
    # oversample 100 makes the sketch as wide as the matrix: width = min(rank + p, out, in)
    mods = [make_module(i, r=4, d_in=36, d_out=30) for i in range(2)]
    kw = dict(tau=0.5, normalize="snr", rank=rank, power_iters=power_iters, oversample=oversample)
    out = batched_iga(mods, svd_split(**kw), generators=generators(mods))
    assert_matches_reference(mods, out, torch.float64, **kw)
    for gA, gB, _ in out:
        assert torch.linalg.matrix_rank(gB @ gA).item() == rank


def test_independent_float64_reference_when_sketch_is_exact():
    # tau = 0: the matrix is the mean reconstruction, rank <= 2r = 8 < sketch width 14, so the
    # randomized SVD is exact and the result is numpy's truncated SVD of the mean
    mods = [make_module(i, r=4, d_in=30, d_out=26) for i in range(2)]
    out = batched_iga(mods, svd_split(tau=0.0, normalize="mean"), generators=generators(mods))
    for m, (gA, gB, stats) in zip(mods, out):
        ref, g, mask, var = iga_reference(m.A, m.B, m.gA, m.gB, m.scaling, 0.0, 4, "mean")
        np.testing.assert_allclose(product(gA, gB, m.scaling).numpy(), ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
        assert stats["gir"] == pytest.approx(var.sum(), rel=1e-10)
        assert stats["mask_mean"] == 1.0


@pytest.mark.parametrize("normalize", ["none", "mean", "snr"])
def test_masked_matrix_and_stats_against_numpy(normalize):
    # the mask statistics against the independent numpy reference (not against iga_update)
    tau = 1e8 if normalize == "none" else 0.7
    m = make_module(0, r=3, d_in=20, d_out=22)
    (_, _, stats), = batched_iga([m], svd_split(tau=tau, normalize=normalize, oversample=30), generators=generators([m]))
    _, g, mask, var = iga_reference(m.A, m.B, m.gA, m.gB, m.scaling, tau, 3, normalize)
    assert stats["mask_mean"] == pytest.approx(mask.mean(), rel=1e-12)
    assert stats["mask_min"] == pytest.approx(mask.min(), rel=1e-12)
    assert stats["mask_frac_below_half"] == pytest.approx((mask < 0.5).mean(), abs=1e-15)
    assert stats["gir"] == pytest.approx(var.sum(), rel=1e-12)
    # oversample 30 makes the sketch span the whole 20-column matrix: energy is exact
    S = np.linalg.svd(g, compute_uv=False)
    assert stats["energy_kept"] == pytest.approx((S[:3] ** 2).sum() / (S**2).sum(), rel=1e-10)


def test_identical_domains_and_zero_gradients():
    m = make_module(0)
    same = ModuleGrads("same", 1, m.A, m.B, m.gA[:1].expand(4, -1, -1).clone(), m.gB[:1].expand(4, -1, -1).clone(), 2.0)
    zero = ModuleGrads("zero", 2, m.A, m.B, torch.zeros_like(m.gA), torch.zeros_like(m.gB), 2.0)
    out = batched_iga([same, zero], svd_split(tau=5.0, normalize="mean"), generators=generators([same, zero]))
    (gA, gB, s1), (zA, zB, s2) = out
    assert s1["mask_mean"] == 1.0 and s1["gir"] == 0.0
    assert torch.isfinite(gA).all() and torch.isfinite(gB).all()
    assert zA.abs().max() == 0 and zB.abs().max() == 0 and s2["energy_kept"] == 1.0


def test_low_precision_inputs_come_back_in_their_dtype():
    m64 = make_module(0)
    m16 = ModuleGrads("bf", 0, *(t.to(torch.bfloat16) for t in (m64.A, m64.B, m64.gA, m64.gB)), 2.0)
    (gA, gB, _), = batched_iga([m16], svd_split(), generators=generators([m16]))
    assert gA.dtype == gB.dtype == torch.bfloat16 and gA.shape == m16.A.shape
    (gA32, gB32, _), = batched_iga([m16], svd_split(tau=0.5), generators=generators([m16]))
    assert torch.isfinite(gA32.float()).all()


@pytest.mark.parametrize("factors,svd", [("chain_rule", "randomized"), ("split", "randomized"),
                                         ("chain_rule", "single_pass")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_method_equals_registered_iga(factors, svd, dtype):
    # the batched path maps factors on the whole stack; the reference maps module by module
    mods = [make_module(i, dtype=dtype, scaling=1.0 + 0.5 * i) for i in range(4)]
    params = dict(tau=0.5, normalize="snr", seed=3, factors=factors, svd=svd)
    ref = get_method("iga_svd", implementation="reference", **params).combine(mods, step=5)
    got = get_method("iga_svd", implementation="batched", **params).combine(mods, step=5)
    for a, b, m in zip(got, ref, mods):
        assert a.gA.shape == m.A.shape and a.gB.shape == m.B.shape
        assert rel(a.gA.double(), b.gA.double()) < FACTOR_TOL[dtype], m.name
        assert rel(a.gB.double(), b.gB.double()) < FACTOR_TOL[dtype], m.name
        assert a.stats["mask_mean"] == pytest.approx(b.stats["mask_mean"], rel=STAT_TOL[dtype])


def test_bad_input_is_refused():
    m = make_module(0)
    with pytest.raises(ValueError, match="one generator per module"):
        batched_iga([m], svd_split(), generators=[])
    with pytest.raises(ValueError, match="normalize"):
        batched_iga([m], svd_split(normalize="max"), generators=generators([m]))
    with pytest.raises(ValueError, match="rank"):
        batched_iga([m], svd_split(rank=9), generators=generators([m]))
    with pytest.raises(ValueError, match="factors"):
        batched_iga([m], IGAOptions(factors="transpose", projection="svd"), generators=generators([m]))
    with pytest.raises(ValueError, match="batched form"):
        batched_iga([m], svd_split(svd="exact"), generators=generators([m]))
    bad = ModuleGrads("bad", 0, m.A, m.B, m.gA[:, :, :-1], m.gB, 2.0)
    with pytest.raises(ValueError, match="bad: shapes disagree"):
        batched_iga([bad], svd_split(), generators=generators([bad]))
    with pytest.raises(ValueError, match="CUDA"):
        batched_iga([m], svd_split(), generators=generators([m]), use_triton=True)


def _cuda_modules(dtype=torch.float32, count=3, r=16, d_in=512, d_out=384):
    return [ModuleGrads(m.name, m.index, *(t.cuda() for t in (m.A, m.B, m.gA, m.gB)), m.scaling)
            for m in (make_module(i, r=r, d_in=d_in, d_out=d_out, dtype=dtype) for i in range(count))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("normalize", ["none", "mean", "snr"])
def test_cuda_paths_match_reference(use_triton, normalize):
    from iga_ds.methods.iga import triton_kernels

    if use_triton and not triton_kernels.available():
        pytest.skip("Triton is not installed")
    tau = 1e8 if normalize == "none" else 0.5
    mods = _cuda_modules()
    gens = [torch.Generator(device="cuda").manual_seed(100 + m.index) for m in mods]
    out = batched_iga(mods, svd_split(tau=tau, normalize=normalize), generators=gens, use_triton=use_triton)
    for m, (gA, gB, stats) in zip(mods, out):
        ref = iga_update(m.A, m.B, m.gA, m.gB, scaling=m.scaling, tau=tau, normalize=normalize,
                         generator=torch.Generator(device="cuda").manual_seed(100 + m.index), projection="svd", factors="split")
        assert rel(product(gA, gB, m.scaling), product(ref[0], ref[1], m.scaling)) < 1e-4
        assert stats["mask_mean"] == pytest.approx(ref[2]["mask_mean"], rel=1e-5)
        assert stats["gir"] == pytest.approx(ref[2]["gir"], rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_memory_is_one_matrix_per_module_not_n():
    mods = _cuda_modules(count=1, d_in=2048, d_out=2048)
    gens = [torch.Generator(device="cuda").manual_seed(1)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    batched_iga(mods, svd_split(tau=0.5, normalize="mean"), generators=gens, tile_elements=1 << 20)
    extra = torch.cuda.max_memory_allocated() - base
    one_matrix = 2048 * 2048 * 4
    assert extra < 2.5 * one_matrix, f"peak {extra / one_matrix:.2f} out x in matrices (N = 4 would be >= 4)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_stacks_grow_into_the_room_below_the_peak(monkeypatch):
    from iga_ds.methods.iga import batched

    mods = _cuda_modules(count=48, d_in=2048, d_out=2048)  # 16 MiB of masked matrix each

    def gens():
        return [torch.Generator(device="cuda").manual_seed(100 + m.index) for m in mods]

    fixed = batched_iga(mods, svd_split(tau=0.5, normalize="mean"), generators=gens(), batch_bytes=64 << 20)  # 4 per stack
    sizes = []
    real = batched.stack_modules
    monkeypatch.setattr(batched, "stack_modules", lambda m, g, b, e=None: sizes.append(b) or real(m, g, b, e))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    activations = torch.empty(6 << 30, dtype=torch.uint8, device="cuda")  # forward and backward's peak
    del activations
    peak = torch.cuda.max_memory_allocated()
    auto = batched_iga(mods, svd_split(tau=0.5, normalize="mean"), generators=gens())
    torch.cuda.synchronize()
    assert sizes == [3 << 30]  # half the 6 GiB below the peak: all 48 modules in one stack
    assert torch.cuda.max_memory_allocated() == peak, "the method raised the peak"
    for (gA, gB, stats), (gA_f, gB_f, stats_f), m in zip(auto, fixed, mods):
        assert rel(product(gA, gB, m.scaling), product(gA_f, gB_f, m.scaling)) < 1e-6
        assert stats["mask_mean"] == pytest.approx(stats_f["mask_mean"], rel=1e-6)


def _triton_tile_pass_matches_torch() -> None:
    """Run under TRITON_INTERPRET=1 (CPU): the kernels' tile passes against the PyTorch one."""
    # (4, 64, 96): tiles of 32 cover it exactly, the kernel's path without per-element masks
    cases = [("none", 1e8, "ieee", (4, 48, 40)), ("mean", 0.5, "ieee", (2, 33, 17)),
             ("snr", 0.5, "ieee", (4, 48, 40)), ("mean", 0.5, "tf32x3", (4, 48, 40)),
             ("snr", 0.5, "ieee", (4, 64, 96))]
    # "bf16" is checked on a GPU only (test_bf16_kernel_matches_torch_bf16_tile_pass): the
    # interpreter computes bfloat16 products wrongly (numpy has no bfloat16)
    _tile_passes_agree(cases, close=1e-6, close_stored=1e-6, block=32)
    # programs that walk a strip of tiles along a row (the bf16 default), also past the last
    # column: 40 columns are two tiles of 32, in strips of two and of three
    # programs that walk a strip also take the first sketch (one slot per strip); 64 columns
    # are one exact strip of two tiles (no per-element masks) and a partial strip of three
    strips = [("snr", 0.5, "ieee", (4, 48, 40)), ("mean", 0.5, "tf32x3", (2, 33, 17)),
              ("snr", 0.5, "ieee", (4, 64, 64))]
    for cols in (2, 3):
        _tile_passes_agree(strips, close=1e-6, close_stored=1e-6, block=32, cols=cols)
    # strips whose left factors are loaded once (the default up to 5 domains) against loading
    # them per tile, with 2 and 5 domains, and 6, past what the kernel holds (loaded per tile)
    _tile_passes_agree(strips[:1], close=1e-6, close_stored=1e-6, block=32, cols=2, hoist=False)
    for domains in (2, 5, 6):
        _tile_passes_agree(strips[::2], close=1e-6, close_stored=1e-6, block=32, cols=3, domains=domains)
    _skinny_products_agree("cpu", torch.float32, blocks=(16, 32, 4, 2))
    _gram64_agrees("cpu", block=16)
    _gaussian_draws_agree("cpu")
    _factor_kernels_agree("cpu", torch.float32)


def _factor_kernels_agree(device: str, dev_dtype) -> None:
    """The factor kernels against :func:`stack_factors` (the obvious form, itself held to the
    concatenated definition): modules laid out one after another in one buffer as the hook
    lays them (stacks with a module stride larger than a module), ranks that are not powers of
    two, rows and columns that leave part of a block over, 2 to 5 domains. The deviations
    exactly as stack_factors rounds them, up to the last bit of the mean (summation order)."""
    from iga_ds.methods.iga import batched, triton_kernels

    for N, r, d_in, d_out in ((4, 4, 70, 90), (2, 3, 64, 64), (5, 16, 130, 33)):
        mods = [make_module(i, N=N, r=r, d_in=d_in, d_out=d_out, dtype=torch.float32, scaling=0.5 + i)
                for i in range(3)]
        parts = [t for m in mods for t in (m.A, m.B, m.gA, m.gB)]
        flat = torch.cat([t.flatten() for t in parts]).to(device)
        views = [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in parts]), parts)]
        laid = [ModuleGrads(m.name, m.index, *views[4 * i: 4 * i + 4], m.scaling) for i, m in enumerate(mods)]
        st = batched.stack_modules(laid, generators(laid), 1 << 30)[0]
        assert st.gA.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # views, not copies
        want = batched.stack_factors(st, dev_dtype)
        got = triton_kernels.stack_factors_triton(st.A, st.B, st.gA, st.gB, st.scaling, dev_dtype, block=32)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            # a last-bit difference of the mean is relative to the gradients, not to their
            # deviation (which cancels); bf16 may then round the other way
            tol = 2 ** -7 if w.dtype == torch.bfloat16 else 1e-6
            torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol * float(w.abs().max()))


def _gaussian_draws_agree(device: str) -> None:
    """The Triton draw of keyed test matrices against the PyTorch one: the same integers, so
    the same numbers up to the rounding of log and cos; a block that leaves part over, an
    offset into the stream."""
    from iga_ds.methods.iga import sketch, triton_kernels

    keys = [sketch.sketch_key(1, 2, i) for i in range(3)] + [sketch.SketchKey(2**64 - 1)]
    for rows, cols, offset in ((33, 26, 0), (7, 53, 33 * 26)):
        got = triton_kernels.gaussian_stack_triton(keys, rows, cols, device=device, offset=offset, block=256)
        want = sketch.gaussian_stack(keys, rows, cols, device=device, offset=offset)
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def _skinny_products_agree(device: str, dtype, blocks=None) -> None:
    """The skinny product against the float64 product of the same operands, both orientations,
    shapes that leave part of a block over (and, with small ``blocks``, loop over the
    contraction): float32 results whatever the operands' dtype, float32 summation error only."""
    from iga_ds.methods.iga import triton_kernels

    g = torch.Generator().manual_seed(3)
    # the last loops over the contraction with the GPU's blocks too; the interpreter (the CPU,
    # small blocks) loops on a smaller one
    last = (2, 300, 520, 26) if device == "cuda" else (2, 100, 140, 26)
    for M, rows, cols, k in ((2, 40, 33, 10), (3, 70, 130, 26), last):
        matrix = torch.randn(M, rows, cols, generator=g).to(device, dtype)
        for transpose in (False, True):
            factor = torch.randn(M, rows if transpose else cols, k, generator=g).to(device, dtype)
            got = triton_kernels.skinny_product(matrix, factor, transpose=transpose, blocks=blocks)
            want = (matrix.double().mT if transpose else matrix.double()) @ factor.double()
            assert got.dtype == torch.float32 and got.shape == want.shape, (transpose, got.shape)
            assert rel(got.double(), want) < 1e-5, (M, rows, cols, k, transpose)


def _gram64_agrees(device: str, block: int = 32) -> None:
    """The float64 Gram of float32 stacks against the product of their float64 copies:
    contiguous and transposed (strided) stacks, contractions that leave part of a chunk over,
    widths that are not powers of two, one chunk per module and several; float64 summation
    error only, and the same bits on every call (the chunks are added in a fixed order)."""
    from iga_ds.methods.iga import triton_kernels

    g = torch.Generator().manual_seed(5)
    for M, K, a in ((3, 300, 20), (2, 600, 32), (1, 33, 5), (4, 129, 33)):
        for x in (torch.randn(M, K, a, generator=g), torch.randn(M, a, K, generator=g).mT):
            x = x.to(device)
            want = x.double().mT @ x.double()
            for programs in (1, 64):
                got = triton_kernels.gram64(x, block=block, programs=programs)
                assert got.dtype == torch.float64 and got.shape == (M, a, a)
                assert float((got - want).abs().max() / want.abs().max()) < 1e-14, (M, K, a, programs)
                assert torch.equal(got, triton_kernels.gram64(x, block=block, programs=programs))
    with pytest.raises(ValueError, match="gram64"):
        triton_kernels.gram64(x.double())
    assert triton_kernels.gram64(x[:, :0]).abs().max() == 0


def _tile_passes_agree(cases, close: float, close_stored: float, block: int, device: str = "cpu",
                       stats_rtol: float = 1e-5, cols: int | None = None, domains: int = 4, **variant) -> None:
    """The Triton tile passes (masked matrices and first sketch; the sketching kernel's two
    sketches) against the PyTorch tile pass of the same precision: ``close`` for the first
    sketch, ``close_stored`` for the masked matrices and the co-range sketch, ``stats_rtol``
    for the mask statistics and the masked matrices' squared norms; ``cols``, the tile kernel's
    tiles per program (None: its default for the precision); ``domains``: N; ``variant``: the
    tile kernel's ``hoist``."""
    from iga_ds.methods.iga import batched, triton_kernels

    for normalize, tau, precision, (r, d_in, d_out) in cases:
        mods = [make_module(i, N=domains, r=r, d_in=d_in, d_out=d_out, dtype=torch.float32) for i in range(2)]
        mods = [ModuleGrads(m.name, m.index, *(t.to(device) for t in (m.A, m.B, m.gA, m.gB)), m.scaling)
                for m in mods]
        st = batched.stack_modules(mods, generators(mods), 1 << 30)[0]
        factors = batched.stack_factors(st)
        mean_var, mean_sq = batched.mask_scales(*factors, d_in * d_out)
        omega = torch.randn(2, d_in, 10, generator=torch.Generator().manual_seed(0)).to(device)
        kw = dict(tau=tau, normalize=normalize, mean_var=mean_var, mean_sq=mean_sq)
        ref = batched.tile_pass_torch(*factors, omega, tile_elements=1 << 20, precision=precision, **kw)
        got = triton_kernels.tile_pass_triton(*factors, omega, block_m=block, block_n=block, precision=precision,
                                              cols=cols, **variant, **kw)
        assert got[0].dtype == ref[0].dtype == triton_kernels.masked_dtype(precision)
        assert rel(got[0].double(), ref[0].double()) < close_stored and rel(got[1], ref[1]) < close, (normalize, r)
        for key in ref[2]:
            torch.testing.assert_close(got[2][key], ref[2][key], rtol=stats_rtol, atol=1e-7)
        torch.testing.assert_close(got[3], ref[3], rtol=stats_rtol, atol=0)
        # the sketching kernel (single pass): both sketches, summed over per-tile slots; a tiny
        # partial_bytes sends the modules through one at a time
        psi = torch.randn(2, 21, d_out, generator=torch.Generator().manual_seed(1)).to(device)
        ref = batched.tile_pass_torch(*factors, omega, tile_elements=1 << 20, psi=psi, precision=precision, **kw)
        for partial_bytes in (1 << 30, 1):
            got = triton_kernels.tile_pass_triton(*factors, omega, psi=psi, block_m=block, block_n=block,
                                                  precision=precision, partial_bytes=partial_bytes, **kw)
            assert rel(got[0], ref[0]) < close_stored and rel(got[1], ref[1]) < close, (normalize, r, "sketch")
            for key in ref[2]:
                torch.testing.assert_close(got[2][key], ref[2][key], rtol=stats_rtol, atol=1e-7)
            torch.testing.assert_close(got[3], ref[3], rtol=stats_rtol, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_kernel_matches_torch_bf16_tile_pass():
    # both round the factors to bfloat16, but the rounded deviations no longer sum to zero:
    # the kernel's last deviation (minus the sum of the others) and PyTorch's own product
    # differ by bf16 rounding, so V and the mask do (1.1e-3 measured on an H100); the
    # sketches add their last rounding (cuBLAS returns bfloat16, the sketching kernel keeps
    # float32); the share of the mask below 1/2 counts elements at the threshold, which
    # those differences move across it (5.6e-3 relative seen on an H200). A wrong tile or
    # index is off by order one.
    # 1100 columns: 18 tiles, a full strip of 16 and a partial one; 1024 x 128: strips that
    # cover the matrix exactly (the kernel's path without per-element masks)
    cases = [("snr", 0.5, "bf16", (16, 300, 200)), ("mean", 0.5, "bf16", (4, 48, 40)),
             ("none", 1e8, "bf16", (16, 256, 256)), ("mean", 0.5, "bf16", (8, 1100, 72)),
             ("snr", 0.5, "bf16", (16, 1024, 128))]
    _tile_passes_agree(cases, close=1e-2, close_stored=5e-3, block=64, device="cuda", stats_rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float32_kernels_with_the_approximate_division_match_the_torch_tile_pass():
    # on a GPU the kernels divide by the approximate reciprocal (the interpreter test above
    # runs the exact division); in float32 the stored matrices show its few ulp, which must stay
    # at float32 rounding: "snr" divides per element, exact and partial strips
    from iga_ds.methods.iga import triton_kernels

    assert triton_kernels.fast_math()
    cases = [("snr", 0.5, "ieee", (16, 300, 200)), ("snr", 0.5, "ieee", (16, 256, 256))]
    _tile_passes_agree(cases, close=1e-5, close_stored=1e-5, block=64, device="cuda")
    _tile_passes_agree(cases, close=1e-5, close_stored=1e-5, block=64, device="cuda", cols=3)


def test_the_approximate_division_is_left_to_gpus(monkeypatch):
    # Triton's interpreter has no device library: the kernels must not ask for it there
    from iga_ds.methods.iga import triton_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_kernels.fast_math()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_kernels.fast_math()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_kernels.fast_math()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dev_dtype", [torch.float32, torch.bfloat16])
def test_factor_kernels_match_stack_factors(dev_dtype):
    _factor_kernels_agree("cuda", dev_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_batch_bytes_reads_the_room_below_the_peak():
    from iga_ds.methods.iga.batched import auto_batch_bytes, resolve_batch_bytes

    spare = torch.empty(3 << 28, dtype=torch.uint8, device="cuda")  # 768 MiB, freed below
    del spare
    room = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    assert room >= 3 << 28
    assert resolve_batch_bytes("auto", torch.device("cuda")) == auto_batch_bytes(room)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_keyed_sketches_are_drawn_as_the_reference_draws_them():
    from iga_ds.methods import sketch_key

    _gaussian_draws_agree("cuda")
    mods = _cuda_modules()
    keys = [sketch_key(3, 4, m.index) for m in mods]
    out = batched_iga(mods, svd_split(tau=0.5, normalize="snr", rank=12), generators=keys)
    for m, key, (gA, gB, _) in zip(mods, keys, out):
        ref = iga_update(m.A, m.B, m.gA, m.gB, scaling=m.scaling, tau=0.5, normalize="snr", rank=12, generator=key, projection="svd", factors="split")
        assert rel(product(gA, gB, m.scaling), product(ref[0], ref[1], m.scaling)) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_product_is_the_float64_product_of_its_operands(dtype):
    _skinny_products_agree("cuda", dtype)
    _skinny_products_agree("cuda", dtype, blocks=(32, 32, 4, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float64_grams_of_float32_stacks_are_their_float64_products():
    from iga_ds.methods.iga import triton_kernels

    if not triton_kernels.available():
        pytest.skip("Triton is not installed")
    _gram64_agrees("cuda")
    _gram64_agrees("cuda", block=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bases_by_the_skinny_product_match_the_float32_product():
    # on the Triton path the product by CholeskyQR's inverse factor is Triton's skinny product,
    # written in the basis's dtype: the same basis as cuBLAS's true float32 product, to float32
    # rounding (bfloat16 rounding for a bfloat16 basis), and as orthonormal
    from iga_ds.methods.iga import triton_kernels
    from iga_ds.methods.iga.batched import orthonormalize

    if not triton_kernels.available():
        pytest.skip("Triton is not installed")
    # condition number 100: two float32 products of the same operands differ by up to ~1e-5
    Y = _conditioned_sketch(torch.Generator().manual_seed(6), 3000, 40, 1e-2).cuda()
    for final, out_dtype, tol in ((True, torch.float32, 1e-4), (False, torch.float32, 1e-4),
                                  (False, torch.bfloat16, 1e-2)):
        got = orthonormalize(Y, final=final, out_dtype=out_dtype, use_triton=True)
        want = orthonormalize(Y, final=final, out_dtype=torch.float32)
        assert got.dtype == out_dtype
        assert rel(got.double(), want.double()) < tol, (final, out_dtype)
        if final:
            _assert_orthonormal_basis_of(got, Y, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_method_is_float32_up_to_bfloat16_rounding():
    # the bf16 path on CUDA (the tile kernel with its in-strip first sketch, the skinny products
    # of the power iterations) against the float32 one, which test_cuda_paths_match_reference
    # holds to the reference; float32 draws the same sketches (float64 would draw others)
    mods = _cuda_modules(count=3, r=8, d_in=1100, d_out=384)

    def gens():
        return [torch.Generator(device="cuda").manual_seed(100 + m.index) for m in mods]

    ref = batched_iga(mods, svd_split(normalize="snr"), generators=gens())
    got = batched_iga(mods, svd_split(normalize="snr"), generators=gens(), triton_precision="bf16")
    torch_path = batched_iga(mods, svd_split(normalize="snr"), generators=gens(), triton_precision="bf16", use_triton=False)
    for (gA, gB, stats), (rA, rB, rstats), (tA, tB, _), m in zip(got, ref, torch_path, mods):
        want = product(rA, rB, m.scaling)
        err_kernel = rel(product(gA.double(), gB.double(), m.scaling), want)
        err_torch = rel(product(tA.double(), tB.double(), m.scaling), want)
        assert err_kernel < 1e-2 and err_kernel < 2 * err_torch, (m.name, err_kernel, err_torch)
        assert stats["mask_mean"] == pytest.approx(rstats["mask_mean"], rel=2e-3)
        # the kernel's path takes V's sum from the Grams of the bf16-rounded deviation factors
        assert stats["gir"] == pytest.approx(rstats["gir"], rel=1e-3)


@pytest.mark.slow
def test_triton_kernel_in_interpreter_matches_torch_tile_pass():
    run_interpreted("test_batched", "_triton_tile_pass_matches_torch")


BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


def test_bench_method_gives_each_variant_its_pass_mark():
    import bench_method  # bench/ is on the path: pytest's pythonpath option (pyproject.toml)

    args = bench_method.parse_args(["--tol", "1e-4", "--tol-tf32", "1e-3", "--tol-tf32-single-pass", "5e-3"])
    names = ["batched_triton", "batched_triton_tf32x3", "batched_triton_tf32", "single_pass_triton",
             "single_pass_triton_tf32x3", "single_pass_triton_tf32"]
    assert bench_method.tolerances(names, args) == {
        "batched_triton": 1e-4, "batched_triton_tf32x3": 1e-4, "batched_triton_tf32": 1e-3,
        "single_pass_triton": 1e-4, "single_pass_triton_tf32x3": 1e-4, "single_pass_triton_tf32": 5e-3}


def test_bench_method_runs_each_bf16_variant_with_its_settings():
    import bench_method

    args = bench_method.parse_args(["--power-iters", "2", "--oversample", "10"])
    variants = bench_method.low_precision_variants(triton_ok=False)
    assert variants == {"batched_torch_bf16": ("bf16", None, None), "batched_torch_bf16_q1": ("bf16", 1, None),
                        "batched_torch_bf16_q1p16": ("bf16", 1, 16)}
    assert [bench_method.variant_settings(name, args) for name in variants] == [(2, 10), (1, 10), (1, 16)]
    assert bench_method.variant_settings("batched_triton_tf32", args) == (2, 10)


@pytest.mark.slow
def test_bench_method_small_runs_on_cpu(tmp_path):
    out = tmp_path / "method.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_method.py"), "--small", "--reps", "2",
                           "--warmup", "0", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["variants"]) >= {"naive", "per_module", "batched_torch", "single_pass_torch"}
    assert report["within_tolerance"] and report["max_rel_err"] < 1e-4
    # each algorithm's rank-r error over the optimal one: never below 1 (that would be a bug)
    quality = report["approximation_quality"]
    assert quality["modules"] == 4 and all(len(quality[k]) == 4 for k in ("randomized", "single_pass"))
    assert all(x >= 1 - 1e-9 for k in ("randomized", "single_pass") for x in quality[k])
    assert "batched_torch" in proc.stdout and "tolerance" in proc.stdout


@pytest.mark.slow
def test_bench_method_precision_rule_on_a_saved_model(tmp_path):
    """--model with two seeds: one rule per batch, each batch its own noise, float32 far inside it."""
    import precision_rule
    from transformers import LlamaConfig, LlamaForCausalLM

    from iga_ds.train.model import build_vocab, build_word_tokenizer

    texts = [t for seed in (0, 1) for domain in precision_rule.domain_texts(precision_rule.DEFAULT_DOMAINS, 2, seed)
             for t in domain]
    tokenizer = build_word_tokenizer(build_vocab(texts))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                                 )).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "method.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_method.py"), "--small", "--reps", "1",
                           "--warmup", "0", "--skip-naive", "--f64-modules", "0", "--rank", "4",
                           "--model", str(tmp_path / "model"), "--rule-groups", "2", "--rule-max-len", "64",
                           "--rule-seeds", "0,1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    rule = json.loads(out.read_text())["precision_rule"]
    first, second = rule["batches"]
    assert (first["seed"], second["seed"]) == (0, 1) and first["modules"] == second["modules"] == 8
    assert first["noise_reconstruction"] != second["noise_reconstruction"]
    assert rule["broken"] == sorted(set(first["broken"]) | set(second["broken"]))
    # only the variants the method offers fail the run (bf16_q1 is shown, not offered)
    assert rule["failed"] == [name for name in rule["broken"] if name != "bf16_q1"]
    assert (proc.returncode == 1) == bool(rule["failed"])
    assert {(row["power_iters"], row["oversample"]) for row in first["variants"].values()} == {(2, 10), (1, 10), (1, 16)}
    for batch in rule["batches"]:
        assert batch["limit"] == batch["noise_reconstruction"]["median"] > 1e-3  # bfloat16 keeps 8 bits
        float32, bf16 = batch["variants"]["float32"], batch["variants"]["bf16"]
        assert float32["error_vs_f64"]["max"] < 1e-4 and float32["within_noise"]
        assert float32["error_over_carried_noise"]["max"] < 1e-2  # float32 rounding far under bf16 training's
        assert float32["undetermined_modules"] == 0 and float32["error_over_float32_error"]["max"] == 1.0
        # the same float64 method on the bf16 gradients: one carried noise for both variants
        assert float32["carried_noise"] == bf16["carried_noise"] and bf16["carried_noise"]["min"] > 1e-4
        assert all(row["rank_r_over_optimal"]["min"] >= 1 - 1e-6 for row in batch["variants"].values())
    assert proc.stdout.count("precision rule on") == 2


@pytest.mark.slow
def test_profile_method_small_runs_on_cpu():
    tool = os.path.join(os.path.dirname(BENCH), "tools", "profile_method.py")
    proc = subprocess.run([sys.executable, tool, "--small", "--rows", "3", "--reps", "1", "--batch-bytes", "auto",
                           "--projection", "svd", "--power-iters", "1", "--oversample", "16"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "aten::" in proc.stdout
    assert ("8 modules, projection svd, precision ieee, batch_bytes auto, power_iters 1, oversample 16, "
            "factors chain_rule: wall" in proc.stdout)
    # the truncation's flags under the shipped tangent projection are refused, not ignored
    refused = subprocess.run([sys.executable, tool, "--small", "--power-iters", "1"], capture_output=True, text=True)
    assert refused.returncode == 2 and "power_iters=1: acts only with projection 'svd'" in refused.stderr


@pytest.mark.parametrize("normalize", ["mean", "snr"])
def test_bf16_precision_is_float64_up_to_bfloat16_rounding(normalize):
    # bfloat16 keeps 8 bits: the stored masked matrices and the bf16 operands of every product
    # with them put the result about 2^-8 from float64 (3e-3 to 4e-3 here), float32 ten
    # times closer or more
    mods = [make_module(i, r=4, d_in=96, d_out=80, dtype=torch.float32, scaling=1.5) for i in range(3)]
    wide = [ModuleGrads(m.name, m.index, m.A.double(), m.B.double(), m.gA.double(), m.gB.double(), m.scaling)
            for m in mods]
    # tau 0.5, the setting these bounds were measured at: at 1.0 float32 alone lands about 1e-3
    # from float64 on these modules under the SVD split, which would hide what bf16 adds
    opts = svd_split(normalize=normalize, tau=0.5)
    ref = batched_iga(wide, opts, generators=generators(wide))
    got = batched_iga(mods, opts, generators=generators(mods), triton_precision="bf16")
    f32 = batched_iga(mods, opts, generators=generators(mods))
    for (gA, gB, stats), (rA, rB, rstats), (fA, fB, _), m in zip(got, ref, f32, mods):
        want = product(rA, rB, m.scaling)
        err32 = rel(product(fA.double(), fB.double(), m.scaling), want)
        err16 = rel(product(gA.double(), gB.double(), m.scaling), want)
        assert err32 < 5e-4 and 10 * err32 < err16 < 1e-2, (m.name, err32, err16)
        # the mask statistics come from float32 tiles of bf16-rounded factors
        assert stats["mask_mean"] == pytest.approx(rstats["mask_mean"], rel=2e-3)


def test_precision_auto_follows_the_dtype_the_gradients_were_computed_in():
    from dataclasses import replace

    mods = [make_module(i, r=4, d_in=64, d_out=48, dtype=torch.float32) for i in range(3)]
    run = lambda precision, modules: get_method("iga", implementation="batched", precision=precision).combine(modules, 3)
    ieee, bf16 = run("ieee", mods), run("bf16", mods)
    assert any(not torch.equal(a.gA, b.gA) for a, b in zip(ieee, bf16))  # the two precisions differ here
    for computed_in, want in ((None, ieee), (torch.float32, ieee), (torch.float16, ieee), (torch.bfloat16, bf16)):
        got = run("auto", [replace(m, compute_dtype=computed_in) for m in mods])
        for u, w in zip(got, want):
            assert torch.equal(u.gA, w.gA) and torch.equal(u.gB, w.gB), computed_in
    # bfloat16 factors handed over as they are: their own dtype says it
    assert get_method("iga", precision="auto").precision_for([replace(mods[0], A=mods[0].A.bfloat16())]) == "bf16"
    # the default: bf16 for gradients of a bf16 forward and backward, float32 otherwise
    assert get_method("iga").precision == "auto"


def test_bf16_tile_pass_stores_bfloat16():
    from iga_ds.methods.iga import batched

    mods = [make_module(i, r=4, d_in=48, d_out=40, dtype=torch.float32) for i in range(2)]
    st = batched.stack_modules(mods, generators(mods), 1 << 30)[0]
    factors = batched.stack_factors(st)
    mean_var, mean_sq = batched.mask_scales(*factors, 48 * 40)
    omega = torch.randn(2, 48, 10, generator=torch.Generator().manual_seed(0))
    kw = dict(tau=0.5, normalize="snr", mean_var=mean_var, mean_sq=mean_sq, tile_elements=1 << 20)
    masked, sketch, _, _ = batched.tile_pass_torch(*factors, omega, precision="bf16", **kw)
    full, _, _, _ = batched.tile_pass_torch(*factors, omega, **kw)
    assert masked.dtype == torch.bfloat16 and sketch.dtype == torch.float32
    assert 0 < rel(masked.double(), full.double()) < 2 ** -8


def test_mask_scales_against_the_full_matrices_in_float64():
    """Both scales against V and Gbar formed element by element in float64; the deviations'
    Grams in float32 (exact_var=False, where the mean of V scales no mask) within float32
    rounding, in float64 to float64 rounding."""
    from iga_ds.methods.iga import batched

    mods = [make_module(i, r=4, d_in=48, d_out=40, dtype=torch.float32) for i in range(3)]
    factors = batched.stack_factors(batched.stack_modules(mods, generators(mods), 1 << 30)[0])
    exact = batched.mask_scales(*factors, 48 * 40)
    narrow = batched.mask_scales(*factors, 48 * 40, exact_var=False)
    for i, m in enumerate(mods):
        # tau = 0, no mask: the masked matrix is the mean
        _, mean, _, var = iga_reference(m.A, m.B, m.gA, m.gB, m.scaling, 0.0, 4, "none")
        assert exact[0][i].item() == pytest.approx(var.mean(), rel=1e-6)  # float32 factors
        assert narrow[0][i].item() == pytest.approx(var.mean(), rel=1e-5)
        assert exact[1][i].item() == narrow[1][i].item() == pytest.approx((mean ** 2).mean(), rel=1e-6)
    assert exact[0].dtype == narrow[0].dtype == torch.float64
    # the same Grams of float32 factors, in float64 and in float32: float32 rounding apart, not more
    assert 0 < (exact[0] - narrow[0]).abs().max() / exact[0].abs().max() < 1e-5


def test_factors_against_their_concatenated_definition_and_bf16_rounding():
    """The factors written half by half against cat([s dgB[n], s B]) and cat([A; dgA[n]]) formed
    the obvious way; bfloat16 deviation factors are exactly those rounded once, and their Grams
    (float32, not rounded to bfloat16) give the mean of V to bfloat16's rounding of the factors."""
    from iga_ds.methods.iga import batched

    mods = [make_module(i, r=4, d_in=48, d_out=40, dtype=torch.float32, scaling=0.5 + i) for i in range(3)]
    st = batched.stack_modules(mods, generators(mods), 1 << 30)[0]
    left_mean, right_mean, left_dev, right_dev = batched.stack_factors(st)
    for i, m in enumerate(mods):
        s, N = m.scaling, m.num_domains
        gA_mean, gB_mean = m.gA.mean(0), m.gB.mean(0)
        assert torch.equal(left_mean[i], torch.cat([gB_mean, m.B], dim=1) * s)
        assert torch.equal(right_mean[i], torch.cat([m.A, gA_mean], dim=0))
        for n in range(N):
            assert torch.equal(left_dev[i, n], torch.cat([(m.gB[n] - gB_mean) * s, m.B * s], dim=1))
            assert torch.equal(right_dev[i, n], torch.cat([m.A, m.gA[n] - gA_mean], dim=0))
    low = batched.stack_factors(st, torch.bfloat16)
    assert low[2].dtype == low[3].dtype == torch.bfloat16 and low[0].dtype == torch.float32
    assert torch.equal(low[2], left_dev.bfloat16()) and torch.equal(low[3], right_dev.bfloat16())
    assert torch.equal(low[0], left_mean) and torch.equal(low[1], right_mean)
    narrow = batched.mask_scales(*low, 48 * 40, exact_var=False)
    upcast = batched.mask_scales(low[0], low[1], low[2].float(), low[3].float(), 48 * 40)
    exact = batched.mask_scales(left_mean, right_mean, left_dev, right_dev, 48 * 40)
    assert narrow[0].dtype == torch.float64
    torch.testing.assert_close(narrow[0], upcast[0], rtol=1e-6, atol=0)  # float32 Grams of the same factors
    assert 0 < (narrow[0] - exact[0]).abs().max() / exact[0].abs().max() < 2 ** -8
    assert torch.equal(narrow[1], exact[1])  # the mean's Grams: float64 of the float32 factors
    loose = batched.mask_scales(*low, 48 * 40, exact_var=False, exact_mean=False)  # float32 Grams of them
    torch.testing.assert_close(loose[1], exact[1], rtol=1e-5, atol=0)
    assert torch.equal(loose[0], narrow[0])


def test_equally_spaced_pieces_of_one_buffer_stack_without_a_copy():
    from iga_ds.methods.iga.batched import _stacked

    flat = torch.arange(5 * 7 * 2 * 3, dtype=torch.float32)
    # modules laid out one after another as the hook lays them: [a0 (2 x 3), b0 (7 elements)], ...
    a = [flat[i * 13: i * 13 + 6].view(2, 3) for i in range(5)]
    got = _stacked(a)
    assert torch.equal(got, torch.stack(a)) and got.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    # anything else is copied, and still stacked right
    for case in (
        [t.clone() for t in a],  # separate storages
        a[:2] + a[3:],  # spacing that changes
        [flat[i * 4: i * 4 + 6].view(2, 3) for i in range(5)],  # overlapping pieces
        [flat[i * 13: i * 13 + 6].view(3, 2).mT for i in range(5)],  # not contiguous
    ):
        got = _stacked(case)
        assert torch.equal(got, torch.stack(case))
        assert got.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()


def test_results_tile_the_stacks_buffers_they_name():
    # the hook checks the results through TiledResults.bases: every result tensor a view of a
    # base, and the results together cover the bases exactly (a base element outside every
    # result could not be checked without a false verdict; a result outside them not at all)
    from iga_ds.methods import TiledResults

    shapes = [(4, 24, 20), (4, 24, 20), (3, 16, 18), (4, 24, 20)]
    mods = [make_module(i, r=r, d_in=a, d_out=b, dtype=torch.float32) for i, (r, a, b) in enumerate(shapes)]
    out = batched_iga(mods, svd_split(), generators=generators(mods), batch_bytes=2 * 24 * 20 * 4)  # stacks of at most 2
    assert isinstance(out, TiledResults) and len(out.bases) == 2 * 3
    base_of = {b.untyped_storage().data_ptr(): b for b in out.bases}
    assert len(base_of) == len(out.bases)
    for gA, gB, _ in out:
        for t in (gA, gB):
            assert t._base is not None and t.untyped_storage().data_ptr() in base_of
    assert sum(t.numel() for gA, gB, _ in out for t in (gA, gB)) == sum(b.numel() for b in out.bases)
    method = get_method("iga_svd", implementation="batched", rank=3)
    updates = method.combine(mods, 1)
    assert isinstance(updates, TiledResults) and len(updates.bases) == 2 * 2  # one stack per shape
    assert sum(u.gA.numel() + u.gB.numel() for u in updates) == sum(b.numel() for b in updates.bases)


def test_modules_that_are_views_of_one_buffer_give_the_same_result():
    mods = [make_module(i, r=4, d_in=24, d_out=20, dtype=torch.float32) for i in range(4)]
    parts = [t for m in mods for t in (m.A, m.B, m.gA, m.gB)]
    flat = torch.cat([t.flatten() for t in parts])
    views = [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in parts]), parts)]
    in_buffer = [ModuleGrads(m.name, m.index, *views[4 * i: 4 * i + 4], m.scaling) for i, m in enumerate(mods)]
    want = batched_iga(mods, svd_split(), generators=generators(mods))
    got = batched_iga(in_buffer, svd_split(), generators=generators(in_buffer))
    for (gA, gB, stats), (wA, wB, wstats) in zip(got, want):
        assert torch.equal(gA, wA) and torch.equal(gB, wB) and stats == wstats


def test_stable_modules_keep_their_stacks_and_follow_new_values(monkeypatch):
    """Modules handed over again as :class:`StableModules` (the hook's views, written in place
    between steps) are stacked once; each call still computes on the values they hold then,
    exactly as a fresh list of the same modules would. Stacks that had to copy are not kept."""
    from iga_ds.methods import StableModules
    from iga_ds.methods.iga import batched

    def laid_out(mods):
        parts = [t for m in mods for t in (m.A, m.B, m.gA, m.gB)]
        flat = torch.cat([t.flatten() for t in parts])
        views = [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in parts]), parts)]
        return flat, [ModuleGrads(m.name, m.index, *views[4 * i: 4 * i + 4], m.scaling) for i, m in enumerate(mods)]

    calls = []
    real = batched.stack_modules
    monkeypatch.setattr(batched, "stack_modules", lambda *a, **k: calls.append(1) or real(*a, **k))
    mods = [make_module(i, r=4, d_in=24, d_out=20, dtype=torch.float32) for i in range(3)]
    flat, in_buffer = laid_out(mods)
    stable = StableModules(in_buffer)
    copied = StableModules(mods)  # separate tensors: stacking copies them
    for step in range(3):
        got = batched_iga(stable, svd_split(rank=3), generators=generators(stable))
        got_copied = batched_iga(copied, svd_split(rank=3), generators=generators(copied))
        fresh = batched_iga(list(stable), svd_split(rank=3), generators=generators(stable))
        for (gA, gB, stats), (fA, fB, fstats), (cA, cB, _) in zip(got, fresh, got_copied):
            assert torch.equal(gA, fA) and torch.equal(gB, fB) and stats == fstats
            assert torch.allclose(cA, fA, rtol=1e-5, atol=1e-12)
        # new gradients and factors in place, as the next step's
        flat.mul_(1.5).add_(torch.randn(flat.shape, generator=torch.Generator().manual_seed(step)) * 1e-5)
        for m, v in zip(mods, in_buffer):
            for t, values in ((m.A, v.A), (m.B, v.B), (m.gA, v.gA), (m.gB, v.gB)):
                t.copy_(values)
    # stable: once; copied: every call; fresh lists: every call
    assert len(calls) == 1 + 3 + 3
    assert len(stable.derived) == 1 and not copied.derived
