"""Every registered method against a slow, direct reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from iga_ds.methods import ModuleGrads, available_methods, get_method
from iga_ds.methods.pareto import min_norm_weights
from iga_ds.methods.pcgrad import pcgrad_weights
from reference_impl import (and_mask_reference, chain_rule_reference, iga_reference, pcgrad_reference,
                            sand_mask_reference)

TESTED = set()


def covers(*names):
    TESTED.update(names)
    return lambda f: f


def modules(N=3, count=3, seed=0, r=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        d_in, d_out = 10 + i, 8 + 2 * i
        out.append(
            ModuleGrads(
                name=f"m{i}", index=i,
                A=torch.randn(r, d_in, generator=g, dtype=torch.float64) * 0.3,
                B=torch.randn(d_out, r, generator=g, dtype=torch.float64) * 0.3,
                gA=torch.randn(N, r, d_in, generator=g, dtype=torch.float64),
                gB=torch.randn(N, d_out, r, generator=g, dtype=torch.float64),
                scaling=2.0,
            )
        )
    return out


def flat_domain_vectors(mods):
    N = mods[0].num_domains
    return np.concatenate(
        [np.concatenate([m.gA.reshape(N, -1).numpy(), m.gB.reshape(N, -1).numpy()], axis=1) for m in mods], axis=1
    )


def flat_update(updates):
    return np.concatenate([np.concatenate([u.gA.reshape(-1).numpy(), u.gB.reshape(-1).numpy()]) for u in updates])


@covers("iga_svd", "iga_binary", "mean_no_mask", "iga_no_projection")
@pytest.mark.parametrize(
    "name,kw",
    [
        ("iga_svd", dict(binary=False)),
        ("iga_binary", dict(binary=True)),
        ("mean_no_mask", dict(mask_off=True)),
        ("iga_no_projection", dict(chain=True)),
    ],
)
def test_iga_family_against_reference(name, kw):
    for factors in ("split",) if kw.get("chain") else ("split", "chain_rule"):
        mask = {} if name == "mean_no_mask" else {"tau": 1.0, "normalize": "mean"}  # no mask: no tau
        # the chain ablation has no SVD, so none of its options
        svd = {} if kw.get("chain") else dict(svd="exact", factors=factors)
        svd.update({} if kw.get("chain") or name == "iga_svd" else {"projection": "svd"})  # iga_svd fixes it
        method = get_method(name, **svd, **mask)
        for m, u in zip(modules(), method.combine(modules(), step=0)):
            ref, *_ = iga_reference(m.A, m.B, m.gA, m.gB, m.scaling, 1.0, 3, "mean", **kw)
            if kw.get("chain"):  # no SVD: the chain rule of the masked matrix
                np.testing.assert_allclose(u.gB.numpy(), ref[0], rtol=1e-10)
                np.testing.assert_allclose(u.gA.numpy(), ref[1], rtol=1e-10)
            elif factors == "split":
                np.testing.assert_allclose((m.scaling * u.gB @ u.gA).numpy(), ref, rtol=1e-9, atol=1e-12)
            else:
                dA, dB = chain_rule_reference(ref, m.A, m.B, m.scaling)
                np.testing.assert_allclose(u.gA.numpy(), dA, rtol=1e-9, atol=1e-12)
                np.testing.assert_allclose(u.gB.numpy(), dB, rtol=1e-9, atol=1e-12)


@covers("iga", "iga_svd", "iga_no_projection")
def test_options_of_another_projection_are_refused_not_ignored():
    # each of iga and iga_svd names the other where the other takes what was asked for
    with pytest.raises(ValueError, match=r"factors='split': acts only with projection 'svd'.*the method iga_svd is"):
        get_method("iga", rank=4, factors="split")
    with pytest.raises(ValueError, match=r"iga fixes its projection.*got 'svd' \(the method iga_svd is"):
        get_method("iga", projection="svd")
    with pytest.raises(ValueError, match=r"damping=0.5: acts only with projection 'tangent'.*the method iga is"):
        get_method("iga_svd", damping=0.5)
    with pytest.raises(ValueError, match=r"iga_svd fixes its projection"):
        get_method("iga_svd", projection="tangent")
    with pytest.raises(ValueError, match=r"svd='exact': acts only with projection 'svd', and projection is 'chain'"):
        get_method("iga_no_projection", svd="exact")
    with pytest.raises(ValueError, match="iga_no_projection fixes its projection"):
        get_method("iga_no_projection", projection="svd")
    get_method("iga_svd", rank=4, factors="split")  # where they act, they are taken


@covers("iga_svd")
def test_iga_randomized_is_seeded_by_step_and_module_not_by_call_order():
    method = get_method("iga_svd", tau=0.5, seed=3)
    mods = modules()
    forward = method.combine(mods, step=7)
    backward = method.combine(mods[::-1], step=7)[::-1]
    for a, b in zip(forward, backward):
        assert torch.equal(a.gA, b.gA) and torch.equal(a.gB, b.gB)


@covers("iga_lora_space")
def test_lora_space_mask_elementwise_loop():
    tau = 0.7
    for m, u in zip(modules(), get_method("iga_lora_space", tau=tau, normalize="mean").combine(modules(), 0)):
        for g, got in ((m.gA.numpy(), u.gA.numpy()), (m.gB.numpy(), u.gB.numpy())):
            flat = g.reshape(g.shape[0], -1)
            var = np.array([np.var(flat[:, e]) for e in range(flat.shape[1])])
            mean = flat.mean(axis=0)
            expected = mean * np.exp(-tau * var / var.mean())
            np.testing.assert_allclose(got.reshape(-1), expected, rtol=1e-10)


@covers("and_mask")
@pytest.mark.parametrize("threshold", [1.0, 0.6])
def test_and_mask_sign_agreement_loop(threshold):
    mods = modules(N=4, seed=1)
    # make some elements agree in sign across all domains
    for m in mods:
        m.gA[:, 0] = m.gA[:, 0].abs()
    for m, u in zip(mods, get_method("and_mask", threshold=threshold).combine(mods, 0)):
        np.testing.assert_allclose(u.gA.numpy(), and_mask_reference(m.gA.numpy(), threshold), rtol=1e-10)
        np.testing.assert_allclose(u.gB.numpy(), and_mask_reference(m.gB.numpy(), threshold), rtol=1e-10)


@covers("sand_mask")
def test_sand_mask_elementwise_loop():
    mods = modules(N=4, seed=2)
    for m in mods:
        m.gA.mul_(0.1)  # variances near 1e-2 keep the tanh unsaturated for some elements
    method = get_method("sand_mask", tau=0.3, k=0.05, gamma=1.0)
    for m, u in zip(mods, method.combine(mods, 0)):
        np.testing.assert_allclose(u.gA.numpy(), sand_mask_reference(m.gA.numpy(), 0.3, 0.05, 1.0), rtol=1e-9)
        np.testing.assert_allclose(u.gB.numpy(), sand_mask_reference(m.gB.numpy(), 0.3, 0.05, 1.0), rtol=1e-9)


def _masks_statistics(masks):
    """Mean and below-1/2 share over the elements of every mask of one module."""
    every = np.concatenate(masks)
    return every.mean(), (every < 0.5).mean()


@covers("sand_mask", "and_mask")
@pytest.mark.parametrize("name", ["sand_mask", "and_mask"])
def test_mask_statistics_are_host_floats_equal_to_the_reference_masks(name):
    # the statistics come back from the device in one copy for all modules: floats, each module's own
    mods = modules(N=4, seed=3)
    for m in mods:
        m.gA.mul_(0.1)
        m.gA[:, 0] = m.gA[:, 0].abs()
    if name == "sand_mask":
        method, reference = get_method(name, tau=0.3, k=0.05), lambda g: sand_mask_reference(g, 0.3, 0.05, 1.0, True)
    else:
        method, reference = get_method(name, threshold=0.6), lambda g: and_mask_reference(g, 0.6, True)
    updates = method.combine(mods, 0)
    means = []
    for m, u in zip(mods, updates):
        assert all(type(v) is float for v in u.stats.values()), u.stats
        mean, below = _masks_statistics([reference(m.gA.numpy())[1], reference(m.gB.numpy())[1]])
        np.testing.assert_allclose(u.stats["mask_mean"], mean, rtol=1e-6)
        np.testing.assert_allclose(u.stats["mask_frac_below_half"], below, rtol=1e-6)
        means.append(mean)
    assert len(set(np.round(means, 6))) > 1  # modules differ, so a shared or shifted figure would fail


@covers("pcgrad")
def test_pcgrad_equals_pairwise_projection_loop():
    mods = modules(N=4, seed=4)
    vectors = flat_domain_vectors(mods)
    # make conflicts certain
    for m in mods:
        m.gA[1] = -m.gA[0] + 0.1 * m.gA[1]
    vectors = flat_domain_vectors(mods)
    method = get_method("pcgrad", seed=5)
    step = 3
    got = flat_update(method.combine(mods, step))
    # replay the method's random orders for the reference
    gen = torch.Generator().manual_seed((5 * 1_000_003 + step) % (2**63 - 1))
    orders = [[j for j in torch.randperm(4, generator=gen).tolist() if j != i] for i in range(4)]
    np.testing.assert_allclose(got, pcgrad_reference(vectors, orders), rtol=1e-9, atol=1e-12)


def test_pcgrad_weights_without_conflict_is_the_mean():
    gram = torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(pcgrad_weights(gram, torch.Generator().manual_seed(0)), torch.full((3,), 1 / 3, dtype=torch.float64))


@covers("pareto")
def test_mgda_two_domains_closed_form():
    mods = modules(N=2, seed=6)
    v = flat_domain_vectors(mods)
    g1, g2 = v[0], v[1]
    alpha = np.clip(((g2 - g1) @ g2) / ((g1 - g2) @ (g1 - g2)), 0.0, 1.0)
    expected = alpha * g1 + (1 - alpha) * g2
    np.testing.assert_allclose(flat_update(get_method("pareto").combine(mods, 0)), expected, rtol=1e-8, atol=1e-10)


def test_min_norm_weights_satisfy_kkt_for_many_domains():
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(5, 7)) + 0.5
    gram = torch.tensor(vecs @ vecs.T)
    w = min_norm_weights(gram, max_iter=5000).numpy()
    assert abs(w.sum() - 1) < 1e-12 and (w >= -1e-15).all()
    value = w @ gram.numpy() @ w
    # optimality on the simplex: every vertex direction is no better (to Frank-Wolfe accuracy)
    assert (gram.numpy() @ w >= value - 1e-4).all()
    # and no random simplex point beats it
    for _ in range(2000):
        p = rng.dirichlet(np.ones(5))
        assert p @ gram.numpy() @ p >= value - 1e-6


def _losses_and_scale():
    torch.manual_seed(0)
    logits = torch.randn(8, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (8,))
    domain_ids = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    return logits, labels, domain_ids


@covers("erm")
def test_erm_objective_is_the_mean_and_takes_the_plain_path():
    logits, labels, domains = _losses_and_scale()
    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    method = get_method("erm")
    assert method.scope == "loss" and not method.needs_domain_gradients
    assert method.objective(losses, domains, 3).item() == pytest.approx(float(np.mean(losses.numpy())))


@covers("erm_captured")
def test_captured_erm_is_the_mean_over_all_instances():
    # equal instances per domain (an isomer batch): the mean of per-domain mean gradients is
    # the gradient of the mean loss over all instances, computed directly here
    torch.manual_seed(1)
    A, B = torch.randn(2, 5, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    x, domains = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    A.requires_grad_(True)
    B.requires_grad_(True)
    losses = ((x @ A.T @ B.T) ** 2).sum(dim=1)
    gA_all, gB_all = torch.autograd.grad(losses.mean(), (A, B), retain_graph=True)
    per_domain = [torch.autograd.grad(losses[domains == d].mean(), (A, B), retain_graph=True) for d in range(3)]
    grads = ModuleGrads("m", 0, A.detach(), B.detach(), torch.stack([g[0] for g in per_domain]),
                        torch.stack([g[1] for g in per_domain]), 1.0)
    (update,) = get_method("erm_captured").combine([grads], step=1)
    torch.testing.assert_close(update.gA, gA_all, rtol=1e-12, atol=0)
    torch.testing.assert_close(update.gB, gB_all, rtol=1e-12, atol=0)
    spread = np.sqrt(sum(float((g[0] - gA_all).pow(2).sum() + (g[1] - gB_all).pow(2).sum()) for g in per_domain)
                     / 3 / float(gA_all.pow(2).sum() + gB_all.pow(2).sum()))
    assert update.stats["domain_spread"] == pytest.approx(spread, rel=1e-12)
    assert get_method("erm_captured").needs_domain_gradients


@covers("vrex")
def test_vrex_objective_direct_formula():
    logits, labels, domains = _losses_and_scale()
    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    risks = [losses[domains == d].mean().item() for d in range(3)]
    expected = losses.mean().item() + 2.0 * np.var(risks)
    assert get_method("vrex", penalty_weight=2.0).objective(losses, domains, 3).item() == pytest.approx(expected)


@covers("irm")
def test_irm_penalty_against_finite_differences():
    logits, labels, domains = _losses_and_scale()
    scale = torch.ones((), dtype=torch.float64, requires_grad=True)
    losses = torch.nn.functional.cross_entropy(logits * scale, labels, reduction="none")
    method = get_method("irm", penalty_weight=3.0)
    assert method.needs_dummy_scale()
    got = method.objective(losses, domains, 3, scale).item()

    def risk(d, w):
        sel = domains == d
        return torch.nn.functional.cross_entropy(logits[sel] * w, labels[sel]).item()

    h = 1e-6
    penalty = sum(((risk(d, 1 + h) - risk(d, 1 - h)) / (2 * h)) ** 2 for d in range(3))
    assert got == pytest.approx(losses.mean().item() + 3.0 * penalty, rel=1e-7)
    # the penalty is differentiable (it must reach the LoRA weights)
    with pytest.raises(ValueError, match="dummy_scale"):
        method.objective(losses, domains, 3, None)


def test_every_registered_method_has_a_reference_test():
    assert set(available_methods()) == TESTED


def test_unknown_method_and_parameter_are_clear():
    from iga_ds.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown method 'igaa'"):
        get_method("igaa")
    with pytest.raises(ConfigError, match="no parameter 'tua'"):
        get_method("iga", tua=1.0)


@pytest.mark.parametrize("name", [n for n in available_methods() if get_method(n).scope != "loss"])
def test_methods_report_the_statistics_they_declare(name):
    """The hook carries a module-scope method's statistics back from owner ranks in slots made
    from its declaration; a figure it reports but does not declare would be lost on the way.
    Global methods report figures of the whole model (a name pattern such as weight_<n>)."""
    import re

    method = get_method(name)
    assert method.statistics, f"{name} declares no statistics"
    patterns = [re.escape(s.name).replace(re.escape("<n>"), r"\d+") for s in method.statistics]
    reported = set().union(*(u.stats for u in method.combine(modules(), step=1)))
    if method.scope == "module":
        assert all(s.combine != "model" for s in method.statistics)
        essential = {s.name for s in method.statistics} - {"energy_kept", "mask_min", "gir"}
        assert essential <= reported, f"{name} declares {essential - reported} and never reports it"
    else:
        assert all(s.combine == "model" for s in method.statistics)
    stray = [k for k in reported if not any(re.fullmatch(p, k) for p in patterns)]
    assert not stray, f"{name} reports undeclared statistics {stray}"
