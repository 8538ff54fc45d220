"""Eigendecompositions of stacks of small symmetric float64 matrices on CUDA, by a Jacobi
kernel whose result the host does not wait for.

``torch.linalg.eigh`` checks its solver's status on the host, so every call waits until the
device has run all that was queued before it; the device then sits idle while the host issues
what follows, one launch at a time. Here one program diagonalizes one matrix with cyclic Jacobi
rotations in float64 and writes the eigenvalues in ascending order with their eigenvectors, as
``eigh`` does; nothing is read back, so the host goes on issuing the method's remaining work
while the device runs.

Each sweep visits every pair (p, q) once, in NP - 1 rounds of NP / 2 disjoint pairs (a
round-robin tournament over the size padded to a power of two), so that a round is
elementwise arithmetic on the whole matrix, held in registers, with the partners' rows and
columns gathered. The rotation of a pair is the 2 x 2 symmetric Schur decomposition of Golub
and Van Loan's Matrix Computations (section 8.5, the Jacobi methods). A pair is left alone when its off-diagonal element is at most ``eps`` times the
matrix's Frobenius norm, the normwise accuracy ``eigh`` itself has; the sweeps stop when no
off-diagonal element is above that, or after :data:`MAX_SWEEPS`. The method's Grams
(LLaMA-2-7B shapes, width 32) converged in 6 sweeps. Non-finite input gives non-finite output
(``eigh`` raises instead; the hook checks its results' finiteness).

``torch.linalg.eigh`` is the reference the kernel is tested against; :func:`eigh` falls back to
it off CUDA and for matrices larger than :data:`MAX_SIZE`.
"""
from __future__ import annotations

import torch

from iga_ds.methods.iga import triton_kernels

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

# the largest matrix the kernel takes (its register tiles are the padded size squared)
MAX_SIZE = 64
# a 32 x 32 Gram took 6 sweeps (the method's) to 9 (a Gram of Gaussian rows); a matrix still
# rotating after this many is returned as it stands
MAX_SWEEPS = 30
# warps per program by padded size: a round's latency falls with more threads up to a point,
# past which the extra threads only wait
WARPS = {64: 16, 32: 16, 16: 8}
EPS = 2.0 ** -52  # float64's machine epsilon (a power of two: exact as a kernel constant)


def fits(grams: torch.Tensor) -> bool:
    """Whether :func:`eigh_jacobi` takes this stack: float64 CUDA matrices of at most
    :data:`MAX_SIZE` rows, with Triton installed."""
    return (triton is not None and grams.is_cuda and grams.dtype == torch.float64 and grams.dim() == 3
            and grams.shape[-1] == grams.shape[-2] <= MAX_SIZE)


