"""IGA's default projection, the pseudo-inverse of the reconstruction ("tangent"), against slow
references in float64: a dense least-squares solve, explicit tangent-space projectors, and
autograd's ERM gradient of a real PEFT model."""
from __future__ import annotations

import inspect

import pytest
import torch

from iga_ds.methods import ModuleGrads, get_method
from iga_ds.methods.iga import IGA, IGASVD, IGAOptions, MeanNoMask, batched_iga, iga_update
from iga_ds.methods.iga.method import MaskedProjectionMethod
from iga_ds.methods.iga.options import OPTION_DEFAULTS, OPTION_NAMES
from iga_ds.methods.iga.reference import masked_projection, reconstruct, tangent_factors
from iga_ds.lora.modules import find_lora_modules
from tiny_models import batch, tiny_peft_llama

F64 = torch.float64


def dense_solution(A, B, G, s, damping):
    """The ridge least-squares solution by brute force: the reconstruction as an explicit matrix
    over all r*in + out*r factor entries, then pinv (damping 0) or the normal equations."""
    r, d_in = A.shape
    d_out = B.shape[0]
    columns = []
    for i in range(r * d_in):
        a = torch.zeros(r * d_in, dtype=F64)
        a[i] = 1
        columns.append(reconstruct(A, B, a.view(r, d_in), torch.zeros(d_out, r, dtype=F64), s).reshape(-1))
    for i in range(d_out * r):
        b = torch.zeros(d_out * r, dtype=F64)
        b[i] = 1
        columns.append(reconstruct(A, B, torch.zeros(r, d_in, dtype=F64), b.view(d_out, r), s).reshape(-1))
    R = torch.stack(columns, 1)
    lam = damping * s * s * ((A @ A.T).trace() + (B.T @ B).trace()) / r
    if damping == 0:
        x = torch.linalg.pinv(R) @ G.reshape(-1)
    else:
        x = torch.linalg.solve(R.T @ R + lam * torch.eye(R.shape[1], dtype=F64), R.T @ G.reshape(-1))
    return x[: r * d_in].view(r, d_in), x[r * d_in:].view(d_out, r)


def factors(seed, r=3, d_in=7, d_out=5, b_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(r, d_in, generator=g, dtype=F64)
    B = torch.randn(d_out, r, generator=g, dtype=F64) * b_scale
    return A, B, torch.randn(d_out, d_in, generator=g, dtype=F64), g


@pytest.mark.parametrize("damping", [0.0, 0.1, 3.0])
@pytest.mark.parametrize("b_scale", [1.0, 1e-3, 0.0])
def test_tangent_factors_solve_the_least_squares_problem(damping, b_scale):
    A, B, G, _ = factors(1, b_scale=b_scale)
    gA, gB = tangent_factors(A, B, G, 2.0, damping)
    rA, rB = dense_solution(A, B, G, 2.0, damping)
    scale = max(rA.abs().max(), rB.abs().max())
    assert (gA - rA).abs().max() <= 1e-10 * scale and (gB - rB).abs().max() <= 1e-10 * scale


def test_tangent_factors_batch_over_modules_with_their_own_scaling():
    mods = [factors(i) for i in range(3)]
    A, B, G = (torch.stack([m[k] for m in mods]) for k in range(3))
    s = torch.tensor([0.5, 2.0, 4.0], dtype=F64).view(3, 1, 1)
    gA, gB = tangent_factors(A, B, G, s, 0.1)
    for i in range(3):
        rA, rB = dense_solution(A[i], B[i], G[i], float(s[i]), 0.1)
        torch.testing.assert_close(gA[i], rA, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gB[i], rB, rtol=1e-10, atol=1e-12)


def test_undamped_reconstruction_is_the_projection_onto_the_tangent_space():
    A, B, G, _ = factors(2)
    P_B = B @ torch.linalg.pinv(B)  # onto B's columns
    P_A = torch.linalg.pinv(A) @ A  # onto A's rows
    tangent = P_B @ G + G @ P_A - P_B @ G @ P_A
    torch.testing.assert_close(reconstruct(A, B, *tangent_factors(A, B, G, 1.5), 1.5), tangent, rtol=1e-10, atol=1e-12)


def test_pseudo_inverse_returns_gradients_of_a_weight_gradient():
    # LoRA's own gradients are the chain rule of a weight gradient: gA = s B^T gW, gB = s gW A^T
    A, B, gW, _ = factors(3, r=4, d_in=9, d_out=6)
    s = 2.0
    gA, gB = s * B.T @ gW, s * gW @ A.T
    got = tangent_factors(A, B, reconstruct(A, B, gA, gB, s), s)
    torch.testing.assert_close(got[0], gA, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], gB, rtol=1e-10, atol=1e-12)


