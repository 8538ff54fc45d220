"""The counter-based Gaussian test matrices of the randomized SVD (iga_ds.methods.iga.sketch)."""
import math

import pytest
import torch

from iga_ds.methods import ModuleGrads, get_method, sketch_key
from iga_ds.methods.iga.batched import batched_iga
from iga_ds.methods.iga.options import IGAOptions
from iga_ds.methods.iga.reference import iga_update
from iga_ds.methods.iga.sketch import SketchKey, SketchKeys, gaussian, gaussian_stack, mixed_keys, sketch_keys

MASK = (1 << 64) - 1


def stream_element(key: int, e: int) -> float:
    """Element ``e`` of key ``key``'s stream, written out in Python integers and floats: the
    SplitMix64 finaliser, two 24-bit uniforms, Box-Muller."""
    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    h = mix((mix(key) + (e + 1) * 0x9E3779B97F4A7C15) & MASK)
    u1 = ((h >> 40) + 0.5) / 2**24
    u2 = ((h >> 16) & 0xFFFFFF) / 2**24
    return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)


@pytest.mark.parametrize("key", [0, 1, 12345, 2**63 - 2, 2**64 - 1])
def test_stream_is_the_splitmix_box_muller_of_each_element(key):
    rows, cols, offset = 7, 5, 300
    got = gaussian_stack([SketchKey(key)], rows, cols, dtype=torch.float64, offset=offset)[0]
    want = torch.tensor([stream_element(key, offset + e) for e in range(rows * cols)], dtype=torch.float64)
    # the 64-bit arithmetic is exact; float64 Box-Muller agrees to rounding
    torch.testing.assert_close(got.flatten(), want, rtol=1e-12, atol=1e-12)
    f32 = gaussian_stack([SketchKey(key)], rows, cols, offset=offset)[0]
    assert f32.dtype == torch.float32
    torch.testing.assert_close(f32.double().flatten(), want, rtol=0, atol=2e-5)


def test_matrices_are_standard_normal_and_independent_across_keys():
    keys = [sketch_key(0, step, index) for step in (1, 2) for index in range(4)]
    draws = gaussian_stack(keys, 500, 100, dtype=torch.float64)  # 8 x 50,000 numbers
    assert torch.isfinite(draws).all()
    flat = draws.flatten(1)
    n = flat.shape[1]
    # mean 0 and variance 1 within five standard errors, per key
    assert flat.mean(dim=1).abs().max() < 5 / math.sqrt(n)
    assert (flat.var(dim=1) - 1).abs().max() < 5 * math.sqrt(2 / n)
    # a normal's fourth moment is 3 (uniforms or a broken transform are far off)
    assert (flat.pow(4).mean(dim=1) - 3).abs().max() < 0.2
    # keys of neighbouring steps and modules: correlations at the noise level
    corr = torch.corrcoef(flat)
    off_diagonal = corr - torch.eye(len(keys), dtype=corr.dtype)
    assert off_diagonal.abs().max() < 5 / math.sqrt(n)


def test_a_second_matrix_continues_the_stream_where_the_first_ended():
    keys = [SketchKey(3), SketchKey(4)]
    whole = gaussian_stack(keys, 1, 60 + 20).flatten(1)
    first = gaussian_stack(keys, 6, 10)
    second = gaussian_stack(keys, 4, 5, offset=60)
    assert torch.equal(first.flatten(1), whole[:, :60]) and torch.equal(second.flatten(1), whole[:, 60:])
    # one key alone gives its row of the stack: no dependence on the other modules
    assert torch.equal(gaussian(keys[1], 6, 10, dtype=torch.float32, device="cpu"), first[1])


def test_keys_are_fixed_by_seed_step_and_module():
    assert sketch_key(0, 5, 7) == sketch_key(0, 5, 7)
    assert len({sketch_key(s, t, i) for s in range(3) for t in range(3) for i in range(50)}) == 450
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match="sketch key"):
            SketchKey(bad)


def test_keys_of_a_step_are_each_modules_key():
    # the integers behind SketchKeys are sketch_key's, item by item, taken or sliced
    indices = [5, 0, 2**20, 3]
    keys = sketch_keys(11, 2**40, indices)
    assert isinstance(keys, SketchKeys) and len(keys) == 4
    assert list(keys) == [sketch_key(11, 2**40, i) for i in indices]
    assert list(keys.take([3, 0])) == [sketch_key(11, 2**40, 3), sketch_key(11, 2**40, 5)]
    assert list(keys[1:3]) == [sketch_key(11, 2**40, 0), sketch_key(11, 2**40, 2**20)]
    assert mixed_keys(keys) == mixed_keys(list(keys))


def test_the_fused_method_draws_the_same_sketches_from_keys_of_a_step():
    mods = [_module(i, dtype=torch.float32) for i in range(3)]
    listed = batched_iga(mods, IGAOptions(rank=3, projection="svd", factors="split"), generators=[sketch_key(7, 2, m.index) for m in mods], batch_bytes=1)
    keyed = batched_iga(mods, IGAOptions(rank=3, projection="svd", factors="split"), generators=sketch_keys(7, 2, [m.index for m in mods]), batch_bytes=1)
    for (gA, gB, _), (kA, kB, _) in zip(listed, keyed):
        assert torch.equal(gA, kA) and torch.equal(gB, kB)


def _module(index, r=4, d_in=40, d_out=36, N=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(index)
    return ModuleGrads(f"m{index}", index, torch.randn(r, d_in, generator=g, dtype=dtype) / 6,
                       torch.randn(d_out, r, generator=g, dtype=dtype) * 1e-2,
                       1e-4 * torch.randn(N, r, d_in, generator=g, dtype=dtype),
                       1e-4 * torch.randn(N, d_out, r, generator=g, dtype=dtype), 2.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("svd", ["randomized", "single_pass"])
def test_keyed_modules_drawn_at_once_match_the_reference_drawn_one_by_one(dtype, tol, svd):
    mods = [_module(i, dtype=dtype) for i in range(3)]
    keys = [sketch_key(7, 2, m.index) for m in mods]
    fused = batched_iga(mods, IGAOptions(svd=svd, rank=3, projection="svd", factors="split"), generators=keys)
    for m, key, (gA, gB, _) in zip(mods, keys, fused):
        rA, rB, _ = iga_update(m.A, m.B, m.gA, m.gB, scaling=m.scaling, svd=svd, rank=3, generator=key, projection="svd", factors="split")
        want = (rB.double() @ rA.double())
        assert float((gB.double() @ gA.double() - want).norm() / want.norm()) < tol, m.name
    # the sketch matters at rank 3 of 4: another key gives another result
    other = batched_iga(mods, IGAOptions(svd=svd, rank=3, projection="svd", factors="split"), generators=[sketch_key(8, 2, m.index) for m in mods])
    assert not torch.allclose(other[0][1] @ other[0][0], fused[0][1] @ fused[0][0], rtol=1e-6, atol=0)


def test_the_method_keys_its_sketches_by_seed_step_and_module():
    mods = [_module(i) for i in range(3)]
    method = get_method("iga_svd", implementation="reference", rank=3, seed=4)
    got = method.combine(mods, 9)
    for m, u in zip(mods, got):
        rA, rB, _ = iga_update(m.A, m.B, m.gA, m.gB, scaling=m.scaling, rank=3, factors="chain_rule",
                               generator=sketch_key(4, 9, m.index), projection="svd")
        assert torch.equal(u.gA, rA) and torch.equal(u.gB, rB)
