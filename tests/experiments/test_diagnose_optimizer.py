"""`iga-ds diagnose`'s update after the optimizer: one AdamW or SGD-momentum step from saved moments.

The update is checked against torch's own optimizers stepped once, in float64, from the same
state on the same gradients (clipped by torch's clip_grad_norm_), the parameter change divided
by -lr; the update shares against ERM's and against a hand-computed cosine; the reading of an
optimizer state file and its one-line refusals.
"""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from iga_ds.errors import UserError
from iga_ds.experiments import diagnose as dg
from iga_ds.experiments import preconditioning as pc
from iga_ds.methods import ModuleGrads

LR = 1e-2
SHAPES = [((2, 5), (3, 2)), ((4, 3), (3, 4))]  # two modules' (A, B)
NAMES = [(f"m{i}.lora_A.weight", f"m{i}.lora_B.weight") for i in range(len(SHAPES))]


def _rand(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _gradients(seed, scale):
    g = torch.Generator().manual_seed(seed)
    return [(_rand(g, *a, scale=scale), _rand(g, *b, scale=scale)) for a, b in SHAPES]


def _state(kind, seed, saved, **settings):
    """An optimizer state over NAMES: random moments (saved) or none (zero moments)."""
    g = torch.Generator().manual_seed(seed)
    state = pc.OptimizerState(kind, **settings)
    if saved:
        state.source = "saved.safetensors"
        for (name_a, name_b), (a, b) in zip(NAMES, SHAPES):
            for name, shape in ((name_a, a), (name_b, b)):
                if kind == "adamw":
                    state.moments[name] = {"exp_avg": _rand(g, *shape, scale=0.1),
                                           "exp_avg_sq": _rand(g, *shape, scale=0.1) ** 2}
                else:
                    state.moments[name] = {"momentum_buffer": _rand(g, *shape, scale=0.1)}
    return state


def torch_step(state: pc.OptimizerState, grads) -> tuple[list[torch.Tensor], float]:
    """torch's optimizer, one step from ``state`` on ``grads`` clipped as training clips them:
    each parameter's change over -lr, and the clipping factor clip_grad_norm_ applied."""
    g = torch.Generator().manual_seed(99)
    flat = [x for pair in grads for x in pair]
    params = [torch.nn.Parameter(_rand(g, *x.shape)) for x in flat]
    names = [n for pair in NAMES for n in pair]
    if state.kind == "adamw":
        opt = torch.optim.AdamW(params, lr=LR, betas=state.betas, eps=state.eps, weight_decay=0.0, foreach=False)
    else:
        opt = torch.optim.SGD(params, lr=LR, momentum=state.momentum, weight_decay=0.0, foreach=False)
    for p, name in zip(params, names):
        if state.source:
            opt.state[p] = {k: v.clone() for k, v in state.moments[name].items()}
            if state.kind == "adamw":
                opt.state[p]["step"] = torch.tensor(float(state.step))
    for p, x in zip(params, flat):
        p.grad = x.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(params, state.clip)) if state.clip > 0 else 0.0
    before = [p.detach().clone() for p in params]
    opt.step()
    changes = [(p.detach() - b) / -LR for p, b in zip(params, before)]
    return changes, (min(1.0, state.clip / (norm + 1e-6)) if state.clip > 0 else 1.0)


# clip 100: above the gradients' norm, which it leaves alone; 0: off
@pytest.mark.parametrize("kind, saved, clip", [("adamw", True, 1.0), ("adamw", True, 0.0), ("adamw", True, 100.0),
                                               ("adamw", False, 1.0), ("sgd", True, 1.0), ("sgd", False, 0.0)])
def test_the_update_is_torchs_optimizer_step_over_minus_lr(kind, saved, clip):
    settings = {"step": 7, "betas": (0.8, 0.95), "eps": 1e-3} if kind == "adamw" else {"momentum": 0.7}
    state = _state(kind, seed=1, saved=saved, clip=clip, **(settings if saved or kind == "sgd" else {}))
    grads = _gradients(seed=2, scale=3.0)  # a norm above 1: clipping engaged where it is on
    ours, scale = pc.optimizer_updates(state, NAMES, grads)
    want, torch_scale = torch_step(state, grads)
    assert scale == pytest.approx(torch_scale, rel=1e-12)
    assert (scale < 1) == (clip == 1.0)
    for got, expected in zip([x for pair in ours for x in pair], want):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    if kind == "adamw" and not saved:  # the first step: m_hat = g, v_hat = g^2, so u = g / (|g| + eps)
        g = grads[0][0] * scale
        torch.testing.assert_close(ours[0][0], g / (g.abs() + state.eps), rtol=1e-12, atol=0)


def _modules(seed):
    """One module's cue and no-cue per-domain gradients (3 domains) under NAMES[0]'s shapes."""
    g = torch.Generator().manual_seed(seed)
    (a, b), n = SHAPES[0], 3
    A, B = _rand(g, *a), _rand(g, *b)
    plain = ModuleGrads("m0", 0, A, B, _rand(g, n, *a), _rand(g, n, *b), 0.5)
    cue = ModuleGrads("m0", 0, A, B, plain.gA + _rand(g, n, *a), plain.gB + _rand(g, n, *b), 0.5)
    return [cue], [plain]


