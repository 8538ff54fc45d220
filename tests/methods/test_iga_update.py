"""iga_update against slow float64 references."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from iga_ds import iga_update
from iga_ds.methods.iga.reference import reconstruct
from iga_ds.methods.iga.rsvd import exact_svd, randomized_svd, single_pass_svd
from reference_impl import iga_reference


def make_module(N=4, r=4, d_in=24, d_out=20, seed=0, dtype=torch.float64, b_zero=False):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(r, d_in, generator=g, dtype=dtype) / d_in**0.5
    B = torch.zeros(d_out, r, dtype=dtype) if b_zero else torch.randn(d_out, r, generator=g, dtype=dtype) * 0.1
    gA = torch.randn(N, r, d_in, generator=g, dtype=dtype)
    gB = torch.randn(N, d_out, r, generator=g, dtype=dtype)
    return A, B, gA, gB


def product(gA, gB, s):
    return s * gB @ gA


def test_reconstruction_is_the_first_order_change_of_merged_weight():
    # Real per-domain gradients from autograd through a merged W0 + s * B @ A, then the
    # directional derivative of s * B @ A along them, by forward-mode autograd.
    torch.manual_seed(0)
    r, d_in, d_out, s = 3, 7, 5, 2.0
    W0 = torch.randn(d_out, d_in, dtype=torch.float64)
    A = torch.randn(r, d_in, dtype=torch.float64, requires_grad=True)
    B = torch.randn(d_out, r, dtype=torch.float64, requires_grad=True)
    x = torch.randn(9, d_in, dtype=torch.float64)
    y = torch.randn(9, d_out, dtype=torch.float64)
    loss = ((x @ (W0 + s * B @ A).T - y) ** 2).mean()
    gA, gB = torch.autograd.grad(loss, (A, B))
    _, tangent = torch.autograd.functional.jvp(lambda a, b: s * b @ a, (A.detach(), B.detach()), (gA, gB))
    torch.testing.assert_close(reconstruct(A.detach(), B.detach(), gA, gB, s), tangent, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("normalize", ["none", "mean", "snr"])
@pytest.mark.parametrize("tau", [0.0, 0.5, 3.0])
def test_matches_float64_reference(normalize, tau):
    A, B, gA, gB = make_module(seed=1)
    s = 2.0
    gA_new, gB_new, stats = iga_update(A, B, gA, gB, scaling=s, tau=tau, normalize=normalize, svd="exact", projection="svd", factors="split")
    ref, g, mask, var = iga_reference(A, B, gA, gB, s, tau, A.shape[0], normalize)
    np.testing.assert_allclose(product(gA_new, gB_new, s).numpy(), ref, rtol=1e-9, atol=1e-12)
    assert stats["mask_mean"] == pytest.approx(mask.mean(), rel=1e-9)
    assert stats["mask_frac_below_half"] == pytest.approx((mask < 0.5).mean())
    assert stats["gir"] == pytest.approx(var.sum(), rel=1e-9)
    S = np.linalg.svd(g, compute_uv=False)
    assert stats["energy_kept"] == pytest.approx((S[: A.shape[0]] ** 2).sum() / (S**2).sum(), rel=1e-9)


def test_raw_tau_is_a_no_op_at_llm_gradient_scale():
    # The reason "none" is not the default: with gradients near 1e-4, V is ~1e-10.
    A, B, gA, gB = make_module(seed=2)
    _, _, stats = iga_update(A, B, gA * 1e-4, gB * 1e-4, scaling=2.0, normalize="none", svd="exact", projection="svd", factors="split")
    assert stats["mask_mean"] > 1 - 1e-6
    _, _, stats = iga_update(A, B, gA * 1e-4, gB * 1e-4, scaling=2.0, normalize="mean", svd="exact", projection="svd", factors="split")
    assert stats["mask_mean"] < 0.9


def test_truncation_equals_linalg_svd_truncation():
    A, B, gA, gB = make_module(r=6, seed=3)
    for rank in (1, 3, 6):
        gA_new, gB_new, _ = iga_update(A, B, gA, gB, scaling=1.0, tau=0.0, rank=rank, svd="exact", projection="svd", factors="split")
        mean = reconstruct(A, B, gA, gB, 1.0).mean(0)
        U, S, Vh = torch.linalg.svd(mean)
        torch.testing.assert_close(product(gA_new, gB_new, 1.0), (U[:, :rank] * S[:rank]) @ Vh[:rank])
        # padding keeps PEFT shapes when rank < r
        assert gA_new.shape == A.shape and gB_new.shape == B.shape


def test_randomized_matches_exact_when_spectrum_has_a_gap():
    g = torch.Generator().manual_seed(4)
    m, n, k = 60, 50, 5
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    spectrum = torch.cat([torch.tensor([10.0, 8, 6, 5, 4]), torch.full((n - k,), 1e-3)]).double()
    M = (U[:, :n] * spectrum) @ V.T
    Ur, Sr, Vr = randomized_svd(M, k, oversample=10, power_iters=2, generator=torch.Generator().manual_seed(0))
    Ue, Se, Ve = exact_svd(M, k)
    torch.testing.assert_close(Sr, Se, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close((Ur * Sr) @ Vr, (Ue * Se) @ Ve, rtol=1e-6, atol=1e-8)
    # canonical signs: the vectors themselves agree, not only the product
    torch.testing.assert_close(Ur, Ue, rtol=1e-6, atol=1e-8)


def test_single_pass_is_exact_for_low_rank_and_near_optimal_otherwise():
    g = torch.Generator().manual_seed(7)
    m, n, k = 70, 50, 4
    # rank 6 <= the sketch width 4 + 3: the two sketches determine M, so the result is exact
    low = torch.randn(m, 6, generator=g, dtype=torch.float64) @ torch.randn(6, n, generator=g, dtype=torch.float64)
    Us, Ss, Vs = single_pass_svd(low, k, oversample=3, generator=torch.Generator().manual_seed(1))
    Ue, Se, Ve = exact_svd(low, k)
    torch.testing.assert_close(Ss, Se, rtol=1e-9, atol=0)
    torch.testing.assert_close(Us, Ue, rtol=1e-7, atol=1e-9)  # canonical signs: the vectors agree
    torch.testing.assert_close(Vs, Ve, rtol=1e-7, atol=1e-9)
    # a slowly decaying spectrum: one pass gives up accuracy, within the expected-error bound of
    # Tropp et al. 2017 (Thm 5.1 and 4.3: (1 + k/(l-k-1)) (1 + r/(w-r-1)) times the optimal tail)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    M = (U[:, :n] * (1.0 / torch.arange(1, n + 1, dtype=torch.float64))) @ V.T
    optimal = (M - (lambda u, s, v: (u * s) @ v)(*exact_svd(M, k))).norm()
    width = k + 10
    bound = ((1 + width / (2 * width + 1 - width - 1)) * (1 + k / (width - k - 1))) ** 0.5
    errors = []
    for seed in range(5):
        u, s_, v = single_pass_svd(M, k, oversample=10, generator=torch.Generator().manual_seed(seed))
        errors.append(float((M - (u * s_) @ v).norm() / optimal))
    assert 1.0 <= min(errors) and sum(errors) / len(errors) < bound, errors


def _truncation(module, tau, svd):
    """s gB_new @ gA_new of iga_update on ``module`` (scaling 1), a fixed sketch seed."""
    A, B, gA, gB = module
    gen = torch.Generator().manual_seed(11)
    return product(*iga_update(A, B, gA, gB, scaling=1.0, tau=tau, normalize="mean", svd=svd,
                                   generator=gen, projection="svd", factors="split")[:2], 1.0)


def test_single_pass_in_iga_update_close_to_exact():
    A, B, gA, gB = module = make_module(r=4, d_in=40, d_out=36, seed=5)
    run = lambda tau, svd: _truncation(module, tau, svd)  # noqa: E731

    exact, approx = run(0.0, "exact"), run(0.0, "single_pass")
    assert (approx - exact).norm() / exact.norm() < 1e-10  # rank <= 2r = 8 < width 14: exact
    # masked: full rank with a flat tail. One pass loses more than power iterations do: its
    # rank-4 error is within 15% of the optimal one (measured 8.8%), power iterations' within 0.1%
    from iga_ds.methods.iga.reference import mean_and_variance, normalize_variance

    mean, var = mean_and_variance(A, B, gA, gB, 1.0)
    masked = mean * torch.exp(-0.5 * normalize_variance(var, mean, "mean"))
    optimal = (masked - run(0.5, "exact")).norm()
    assert (masked - run(0.5, "randomized")).norm() / optimal < 1.001
    assert 1.0 <= (masked - run(0.5, "single_pass")).norm() / optimal < 1.15


def test_randomized_in_iga_update_close_to_exact():
    module = make_module(r=4, d_in=40, d_out=36, seed=5)
    run = lambda tau, svd: _truncation(module, tau, svd)  # noqa: E731

    # unmasked mean of rank-r reconstructions has rank <= 2r = 8: a sketch of width 14 is exact
    exact, approx = run(0.0, "exact"), run(0.0, "randomized")
    assert (approx - exact).norm() / exact.norm() < 1e-10
    # the element-wise mask makes the matrix full rank: a few power iterations still get close
    exact, approx = run(0.5, "exact"), run(0.5, "randomized")
    assert (approx - exact).norm() / exact.norm() < 1e-3


def test_permutation_invariance_over_domains():
    A, B, gA, gB = make_module(seed=6)
    base = iga_update(A, B, gA, gB, scaling=1.5, svd="exact", projection="svd", factors="split")
    for perm in itertools.islice(itertools.permutations(range(4)), 1, 6):
        p = list(perm)
        other = iga_update(A, B, gA[p], gB[p], scaling=1.5, svd="exact", projection="svd", factors="split")
        torch.testing.assert_close(other[0], base[0])
        torch.testing.assert_close(other[1], base[1])


def test_identical_domains_give_mask_one():
    A, B, gA, gB = make_module(seed=7)
    gA = gA[:1].expand(4, -1, -1).clone()
    gB = gB[:1].expand(4, -1, -1).clone()
    for normalize in ("none", "mean", "snr"):
        _, _, stats = iga_update(A, B, gA, gB, scaling=1.0, tau=5.0, normalize=normalize, svd="exact", projection="svd", factors="split")
        assert stats["mask_mean"] == 1.0 and stats["gir"] == 0.0


def test_tau_zero_exact_equals_truncated_mean_and_b_zero_start():
    # B = 0 is PEFT's initialisation: only gB carries signal, G[n] = s * gB[n] @ A.
    A, B, gA, gB = make_module(seed=8, b_zero=True)
    gA_new, gB_new, _ = iga_update(A, B, gA, gB, scaling=2.0, tau=0.0, svd="exact", projection="svd", factors="split")
    mean = 2.0 * gB.mean(0) @ A
    U, S, Vh = torch.linalg.svd(mean)
    r = A.shape[0]
    torch.testing.assert_close(product(gA_new, gB_new, 2.0), (U[:, :r] * S[:r]) @ Vh[:r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_shapes_and_dtypes(dtype):
    A, B, gA, gB = (t.to(dtype) for t in make_module(seed=9))
    gA_new, gB_new, stats = iga_update(A, B, gA, gB, scaling=2.0, generator=torch.Generator().manual_seed(0), projection="svd", factors="split")
    assert gA_new.shape == A.shape and gB_new.shape == B.shape
    assert gA_new.dtype == dtype and gB_new.dtype == dtype
    assert set(stats) >= {"mask_mean", "mask_frac_below_half", "gir", "energy_kept"}


def test_float32_close_to_float64():
    A, B, gA, gB = make_module(seed=10)
    ref = product(*iga_update(A, B, gA, gB, scaling=2.0, svd="exact", projection="svd", factors="split")[:2], 2.0)
    f32 = [t.float() for t in (A, B, gA, gB)]
    got = product(*iga_update(*f32, scaling=2.0, svd="exact", projection="svd", factors="split")[:2], 2.0)
    assert (got.double() - ref).norm() / ref.norm() < 1e-5


def test_bad_arguments_are_clear():
    A, B, gA, gB = make_module()
    with pytest.raises(ValueError, match="normalize"):
        iga_update(A, B, gA, gB, scaling=1.0, normalize="zscore", projection="svd", factors="split")
    with pytest.raises(ValueError, match="rank"):
        iga_update(A, B, gA, gB, scaling=1.0, rank=99, projection="svd", factors="split")
    with pytest.raises(ValueError, match="shapes"):
        iga_update(A, B, gA[:, :, :-1], gB, scaling=1.0, projection="svd", factors="split")
    with pytest.raises(ValueError, match="svd"):
        iga_update(A, B, gA, gB, scaling=1.0, svd="lanczos", projection="svd", factors="split")
