"""IGA's ``variance`` option: each estimator against a float64 reference written here with plain
loops over domains and steps, ERM exactly at tau = 0, the state contract, and the refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from iga_ds.config.hook import HookConfig
from iga_ds.errors import ConfigError
from iga_ds.methods import GradientMethod, ModuleGrads, get_method
from iga_ds.methods.iga import iga_update
from iga_ds.methods.iga.sketch import sketch_key
from reference_impl import chain_rule_reference
from test_iga_tangent import dense_solution
from zero2_engine import engine  # noqa: F401  (a fixture: one ZeRO-2 engine of a tiny model, world size 1)

F64 = torch.float64
TAU = 0.8


# -- the reference, plainly -------------------------------------------------------------------


def recon(A, B, a, b, s):
    return s * (b @ A + B @ a)


def spread_reference(A, B, gA, gB, s):
    """(mean, population variance) over domains of the reconstructions, one domain at a time."""
    G = [recon(A, B, gA[n], gB[n], s) for n in range(len(gA))]
    mean = sum(G) / len(G)
    return mean, sum((g - mean) ** 2 for g in G) / len(G)


def mask_reference(var, mean, tau):
    """exp(-tau V') with the ``snr`` normalization (the default)."""
    sq = mean ** 2
    return np.exp(-tau * var / (sq + 1e-6 * sq.mean() + np.finfo(np.float64).tiny))


def factors_reference(A, B, gA_mean, gB_mean, mean, mask, s, projection):
    """``svd`` (exact, rank r, chain rule): the truncation of mean * mask mapped by the chain rule;
    ``tangent``: ERM's mean plus the dense least-squares solution for what the mask removed."""
    if projection == "svd":
        U, S, Vt = np.linalg.svd(mean * mask, full_matrices=False)
        r = A.shape[0]
        return chain_rule_reference((U[:, :r] * S[:r]) @ Vt[:r], A, B, s)
    dA, dB = dense_solution(*(torch.from_numpy(t) for t in (A, B, mean * (mask - 1))), s, 0.1)
    return gA_mean + dA.numpy(), gB_mean + dB.numpy()


def ema_reference(steps, beta, tau, projection):
    """Per step: the moving average of each domain's factor gradients, bias-corrected, its
    reconstructions' variance at this step's A, B for the mask, this step's mean masked."""
    out, avg_A, avg_B = [], None, None
    for t, (A, B, gA, gB, s) in enumerate(steps, start=1):
        if avg_A is None:
            avg_A, avg_B = [np.zeros_like(a) for a in gA], [np.zeros_like(b) for b in gB]
        for n in range(len(gA)):
            avg_A[n] = beta * avg_A[n] + (1 - beta) * gA[n]
            avg_B[n] = beta * avg_B[n] + (1 - beta) * gB[n]
        hat_A = [a / (1 - beta ** t) for a in avg_A]
        hat_B = [b / (1 - beta ** t) for b in avg_B]
        averaged_mean, averaged_var = spread_reference(A, B, hat_A, hat_B, s)
        mean, _ = spread_reference(A, B, gA, gB, s)
        mask = mask_reference(averaged_var, averaged_mean, tau)
        out.append((factors_reference(A, B, gA.mean(0), gB.mean(0), mean, mask, s, projection), averaged_var))
    return out


def debiased_reference(A, B, gA, gB, s, tau, projection):
    """gA, gB: 2N per-(domain, half) means, halves at n and N + n."""
    N = len(gA) // 2
    dom_A = [(gA[n] + gA[N + n]) / 2 for n in range(N)]
    dom_B = [(gB[n] + gB[N + n]) / 2 for n in range(N)]
    mean, var = spread_reference(A, B, dom_A, dom_B, s)
    noise = sum(recon(A, B, gA[n] - gA[N + n], gB[n] - gB[N + n], s) ** 2 / 4 for n in range(N)) / N
    debiased = np.maximum(0.0, var - (N - 1) / N * noise)
    mask = mask_reference(debiased, mean, tau)
    return factors_reference(A, B, sum(dom_A) / N, sum(dom_B) / N, mean, mask, s, projection), debiased


# -- inputs ---------------------------------------------------------------------------------


def module(seed, slots=3, index=0, r=2, d_in=5, d_out=4):
    g = torch.Generator().manual_seed(seed)
    return ModuleGrads(f"m{index}", index, torch.randn(r, d_in, generator=g, dtype=F64) * 0.5,
                       torch.randn(d_out, r, generator=g, dtype=F64) * 0.5,
                       torch.randn(slots, r, d_in, generator=g, dtype=F64),
                       torch.randn(slots, d_out, r, generator=g, dtype=F64), 2.0)


def as_numpy(m: ModuleGrads):
    return m.A.numpy(), m.B.numpy(), m.gA.numpy(), m.gB.numpy(), m.scaling


PROJECTIONS = {"tangent": {}, "svd": {"projection": "svd", "svd": "exact"}}  # the reference's options
METHOD_OF = {"tangent": "iga", "svd": "iga_svd"}  # the registered method of each (iga_svd fixes its projection)


def method_options(projection: str) -> dict:
    return {k: v for k, v in PROJECTIONS[projection].items() if k != "projection"}


# -- batch: the paper, unchanged -----------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"normalize": "mean", "tau": 0.3},
                                     {"projection": "svd", "power_iters": 1, "factors": "split"}])
