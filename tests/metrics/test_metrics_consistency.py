"""LCS and GIR against independent float64 computations."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from iga_ds.data.groups import isomer_groups
from iga_ds.metrics import gir, lcs, lcs_paper_units


def _lcs_numpy(hidden: np.ndarray) -> float:
    # the definition, literally: H x H sample covariance of the N vectors, its trace, mean over K
    return float(np.mean([np.trace(np.atleast_2d(np.cov(group, rowvar=False, ddof=1))) for group in hidden]))


@pytest.mark.parametrize("k, n, h", [(1, 2, 3), (5, 4, 16), (7, 3, 1)])
def test_lcs_matches_numpy_cov(k, n, h):
    rng = np.random.default_rng(k * 100 + n)
    hidden = rng.normal(size=(k, n, h)) * rng.uniform(0.1, 3.0, size=(k, 1, h))
    got = lcs(torch.tensor(hidden, dtype=torch.float32))
    assert got == pytest.approx(_lcs_numpy(hidden.astype(np.float32).astype(np.float64)), rel=1e-12)


def test_lcs_zero_for_identical_domains_and_units():
    same = torch.randn(4, 1, 8).expand(4, 3, 8)
    assert lcs(same) == pytest.approx(0.0, abs=1e-12)
    assert lcs_paper_units(0.031) == pytest.approx(3.1)


def test_lcs_rejects_bad_shapes():
    with pytest.raises(ValueError, match="K x N x H"):
        lcs(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="at least 2"):
        lcs(torch.zeros(3, 1, 4))


def test_gir_is_sum_of_population_variance():
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(4, 6, 5))
    expected = float(np.var(grads, axis=0, ddof=0).sum())
    assert gir(torch.tensor(grads)) == pytest.approx(expected, rel=1e-12)
    # same value from the per-domain list form and, split in two modules, from the mapping form
    assert gir([torch.tensor(g) for g in grads]) == pytest.approx(expected, rel=1e-12)
    split = {"a": torch.tensor(grads[:, :2]), "b": torch.tensor(grads[:, 2:])}
    assert gir(split) == pytest.approx(expected, rel=1e-12)
    # the paper's form: 1/N sum_n ||g_n - gbar||^2
    flat = grads.reshape(4, -1)
    assert gir(torch.tensor(grads)) == pytest.approx(np.mean(np.sum((flat - flat.mean(0)) ** 2, axis=1)))


def test_isomer_groups_keeps_complete_groups_in_domain_order():
    recs = [
        {"group_id": "g1", "domain": "math"},
        {"group_id": "g1", "domain": "legal"},
        {"group_id": "g2", "domain": "legal"},  # incomplete: dropped
        {"group_id": "g3", "domain": "legal"},
        {"group_id": "g3", "domain": "math"},
    ]
    groups, domains = isomer_groups(recs)
    assert domains == ["legal", "math"]
    assert [[r["group_id"] + r["domain"] for r in g] for g in groups] == [["g1legal", "g1math"], ["g3legal", "g3math"]]