def eigh(grams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh(grams)`` (eigenvalues ascending, eigenvectors as columns) for a stack
    M x n x n of symmetric matrices: by the Jacobi kernel where :func:`fits`, which does not
    wait for the device, else by ``torch.linalg.eigh``."""
    if fits(grams):
        return eigh_jacobi(grams)
    return torch.linalg.eigh(grams)


def eigh_jacobi(grams: torch.Tensor, *, max_sweeps: int = MAX_SWEEPS,
                num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Jacobi kernel on a stack M x n x n of symmetric float64 matrices (the mean of each
    matrix and its transpose is diagonalized): ``(eigenvalues M x n ascending, eigenvectors
    M x n x n)``. Any device Triton runs on (the CPU under ``TRITON_INTERPRET=1``).
    ``num_warps``: per program (default :data:`WARPS` by the padded size)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if grams.dim() != 3 or grams.shape[-1] != grams.shape[-2] or grams.dtype != torch.float64:
        raise ValueError(f"eigh_jacobi needs a float64 stack M x n x n, got {tuple(grams.shape)} {grams.dtype}")
    M, n, _ = grams.shape
    if n > MAX_SIZE:
        raise ValueError(f"eigh_jacobi takes matrices up to {MAX_SIZE} x {MAX_SIZE}, got {n} x {n}")
    values = grams.new_empty(M, n)
    vectors = grams.new_empty(M, n, n)
    if M and n:
        size = max(2, triton.next_power_of_2(n))
        warps = WARPS.get(size, 4) if num_warps is None else num_warps
        _jacobi_kernel[(M,)](grams.contiguous(), values, vectors, n, max_sweeps, NP=size, TOL=EPS,
                             num_warps=warps, **triton_kernels.LAUNCH_OPTIONS)
    return values, vectors


if triton is not None:

    @triton.jit
    def _partners(i, t, NP: tl.constexpr):
        """Each index's partner in round ``t`` of a round-robin over NP players: NP - 1 stays,
        the others turn (an involution; every pair meets once in NP - 1 rounds)."""
        m = NP - 1
        p = (2 * t + m - i) % m
        p = tl.where(p == i, m, p)
        return tl.where(i == m, t, p)

    @triton.jit
    def _rotate(A, V, t, floor, NP: tl.constexpr):
        """One round: the rotations of NP / 2 disjoint pairs applied as A <- J^T A J, V <- V J,
        all in registers (the partners' rows and columns gathered)."""
        i = tl.arange(0, NP)
        rows, cols = i[:, None], i[None, :]
        p = _partners(i, t, NP)
        by_row = tl.broadcast_to(p[:, None], (NP, NP))
        by_col = tl.broadcast_to(p[None, :], (NP, NP))
        a_r = tl.gather(A, by_row, axis=0)  # A[p(i), j]
        a_c = tl.gather(A, by_col, axis=1)  # A[i, p(j)]
        a_rc = tl.gather(a_r, by_col, axis=1)  # A[p(i), p(j)]
        v_c = tl.gather(V, by_col, axis=1)  # V[i, p(j)]
        own = tl.sum(tl.where(rows == cols, A, 0.0), axis=1)  # a_ii
        other = tl.sum(tl.where(rows == cols, a_rc, 0.0), axis=1)  # a_p(i)p(i)
        across = tl.sum(tl.where(rows == cols, a_c, 0.0), axis=1)  # a_i,p(i)
        # both of a pair take the element of the lower index's row: the same rotation
        apq = tl.where(i < p, across, tl.gather(across, p, axis=0))
        app = tl.where(i < p, own, other)
        aqq = tl.where(i < p, other, own)
        skip = tl.abs(apq) <= floor
        # t = sign(theta) / (|theta| + sqrt(theta^2 + 1)), theta = (a_qq - a_pp) / (2 a_pq), in
        # one division
        d = aqq - app
        denominator = tl.where(skip, 1.0, tl.abs(d) + tl.sqrt(d * d + 4.0 * apq * apq))
        tangent = tl.where(skip, 0.0, 2.0 * tl.where(d >= 0, apq, -apq) / denominator)
        c = tl.math.rsqrt(1.0 + tangent * tangent)
        # column p of J is (c, -s) at (p, q), column q is (s, c): each index's partner weight
        sig = tl.where(i < p, -tangent * c, tangent * c)
        ci, cj, si, sj = c[:, None], c[None, :], sig[:, None], sig[None, :]
        new = (ci * cj * A + si * sj * a_rc) + (ci * sj * a_c + si * cj * a_r)
        # the rotated pair's own elements by their exact forms: the diagonal moved by t a_pq,
        # the pair's off-diagonal zero
        diag = tl.where(i < p, app - tangent * apq, aqq + tangent * apq)
        new = tl.where(rows == cols, diag[:, None], new)
        new = tl.where((cols == p[:, None]) & (tangent != 0.0)[:, None], 0.0, new)
        return new, cj * V + sj * v_c

    @triton.jit
    def _rotating(A, floor, NP: tl.constexpr):
        """How many off-diagonal elements would still rotate (0: converged; NaN never is)."""
        i = tl.arange(0, NP)
        rows, cols = i[:, None], i[None, :]
        above = ~(tl.abs(A) <= floor) & (rows != cols)
        return tl.sum(tl.sum(above.to(tl.int32), axis=1), axis=0)

    @triton.jit
    def _jacobi_kernel(a_ptr, w_ptr, v_ptr, n, max_sweeps, NP: tl.constexpr, TOL: tl.constexpr):
        """The eigendecomposition of matrix ``program_id(0)`` (n x n, padded to NP x NP with
        zeros, which no rotation touches)."""
        mod = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, NP)
        rows, cols = i[:, None], i[None, :]
        real = (rows < n) & (cols < n)
        a = a_ptr + mod * n * n
        A = tl.load(a + rows * n + cols, mask=real, other=0.0)
        A = 0.5 * (A + tl.load(a + cols * n + rows, mask=real, other=0.0))
        V = tl.where(rows == cols, 1.0, 0.0).to(tl.float64)
        floor = TOL * tl.sqrt(tl.sum(tl.sum(A * A, axis=1), axis=0))
        sweeps = 0
        left = _rotating(A, floor, NP)
        while (sweeps < max_sweeps) & (left > 0):
            for t in range(NP - 1):
                A, V = _rotate(A, V, t, floor, NP)
            sweeps += 1
            left = _rotating(A, floor, NP)
        lam = tl.sum(tl.where(rows == cols, A, 0.0), axis=1)
        # ascending order, ties by index; NaN sorts last (its output is NaN either way)
        key = tl.where((i < n) & (lam == lam), lam, float("inf"))
        before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (cols < rows))
        rank = tl.sum(before.to(tl.int32), axis=1)
        tl.store(w_ptr + mod * n + rank, lam, mask=i < n)
        tl.store(v_ptr + mod * n * n + rows * n + rank[None, :], V, mask=real)