def test_batch_is_todays_iga_update_bit_for_bit(options):
    for given in ({}, {"variance": "batch"}):
        own = {k: v for k, v in options.items() if k != "projection"}  # iga_svd fixes it
        method = get_method("iga_svd" if options.get("projection") == "svd" else "iga", seed=5, **own, **given)
        for i in range(3):
            m = module(i, index=i)
            got = method.combine([m], step=4)[0]
            gen = sketch_key(5, 4, i) if options.get("projection") == "svd" else None
            gA, gB, stats = iga_update(m.A, m.B, m.gA, m.gB, scaling=m.scaling, generator=gen, **options)
            assert torch.equal(got.gA, gA) and torch.equal(got.gB, gB) and got.stats == stats


# -- ema ------------------------------------------------------------------------------------


@pytest.mark.parametrize("projection", list(PROJECTIONS))
def test_ema_over_steps_equals_the_plain_recomputation(projection):
    beta = 0.7
    method = get_method(METHOD_OF[projection], tau=TAU, variance="ema", variance_decay=beta, **method_options(projection))
    # two modules, their factors and gradients new at every step, the second combined first
    steps = {index: [module(10 * t + index, index=index) for t in range(4)] for index in (0, 1)}
    expected = {index: ema_reference([as_numpy(m) for m in mods], beta, TAU, projection)
                for index, mods in steps.items()}
    for t in range(4):
        updates = method.combine([steps[1][t], steps[0][t]], step=t)
        for index, u in zip((1, 0), updates):
            (rA, rB), var = expected[index][t]
            np.testing.assert_allclose(u.gA.numpy(), rA, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(u.gB.numpy(), rB, rtol=1e-9, atol=1e-12)
            assert u.stats["gir"] == pytest.approx(var.sum(), rel=1e-12)  # the V the mask used
    assert set(method.state_dict()) == {f"{i}.ema_{k}" for i in (0, 1) for k in ("gA", "gB", "steps")}


def test_ema_at_decay_zero_is_batch_and_its_state_round_trips():
    ema, batch = get_method("iga", variance="ema", variance_decay=0.0), get_method("iga")
    for t in range(2):
        m = module(t)
        a, b = ema.combine([m], t)[0], batch.combine([m], t)[0]
        assert torch.equal(a.gA, b.gA) and torch.equal(a.gB, b.gB)
    # a copy loaded from the state continues exactly as the original
    first, copy = get_method("iga", variance="ema"), get_method("iga", variance="ema")
    first.combine([module(0)], 0)
    copy.load_state_dict({k: v.clone() for k, v in first.state_dict().items()})
    a, b = first.combine([module(1)], 1)[0], copy.combine([module(1)], 1)[0]
    assert torch.equal(a.gA, b.gA) and torch.equal(a.gB, b.gB)
    with pytest.raises(ValueError, match="unexpected key 'x'"):
        copy.load_state_dict({"x": torch.zeros(1)})


def test_ema_skips_a_non_finite_step():
    method = get_method("iga", variance="ema")
    method.combine([module(0)], 0)
    before = {k: v.clone() for k, v in method.state_dict().items()}
    bad = module(1)
    bad.gA[0, 0, 0] = float("nan")
    method.combine([bad], 1)
    after = method.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- debiased -------------------------------------------------------------------------------


@pytest.mark.parametrize("projection", list(PROJECTIONS))
def test_debiased_equals_the_plain_recomputation(projection):
    method = get_method(METHOD_OF[projection], tau=TAU, variance="debiased", **method_options(projection))
    assert method.domain_halves
    for i in range(3):
        m = module(i, slots=6, index=i)
        u = method.combine([m], step=0)[0]
        (rA, rB), var = debiased_reference(*as_numpy(m), TAU, projection)
        np.testing.assert_allclose(u.gA.numpy(), rA, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(u.gB.numpy(), rB, rtol=1e-9, atol=1e-12)
        assert u.stats["gir"] == pytest.approx(var.sum(), rel=1e-12, abs=1e-15)


def shared_signal_modules(count, spread, noise, N=4, r=4, d_in=40, d_out=30, seed=0):
    """Per-(domain, half) means: one signal for every domain (plus ``spread`` times a signal of
    each domain's own), and noise of each half's own."""
    g = torch.Generator().manual_seed(seed)
    mods = []
    for i in range(count):
        A = torch.randn(r, d_in, generator=g, dtype=F64) / d_in ** 0.5
        B = torch.randn(d_out, r, generator=g, dtype=F64) * 0.3
        sA = torch.randn(r, d_in, generator=g, dtype=F64) + spread * torch.randn(N, r, d_in, generator=g, dtype=F64)
        sB = torch.randn(d_out, r, generator=g, dtype=F64) + spread * torch.randn(N, d_out, r, generator=g, dtype=F64)
        gA = sA.repeat(2, 1, 1) + noise * torch.randn(2 * N, r, d_in, generator=g, dtype=F64)
        gB = sB.repeat(2, 1, 1) + noise * torch.randn(2 * N, d_out, r, generator=g, dtype=F64)
        mods.append(ModuleGrads(f"m{i}", i, A, B, gA, gB, 2.0))
    return mods


def mean_masks(mods):
    """(batch's, debiased's) mean mask over the modules, batch given the domains' means."""
    N = mods[0].gA.shape[0] // 2
    halves = [ModuleGrads(m.name, m.index, m.A, m.B, (m.gA[:N] + m.gA[N:]) / 2, (m.gB[:N] + m.gB[N:]) / 2,
                          m.scaling) for m in mods]
    batch = get_method("iga").combine(halves, 0)
    debiased = get_method("iga", variance="debiased").combine(mods, 0)
    return (float(np.mean([u.stats["mask_mean"] for u in batch])),
            float(np.mean([u.stats["mask_mean"] for u in debiased])))


def test_debiased_gives_a_mask_near_one_where_domains_share_one_signal():
    batch, debiased = mean_masks(shared_signal_modules(6, spread=0.0, noise=0.5))
    assert batch < 0.72 and debiased > 0.8, (batch, debiased)  # batch masks noise; debiased much less
    # domains that do disagree are still masked: debiased is no mask of one whatever the input
    batch, debiased = mean_masks(shared_signal_modules(6, spread=2.0, noise=0.05))
    assert debiased < 0.6 and abs(debiased - batch) < 0.05, (batch, debiased)


def test_debiased_variance_is_unbiased_before_the_clamp():
    """Over many draws, V less the halves' noise estimate averages to the signals' own spread
    (zero here): the expectation the estimator is built on, checked on the reference."""
    g = torch.Generator().manual_seed(1)
    N, draws, raw, corrected = 4, 400, 0.0, 0.0
    A, B = torch.randn(2, 6, generator=g, dtype=F64).numpy(), torch.randn(5, 2, generator=g, dtype=F64).numpy()
    for _ in range(draws):
        gA, gB = torch.randn(2 * N, 2, 6, generator=g, dtype=F64).numpy(), torch.randn(2 * N, 5, 2, generator=g,
                                                                                       dtype=F64).numpy()
        dom_A, dom_B = [(gA[n] + gA[N + n]) / 2 for n in range(N)], [(gB[n] + gB[N + n]) / 2 for n in range(N)]
        _, var = spread_reference(A, B, dom_A, dom_B, 1.0)
        noise = sum(recon(A, B, gA[n] - gA[N + n], gB[n] - gB[N + n], 1.0) ** 2 / 4 for n in range(N)) / N
        raw += var.mean() / draws
        corrected += (var - (N - 1) / N * noise).mean() / draws
    assert abs(corrected) < 0.1 * raw, (raw, corrected)


def test_debiased_refuses_what_is_not_two_halves():
    with pytest.raises(ValueError, match="needs 2N per-.domain, half. gradients"):
        get_method("iga", variance="debiased").combine([module(0, slots=3)], 0)


# -- tau = 0 is ERM, exactly ------------------------------------------------------------------


@pytest.mark.parametrize("variance", ["batch", "ema", "debiased"])
def test_tau_zero_is_erm_exactly(variance):
    method = get_method("iga", tau=0.0, variance=variance)
    for t in range(2):  # ema: a second step with averages behind it
        m = module(t, slots=6 if variance == "debiased" else 3)
        u = method.combine([m], t)[0]
        if variance == "debiased":  # ERM's mean over all sequences: the halves' means averaged (equal halves)
            N = 3
            erm_A, erm_B = ((m.gA[:N] + m.gA[N:]) / 2).mean(0), ((m.gB[:N] + m.gB[N:]) / 2).mean(0)
            torch.testing.assert_close(erm_A, m.gA.mean(0), rtol=1e-14, atol=0)
        else:
            erm_A, erm_B = m.gA.mean(0), m.gB.mean(0)
        assert torch.equal(u.gA, erm_A) and torch.equal(u.gB, erm_B)


# -- options --------------------------------------------------------------------------------


@pytest.mark.parametrize("params,message", [
    ({"variance": "foo"}, r"variance must be one of \('batch', 'ema', 'debiased'\), got 'foo'"),
    ({"variance": "ema", "variance_decay": 1.5}, r"variance_decay must be in \[0, 1\), got 1.5"),
    ({"variance": "ema", "variance_decay": -0.1}, r"variance_decay must be in \[0, 1\)"),
    ({"variance_decay": 0.5}, r"variance_decay=0.5: acts only with variance 'ema', and variance is 'batch'"),
    ({"variance": "debiased", "variance_decay": 0.5}, r"variance_decay=0.5: acts only with variance 'ema'"),
    ({"variance": "debiased", "normalize": "mean", "implementation": "batched"},
     r"implementation 'batched' has no form of variance 'debiased' with normalize 'mean'"),
])
def test_invalid_variance_options_are_refused_in_one_line(params, message):
    with pytest.raises(ValueError, match=message):
        get_method("iga", **params)
    with pytest.raises(ConfigError) as err:  # as a config gives them
        HookConfig(method="iga", params=params, domains=["a", "b"]).validate()
    assert "\n" not in str(err.value) and "iga.params" in str(err.value), str(err.value)


def test_the_lora_space_ablation_takes_batch_only():
    with pytest.raises(ValueError, match="iga_lora_space takes variance 'batch' only"):
        get_method("iga_lora_space", variance="ema")


def test_auto_takes_the_fused_path_on_cuda_where_the_variance_has_a_fused_form():
    on_cpu = [module(0)]
    assert not get_method("iga", variance="ema")._batched(on_cpu)
    if torch.cuda.is_available():
        cuda = [ModuleGrads("m", 0, *(t.cuda() for t in (m.A, m.B, m.gA, m.gB)), m.scaling) for m in on_cpu]
        for params in ({}, {"variance": "ema"}, {"variance": "debiased"}):
            assert get_method("iga", **params)._batched(cuda), params
        assert not get_method("iga", variance="debiased", normalize="mean")._batched(cuda)


# -- the batched path against the reference path -------------------------------------------------


def mixed_modules(step, slots, dtype=F64):
    """Four modules of two shapes (two stacks), new factors and gradients at every step."""
    shapes = [(2, 5, 4), (3, 6, 7), (2, 5, 4), (3, 6, 7)]
    out = []
    for index, (r, d_in, d_out) in enumerate(shapes):
        m = module(100 * step + index, slots=slots, index=index, r=r, d_in=d_in, d_out=d_out)
        out.append(ModuleGrads(m.name, index, *(t.to(dtype) for t in (m.A, m.B, m.gA, m.gB)), 1.0 + 0.5 * index))
    return out


FUSED_CASES = [("ema", "snr", "tangent"), ("ema", "mean", "tangent"), ("ema", "none", "svd"),
               ("ema", "snr", "svd"), ("debiased", "snr", "tangent"), ("debiased", "none", "svd")]


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("variance,normalize,projection", FUSED_CASES)
def test_the_fused_path_equals_the_reference_path_over_steps(variance, normalize, projection, dtype):
    params = dict(tau=TAU, normalize=normalize, variance=variance, seed=3,
                  **({"svd": "randomized", "power_iters": 2} if projection == "svd" else {}))
    name = "iga_svd" if projection == "svd" else "iga"
    ref, fused = (get_method(name, implementation=impl, **params) for impl in ("reference", "batched"))
    tol = 1e-9 if dtype == F64 else 2e-4
    slots = 6 if variance == "debiased" else 3
    for step in range(3):  # ema: averages behind the later steps
        mods = mixed_modules(step, slots, dtype)
        for a, b in zip(fused.combine(mods, step), ref.combine(mods, step)):
            for got, want in ((a.gA, b.gA), (a.gB, b.gB)):
                assert float((got.double() - want.double()).norm() / want.double().norm()) < tol
            for key in ("mask_mean", "mask_min", "gir", "energy_kept"):
                assert float(a.stats[key]) == pytest.approx(float(b.stats[key]), rel=tol, abs=1e-12), key
    if variance == "ema":  # the same state, whichever path kept it
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(fused.state_dict()[key], value, rtol=1e-12, atol=0)


def test_the_fused_debiased_variance_is_clamped_and_summed_as_the_reference_sums_it():
    """Shared-signal halves: much of the raw debiased V is negative, so the clamp and the tile-summed
    gir are what the comparison exercises."""
    mods = shared_signal_modules(3, spread=0.0, noise=0.5, d_in=12, d_out=9)
    ref = get_method("iga", variance="debiased", implementation="reference").combine(mods, 0)
    got = get_method("iga", variance="debiased", implementation="batched").combine(mods, 0)
    for a, b in zip(got, ref):
        assert float(a.stats["gir"]) == pytest.approx(b.stats["gir"], rel=1e-9)
        assert float(a.stats["mask_mean"]) == pytest.approx(b.stats["mask_mean"], rel=1e-9)
        torch.testing.assert_close(a.gA, b.gA, rtol=1e-9, atol=1e-12)


def test_the_state_contract_defaults_to_none():
    plain = GradientMethod()
    assert plain.state_dict() == {} and not plain.domain_halves
    plain.load_state_dict({})
    assert get_method("iga").state_dict() == {} and get_method("iga", variance="debiased").state_dict() == {}
    with pytest.raises(ValueError, match="keeps no state"):
        get_method("iga").load_state_dict({"0.ema_gA": torch.zeros(1)})


# -- through the engine hook ------------------------------------------------------------------


def test_the_hook_captures_two_halves_and_refuses_what_is_not_two(engine):  # noqa: F811
    from iga_ds.engine import attach

    hook = attach(engine, HookConfig(method="iga", params={"variance": "debiased"}, domains=["a", "b", "c"]))
    try:
        assert hook.num_slots == 6 and hook.capture.counts.numel() == 6 and hook.buffers[0][0].shape[0] == 6
        ids = torch.tensor([0, 1, 2])
        with pytest.raises(ValueError, match=r"pass micro_batch\(domain_ids, halves=\.\.\.\)"):
            with hook.micro_batch(ids):
                pass
        with pytest.raises(ValueError, match="halves: expected a 0 or 1 for each of the 3 sequences, got"):
            with hook.micro_batch(ids, halves=[0, 2, 0]):
                pass
        with pytest.raises(ValueError, match=r"domain ids must be in \[0, 3\)"):
            with hook.micro_batch(torch.tensor([0, 1, 3]), halves=[0, 0, 0]):
                pass
        assert hook._capture_slots(ids, torch.tensor([1, 0, 1])).tolist() == [3, 1, 5]
        with pytest.raises(RuntimeError, match=r"step 4: .*two equal, non-empty halves.*got a \(1 and 0\), "
                                               r"c \(2 and 1\)$"):
            hook._check_counts(torch.tensor([1.0, 1, 2, 0, 1, 1]), 4)
        hook._check_counts(torch.tensor([2.0] * 6), 4)
    finally:
        hook.detach()


def test_the_hook_hands_the_method_its_state_by_module(engine):  # noqa: F811
    from iga_ds.engine import attach

    hook = attach(engine, HookConfig(method="iga", params={"variance": "ema"}, domains=["a", "b", "c"]))
    try:
        state = {"1.ema_gA": torch.ones(3, 2, 2), "1.ema_gB": torch.ones(3, 2, 2),
                 "1.ema_steps": torch.tensor(4)}
        hook.load_method_state(state)
        assert hook.method_state().keys() == state.keys()  # one rank owns every module
        for bad, message in (("x.ema_gA", "key 'x.ema_gA' names no module"),
                             (f"{len(hook.modules)}.ema_gA", "names no module")):
            with pytest.raises(ValueError, match=message):
                hook.load_method_state({bad: torch.zeros(1)})
    finally:
        hook.detach()
    plain = attach(engine, HookConfig(method="iga", domains=["a", "b", "c"]))
    try:
        assert plain.method_state() == {} and plain.num_slots == 3
    finally:
        plain.detach()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variance", ["ema", "debiased"])
def test_the_cuda_batched_path_equals_the_reference_path(variance):
    params = dict(tau=TAU, variance=variance)
    ref, auto = get_method("iga", implementation="reference", **params), get_method("iga", **params)
    for step in range(3):
        mods = [ModuleGrads(m.name, m.index, *(t.float().cuda() for t in (m.A, m.B, m.gA, m.gB)), m.scaling)
                for m in mixed_modules(step, 6 if variance == "debiased" else 3)]
        assert auto._batched(mods)
        for a, b in zip(auto.combine(mods, step), ref.combine(mods, step)):
            torch.testing.assert_close(a.gA, b.gA, rtol=2e-4, atol=1e-6)
            torch.testing.assert_close(a.gB, b.gB, rtol=2e-4, atol=1e-6)


def test_the_departures_compute_in_float32_in_a_bf16_run():
    m = module(0)
    trained_in_bf16 = [ModuleGrads("m", 0, m.A.float(), m.B.float(), m.gA.float(), m.gB.float(), 2.0, torch.bfloat16)]
    assert get_method("iga").precision_for(trained_in_bf16) == "bf16"
    for variance in ("ema", "debiased"):
        assert get_method("iga", variance=variance).precision_for(trained_in_bf16) == "ieee"