def per_domain_gradients(model, num_domains=3):
    """Each domain's mean-loss LoRA gradients, by autograd in float64, and ERM's (the mean loss
    over all sequences: every domain holds as many)."""
    ids, attention, labels, domains = batch(seed=5, B=9, num_domains=num_domains)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    targets, mask = labels[:, 1:], labels[:, 1:] != -100
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.clamp_min(0).reshape(-1),
                                           reduction="none").view(targets.shape)
    losses = (ce * mask).sum(1) / mask.sum(1)
    modules = find_lora_modules(model)
    lora = [p for m in modules for p in (m.lora_A.weight, m.lora_B.weight)]
    per_domain = [torch.autograd.grad(losses[domains == d].mean(), lora, retain_graph=True)
                  for d in range(num_domains)]
    erm = torch.autograd.grad(losses.mean(), lora)
    grads = [ModuleGrads(m.name, m.index, m.lora_A.weight.detach(), m.lora_B.weight.detach(),
                         torch.stack([per_domain[d][2 * i] for d in range(num_domains)]),
                         torch.stack([per_domain[d][2 * i + 1] for d in range(num_domains)]), m.scaling)
             for i, m in enumerate(modules)]
    return grads, erm


def float64_norms(model):
    """LLaMA's RMSNorm computes in float32 whatever the model's dtype, which rounds every
    gradient through it to float32: here it stays in float64."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = lambda x, m=module: m.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                             + m.variance_epsilon)
    return model


@pytest.fixture(scope="module")
def real_gradients():
    return per_domain_gradients(float64_norms(tiny_peft_llama(seed=0, dtype=F64)))


@pytest.mark.parametrize("normalize", ["snr", "mean", "none"])
def test_tau_zero_is_erm_on_a_real_model(real_gradients, normalize):
    grads, erm = real_gradients
    for path in ("reference", "batched"):
        updates = get_method("iga", tau=0.0, normalize=normalize, implementation=path).combine(grads, 0)
        for i, u in enumerate(updates):
            torch.testing.assert_close(u.gA, erm[2 * i], rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(u.gB, erm[2 * i + 1], rtol=1e-12, atol=1e-15)
    for u, m in zip(get_method("mean_no_mask").combine(grads, 0), grads):
        assert torch.equal(u.gA, m.gA.mean(0)) and torch.equal(u.gB, m.gB.mean(0))


def test_real_gradients_leave_nothing_outside_the_pseudo_inverse(real_gradients):
    # no gauge part: the undamped map sends each domain's reconstruction back to its gradients
    grads, _ = real_gradients
    for m in grads:
        gA, gB = tangent_factors(m.A, m.B, reconstruct(m.A, m.B, m.gA, m.gB, m.scaling), m.scaling)
        torch.testing.assert_close(gA, m.gA, rtol=1e-9, atol=1e-12 * float(m.gA.abs().max()))
        torch.testing.assert_close(gB, m.gB, rtol=1e-9, atol=1e-12 * float(m.gB.abs().max()))


def test_the_svd_maps_are_not_erm_at_tau_zero(real_gradients):
    # why they are ablations: truncation drops part of the rank-2r mean, the chain rule maps it again
    grads, erm = real_gradients
    for factors_map in ("split", "chain_rule"):
        updates = get_method("iga_svd", tau=0.0, factors=factors_map, svd="exact").combine(grads, 0)
        worst = max(float((u.gB - erm[2 * i + 1]).norm() / erm[2 * i + 1].norm()) for i, u in enumerate(updates))
        assert worst > 0.05, factors_map


@pytest.mark.parametrize("normalize", ["snr", "mean"])
@pytest.mark.parametrize("damping", [0.0, 0.1])
def test_batched_tangent_matches_the_reference(real_gradients, normalize, damping):
    grads, _ = real_gradients
    fused = batched_iga(grads, IGAOptions(tau=0.7, normalize=normalize, damping=damping), generators=[None] * len(grads))
    for m, (gA, gB, stats) in zip(grads, fused):
        rA, rB, rstats = iga_update(m.A, m.B, m.gA, m.gB, scaling=m.scaling, tau=0.7, normalize=normalize,
                                    damping=damping)
        torch.testing.assert_close(gA, rA, rtol=1e-9, atol=1e-12 * float(rA.abs().max()))
        torch.testing.assert_close(gB, rB, rtol=1e-9, atol=1e-12 * float(rB.abs().max()))
        for key in ("mask_mean", "mask_min", "energy_kept", "gir"):
            assert float(stats[key]) == pytest.approx(rstats[key], rel=1e-9), key


def test_the_mask_changes_the_update(real_gradients):
    grads, erm = real_gradients
    updates = get_method("iga", tau=2.0).combine(grads, 0)
    moved = [float((u.gB - erm[2 * i + 1]).norm() / erm[2 * i + 1].norm()) for i, u in enumerate(updates)]
    assert max(moved) > 1e-3


def test_one_default_per_option():
    # IGAOptions declares them; batched_iga and masked_projection take the object whole (only the
    # chain ablation's projection, outside the options, overrides), and the signatures that spell
    # options out (iga_update's keywords, the methods') repeat its defaults
    assert inspect.signature(batched_iga).parameters["options"].default == IGAOptions()
    for fn in (batched_iga, masked_projection):
        assert not set(inspect.signature(fn).parameters) & (set(OPTION_NAMES) - {"projection"}), fn
    assert inspect.signature(masked_projection).parameters["projection"].default is None
    sources = {"iga_update": iga_update, "IGA": IGA.__init__, "IGASVD": IGASVD.__init__,
               "MaskedProjectionMethod": MaskedProjectionMethod.__init__, "MeanNoMask": MeanNoMask.__init__}
    defaults: dict[str, dict] = {name: {"IGAOptions": OPTION_DEFAULTS[name]} for name in OPTION_NAMES}
    for where, fn in sources.items():
        for name, p in inspect.signature(fn).parameters.items():
            if name in OPTION_NAMES:
                defaults[name][where] = p.default
    for name in OPTION_NAMES:
        assert len(set(defaults[name].values())) == 1, (name, defaults[name])
    assert set(inspect.signature(iga_update).parameters) - set(OPTION_NAMES) == {"A", "B", "gA", "gB", "scaling",
                                                                                  "generator"}
    assert IGA.fixes["projection"] == defaults["projection"]["MeanNoMask"] == "tangent"
    assert IGASVD.fixes["projection"] == "svd" and defaults["factors"]["IGASVD"] == "chain_rule"


def test_each_method_runs_with_its_fixes_in_its_options():
    for name in ("iga", "iga_svd", "mean_no_mask", "iga_binary", "iga_no_projection", "iga_lora_space"):
        m = get_method(name)
        for option, value in m.fixes.items():
            if (option, value) != ("projection", "chain"):  # no option value: masked_projection's override
                assert getattr(m.options, option) == value, (name, option)
        assert all(getattr(m, k) == v for k, v in vars(m.options).items() if k not in m.fixes), name


def weight_gradient_modules(count=6, N=4, r=16, d_in=320, d_out=256, seed=0):
    """Modules whose per-domain factor gradients come from weight gradients, as a real LoRA's do."""
    g = torch.Generator().manual_seed(seed)
    mods = []
    for i in range(count):
        A = torch.randn(r, d_in, generator=g, dtype=F64) / d_in**0.5
        B = torch.randn(d_out, r, generator=g, dtype=F64) * 0.02
        gW = (0.7 * torch.randn(1, d_out, d_in, generator=g, dtype=F64)
              + torch.randn(N, d_out, d_in, generator=g, dtype=F64)) * 1e-3
        mods.append(ModuleGrads(f"m{i}", i, A, B, 2.0 * B.T @ gW, 2.0 * gW @ A.T, 2.0))
    return mods


def relative_error(got, ref):
    return float((got.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision,tolerance", [("ieee", 1e-4), ("tf32", 5e-3), ("bf16", 3e-2)])
def test_batched_tangent_on_cuda_matches_float64(precision, tolerance):
    mods = weight_gradient_modules()
    cuda = [ModuleGrads(m.name, m.index, *(t.float().cuda() for t in (m.A, m.B, m.gA, m.gB)), m.scaling) for m in mods]
    for tau in (0.0, 0.5):
        out = batched_iga(cuda, IGAOptions(tau=tau), generators=[None] * len(cuda), triton_precision=precision)
        for m, c, (gA, gB, _) in zip(mods, cuda, out):
            if tau == 0:  # ERM's mean, computed as ERM computes it
                assert torch.equal(gA, c.gA.mean(0)) and torch.equal(gB, c.gB.mean(0))
                continue
            rA, rB, _ = iga_update(m.A, m.B, m.gA, m.gB, scaling=m.scaling, tau=tau)
            assert relative_error(gA, rA) < tolerance and relative_error(gB, rB) < tolerance, precision
