"""The Jacobi eigendecomposition kernel against torch.linalg.eigh (float64), on the CPU under
Triton's interpreter and on a GPU; the batched method's only wait for the device gone with it."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from iga_ds.methods.iga import IGAOptions, batched, jacobi
from triton_interpreter import run_interpreted


def _graded_grams(M: int, n: int, cols: int, seed: int, decay: float = 1e-5) -> torch.Tensor:
    """Grams X X^T with rows scaled from 1 down to ``decay``: spectra like a sketch's."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(M, n, cols, generator=g, dtype=torch.float64)
    X = X * torch.logspace(0, torch.log10(torch.tensor(decay)).item(), n, dtype=torch.float64)[:, None]
    return X @ X.mT


def _with_values(values: list[float], seed: int) -> torch.Tensor:
    """Q diag(values) Q^T for a random orthogonal Q: eigenvalues chosen, repeated ones too."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(len(values), len(values), generator=g, dtype=torch.float64))
    return (Q * torch.tensor(values, dtype=torch.float64)) @ Q.mT


def _check_decomposition(G: torch.Tensor, values: torch.Tensor, vectors: torch.Tensor, splits) -> None:
    """``values``/``vectors`` of the stack G against torch.linalg.eigh of (G + G^T) / 2:
    eigenvalues, the definition's residual, orthonormal columns, and for each ``s`` in
    ``splits`` the projector onto the eigenvectors from ascending position ``s`` on (what the
    method keeps; eigenvectors are defined up to a rotation within a repeated eigenvalue and
    each up to its sign). Both solvers are accurate to about eps ||G||, so the projectors
    agree to that over the gap at the split (Davis and Kahan)."""
    S = (G + G.mT) / 2
    ref_values, ref_vectors = torch.linalg.eigh(S)
    scale = ref_values.abs().amax(dim=-1, keepdim=True).clamp_min(1e-300)
    n = G.shape[-1]
    eps = torch.finfo(torch.float64).eps
    assert ((values - ref_values).abs() / scale).max() < 1e-14
    residual = (S @ vectors - vectors * values.unsqueeze(-2)).abs().amax(dim=-1) / scale
    assert residual.max() < 1e-14
    assert (vectors.mT @ vectors - torch.eye(n, dtype=torch.float64)).abs().max() < 1e-13
    for s in splits:
        gap = (ref_values[..., s] - ref_values[..., s - 1]) / scale[..., 0]
        bound = torch.clamp(8 * n * eps / gap, min=1e-13)
        top, ref_top = vectors[..., s:], ref_vectors[..., s:]
        error = (top @ top.mT - ref_top @ ref_top.mT).abs().amax(dim=(-2, -1))
        assert (error <= bound).all(), (s, error, bound)


def _jacobi_agrees(device: str) -> None:
    """The kernel on stacks of several sizes and spectra (``device``: "cpu" runs it in the
    interpreter)."""
    def run(G, **kw):
        values, vectors = jacobi.eigh_jacobi(G.to(device), **kw)
        return values.cpu(), vectors.cpu()

    # a sketch's Gram (32: the padded size itself), one that pads 26 to 32, and small sizes
    for M, n, cols in ((1, 32, 200), (2, 26, 80), (2, 5, 9), (1, 1, 3), (2, 2, 4)):
        G = _graded_grams(M, n, cols, seed=n)
        _check_decomposition(G, *run(G), range(1, n))
    # repeated eigenvalues (the projectors onto each eigenspace agree), an indefinite matrix,
    # a Gram of rank 3 (five zero eigenvalues), and a matrix given slightly off symmetric
    repeated = torch.stack([_with_values([3, 3, 3, 1, 1, 0.5, -2, -2], seed=1),
                            _with_values([5, -1, 0.25, 0.25, 0.25, 0.25, 7, 2], seed=2)])
    for G, splits in ((repeated[:1], [2, 3, 5]), (repeated[1:], [1, 2, 6, 7])):
        _check_decomposition(G, *run(G), splits)
    X = torch.randn(1, 8, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    low = X @ X.mT
    _check_decomposition(low, *run(low), [5, 6, 7])
    skewed = _graded_grams(1, 6, 12, seed=4)
    skewed[0, 1, 4] *= 1 + 1e-9
    _check_decomposition(skewed, *run(skewed), range(1, 6))
    # zeros: zero eigenvalues, orthonormal vectors, no sweep needed
    values, vectors = run(torch.zeros(2, 7, 7, dtype=torch.float64))
    assert values.abs().max() == 0 and (vectors.mT @ vectors - torch.eye(7, dtype=torch.float64)).abs().max() == 0
    # a non-finite matrix gives non-finite output (eigh would raise) and leaves the others alone
    bad = _graded_grams(2, 8, 10, seed=5)
    bad[1, 2, 3] = bad[1, 3, 2] = float("nan")
    values, vectors = run(bad)
    assert not torch.isfinite(values[1]).all() and not torch.isfinite(vectors[1]).all()
    _check_decomposition(bad[:1], values[:1], vectors[:1], range(1, 8))
    # one sweep is not enough for a 16 x 16 Gram: the cap is honoured, the result is not converged
    G = _graded_grams(1, 16, 32, seed=6)
    values, _ = run(G, max_sweeps=1)
    assert ((values - torch.linalg.eigh(G)[0]).abs() / torch.linalg.eigh(G)[0].abs().max()).max() > 1e-12


def test_jacobi_in_interpreter_matches_eigh():
    run_interpreted("test_jacobi", "_jacobi_agrees", "cpu", timeout=600)


def test_eigh_keeps_torch_off_cuda_and_past_the_kernel_size():
    G = _graded_grams(2, 6, 10, seed=7)
    assert not jacobi.fits(G)  # CPU
    values, vectors = jacobi.eigh(G)
    ref_values, ref_vectors = torch.linalg.eigh(G)
    assert torch.equal(values, ref_values) and torch.equal(vectors, ref_vectors)
    big = torch.empty(1, jacobi.MAX_SIZE + 1, jacobi.MAX_SIZE + 1, dtype=torch.float64, device="meta")
    assert not jacobi.fits(big)
    with pytest.raises(ValueError, match="float64 stack"):
        jacobi.eigh_jacobi(G.float())
    with pytest.raises(ValueError, match="up to 64 x 64"):
        jacobi.eigh_jacobi(torch.zeros(1, 65, 65, dtype=torch.float64))


cuda = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                          reason="needs CUDA and Triton")


@pytest.mark.gpu
@cuda
def test_jacobi_on_gpu_matches_eigh():
    _jacobi_agrees("cuda")
    # the method's size: 128 Grams of 32 x 32, and 64 x 64, the largest the kernel takes
    for M, n in ((128, 32), (8, 64), (16, 17)):
        G = _graded_grams(M, n, 4 * n, seed=M + n).cuda()
        values, vectors = jacobi.eigh(G)
        _check_decomposition(G.cpu(), values.cpu(), vectors.cpu(), [n - 16, n - 1])


@pytest.mark.gpu
@cuda
def test_the_fused_method_never_waits_for_the_device():
    """With the Jacobi kernel the Triton path of ``batched_iga`` queues all its work without a
    host synchronization (PyTorch's sync debug mode raises on one)."""
    from test_batched import _cuda_modules

    from iga_ds.methods.iga.sketch import sketch_keys

    mods = _cuda_modules(count=6)
    gens = sketch_keys(0, 1, [m.index for m in mods])
    for precision in ("ieee", "bf16"):
        kwargs = dict(generators=gens, triton_precision=precision, batch_bytes=1 << 30)
        options = IGAOptions(projection="svd", factors="chain_rule", power_iters=1, oversample=16)
        batched.batched_iga(mods, options, **kwargs)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = batched.batched_iga(mods, options, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(torch.isfinite(gA).all() and torch.isfinite(gB).all() for gA, gB, _ in out)