def test_update_shares_of_erm_are_exactly_one_and_its_cosine_is_the_updates():
    cue, plain = _modules(3)
    state = _state("adamw", seed=4, saved=True, step=3)
    result = dg.measure(cue, plain, dg.build_methods(["sand_mask", "erm_captured"]),
                        precondition=lambda pairs: pc.optimizer_updates(state, NAMES[:1], pairs))
    after = result["after_optimizer"]
    for space in dg.SPACES:
        erm = after[space]["methods"]["erm"]
        assert (erm["task"], erm["cue"], erm["size"]) == (1.0, 1.0, 1.0)
        same = after[space]["methods"]["erm_captured"]
        assert (same["task"], same["cue"]) == pytest.approx((1.0, 1.0), rel=1e-12)
    # cos(u(U_erm), t) in the factor space, rebuilt here: the updates' block of the gram, not the gradients'
    t = torch.cat([plain[0].gA.mean(0).reshape(-1), plain[0].gB.mean(0).reshape(-1)])
    mean = (cue[0].gA.mean(0), cue[0].gB.mean(0))
    updates, _ = pc.optimizer_updates(state, NAMES[:1], [mean])
    ua, ub = updates[0]
    u = torch.cat([ua.reshape(-1), ub.reshape(-1)])
    cos = float(u @ t / (u.norm() * t.norm()))
    assert after["factor"]["methods"]["erm"]["cos_task"] == pytest.approx(cos, rel=1e-9)
    assert result["factor"]["methods"]["erm"]["cos_task"] != pytest.approx(cos, rel=1e-3)
    assert set(after["clip_scale"]) == {"erm", "sand_mask", "erm_captured"}
    assert set(result["modules"][0]["after_optimizer"]) == {"erm", "sand_mask", "erm_captured"}


def test_sgd_from_zero_momentum_without_clipping_keeps_what_the_gradient_keeps():
    cue, plain = _modules(5)
    state = pc.OptimizerState("sgd", clip=0.0)  # u = U: every update share is the gradient's
    result = dg.measure(cue, plain, dg.build_methods(["sand_mask", "iga:tau=0.5"]),
                        precondition=lambda pairs: pc.optimizer_updates(state, NAMES[:1], pairs))
    for space in dg.SPACES:
        for label, row in result[space]["methods"].items():
            after = result["after_optimizer"][space]["methods"][label]
            assert after == pytest.approx(row, rel=1e-12), (space, label)


# -- reading the state -------------------------------------------------------------------------


def _write_state(folder, moments, metadata):
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"{name}/{key}": torch.ones(3, 2) * (i + 1) for i, name in enumerate(["a", "b"]) for key in moments}
    save_file(tensors, str(folder / pc.FULL_OPTIMIZER_FILE), metadata=metadata)
    return folder


def test_a_saved_state_is_read_by_what_it_holds(tmp_path):
    adam = pc.read_optimizer_state(_write_state(tmp_path / "adam", pc.ADAM_MOMENTS, {"adam_step": "12"}),
                                   {"betas": [0.5, 0.6], "eps": 1e-4, "gradient_clipping": 0.0})
    assert (adam.kind, adam.step, adam.betas, adam.eps, adam.clip) == ("adamw", 12, (0.5, 0.6), 1e-4, 0.0)
    assert adam.moments["b"]["exp_avg_sq"].dtype == torch.float64 and float(adam.moments["b"]["exp_avg"][0, 0]) == 2
    assert adam.describe()["moments"] == "saved" and adam.describe()["step"] == 12
    sgd = pc.read_optimizer_state(_write_state(tmp_path / "sgd", pc.SGD_MOMENTS, {"adam_step": "3"}),
                                  {"optimizer": "sgd", "momentum": 0.5})
    assert (sgd.kind, sgd.step, sgd.momentum, set(sgd.moments)) == ("sgd", 3, 0.5, {"a", "b"})
    fresh = pc.read_optimizer_state(None, None)  # a fresh adapter: the defaults, zero moments
    assert (fresh.kind, fresh.step, fresh.source, fresh.describe()["moments"]) == ("adamw", 0, None, "zero")
    assert fresh.clip == 1.0 and fresh.betas == (0.9, 0.999)
    assert pc.read_optimizer_state(tmp_path / "nothing-here", {"optimizer": "sgd"}).kind == "sgd"


@pytest.mark.parametrize("moments, metadata, schedule, says", [
    (("exp_avg", "momentum_buffer"), {"adam_step": "1"}, None, "holds exp_avg, momentum_buffer state per parameter"),
    (pc.ADAM_MOMENTS, {"adam_step": "1"}, {"optimizer": "sgd"}, "holds adamw's state, but the run's"),
    (pc.SGD_MOMENTS, {"adam_step": "1"}, None, "holds sgd's state, but the run's schedule.optimizer is adamw"),
    (pc.ADAM_MOMENTS, {}, None, "no adam_step in its metadata"),
])
def test_a_state_it_cannot_read_is_refused_in_one_line(tmp_path, moments, metadata, schedule, says):
    folder = _write_state(tmp_path / "ckpt", moments, metadata)
    with pytest.raises(UserError, match=says) as caught:
        pc.read_optimizer_state(folder, schedule)
    assert "\n" not in str(caught.value)


def test_a_state_of_other_parameters_is_refused(tmp_path):
    state = pc.read_optimizer_state(_write_state(tmp_path / "c", pc.ADAM_MOMENTS, {"adam_step": "1"}), None)
    with pytest.raises(UserError, match="holds state of a, which is not a LoRA factor"):
        pc.check_covered(state, [("x", "y")])
    with pytest.raises(UserError, match="no exp_avg of x"):
        pc.optimizer_updates(state, [("x", "b")], [(torch.ones(3, 2), torch.ones(3, 2))])
    with pytest.raises(UserError, match=r"a/exp_avg is \(3, 2\), the model's parameter \(2, 3\)"):
        pc.optimizer_updates(state, [("a", "b")], [(torch.ones(2, 3), torch.ones(3, 2))])
    assert math.isfinite(pc.clip_scale([(torch.zeros(2), torch.zeros(2))], 1.0))
