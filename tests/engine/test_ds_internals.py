"""The one DeepSpeed seam (iga_ds/engine/internals.py) fails loudly: each internal the hook relies
on, removed in turn from a real ZeRO-2 engine of a tiny PEFT model (world size 1, gloo, CPU),
stops the attach with one line naming the installed DeepSpeed and the attribute, before the
hook changes anything."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from iga_ds.engine import HookConfig, attach
from iga_ds.engine import internals
from iga_ds.errors import UserError
from zero2_engine import engine  # noqa: F401  (a fixture: one ZeRO-2 engine of a tiny model, world size 1)

REPO = Path(__file__).resolve().parents[2]
IGA = HookConfig(method="iga", params={"tau": 0.5}, domains=["a", "b", "c"])


def factors(engine) -> list[torch.nn.Parameter]:
    return [p for n, p in engine.module.named_parameters() if p.requires_grad and "lora_" in n]


def remove(mp: pytest.MonkeyPatch, obj, name: str) -> None:
    """``obj`` without ``name``: from the object itself, or from every class that defines it."""
    if name in vars(obj):
        mp.delattr(obj, name)
        return
    owners = [cls for cls in type(obj).__mro__ if cls is not object and name in vars(cls)]
    assert owners, f"{name} is neither {obj!r}'s nor its classes'"
    for cls in owners:
        mp.delattr(cls, name)


def assert_one_line_naming(exc: UserError, label: str) -> None:
    import deepspeed

    message = str(exc)
    assert "\n" not in message, message
    assert f"deepspeed {deepspeed.__version__}" in message and label in message, message


def test_the_installed_deepspeed_has_every_internal_and_the_hook_restores_the_step(engine):
    optimizer = engine.optimizer
    step = optimizer.step
    found = {label for _, _, label in internals.required_internals(engine, factors(engine), owns_gradients=True)}
    # the ones a quieter path used to hide: the fragment link (else param.grad, dropped under
    # ZeRO-2), the skip's writes, the left-out gradients' bucket set-up
    for label in ("the LoRA parameter's _hp_mapping", "DeepSpeedZeroOptimizer.micro_step_id",
                  "DeepSpeedZeroOptimizer.averaged_gradients", "DeepSpeedZeroOptimizer.setup_buckets",
                  "the LoRA parameter's _hp_mapping.get_lp_grad_fragment",
                  "deepspeed.runtime.utils.mask_nan_or_inf_with_val_inplace"):
        assert label in found, sorted(found)
    hook = attach(engine, IGA)
    try:
        assert optimizer.step == hook._boundary_step and hook.fused_checks and hook.reused_zeros
        assert hook._writer.fragments
    finally:
        hook.detach()
    assert optimizer.step == step and "step" not in vars(optimizer)  # the class's own again
    assert not set(internals.FUSED_CHECKS) & set(vars(optimizer)) and "get_all_grad_tensors" not in vars(optimizer)


def test_each_internal_removed_stops_the_attach_with_one_line_naming_it(engine):
    required = internals.required_internals(engine, factors(engine), owns_gradients=True)
    assert len(required) > 20
    before = dict(vars(engine.optimizer))
    for obj, name, label in required:
        with pytest.MonkeyPatch.context() as mp:
            remove(mp, obj, name)
            with pytest.raises(UserError) as caught:
                attach(engine, IGA).detach()
                pytest.fail(f"attached without {label}")
            assert_one_line_naming(caught.value, label)
        # nothing was changed before the check: no step wrapped, no capture, nothing fused
        assert vars(engine.optimizer).keys() == before.keys(), label


def test_a_method_that_captures_nothing_needs_no_parameter_link(engine):
    with pytest.MonkeyPatch.context() as mp:
        for p in factors(engine):
            mp.delattr(p, "_hp_mapping")
        hook = attach(engine, HookConfig(method="erm", domains=["a", "b", "c"]))
        hook.detach()
        with pytest.raises(UserError) as caught:
            attach(engine, IGA)
        assert_one_line_naming(caught.value, "_hp_mapping")


@pytest.mark.parametrize("name", sorted(internals.SIGNATURES))
def test_a_changed_signature_stops_the_attach(engine, name):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(engine.optimizer), name, lambda self, grads, params: None)
        with pytest.raises(UserError) as caught:
            attach(engine, IGA)
        assert_one_line_naming(caught.value, f"DeepSpeedZeroOptimizer.{name}")


def test_a_deepspeed_below_the_floor_is_refused(engine, monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.17.5")
    with pytest.raises(UserError, match=r"^deepspeed 0\.17\.5 is too old: the engine hook needs >= 0\.17\.6$"):
        attach(engine, IGA)


def test_the_globals_the_trainer_resets_are_checked(monkeypatch):
    from deepspeed.utils import groups

    monkeypatch.delattr(groups, "_WORLD_GROUP")
    with pytest.raises(UserError) as caught:
        internals.forget_world_group()
    assert_one_line_naming(caught.value, "deepspeed.utils.groups._WORLD_GROUP")


def test_the_op_builders_are_checked(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed.ops.op_builder.all_ops", None)  # its import fails
    with pytest.raises(UserError) as caught:
        internals.deepspeed_op_status()
    assert_one_line_naming(caught.value, "the op builders")


def test_the_tested_range_is_pyprojects_and_the_containers():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    low, high = re.search(r'"deepspeed>=([\d.]+),<=([\d.]+)"', text).groups()
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert internals.TESTED_DEEPSPEED == (as_tuple(low), as_tuple(high))
    assert internals.MIN_DEEPSPEED == as_tuple(low)
    pinned = re.search(r"^deepspeed==([\d.]+)$", (REPO / "docker" / "constraints.txt").read_text(), re.M).group(1)
    assert as_tuple(pinned) == internals.TESTED_DEEPSPEED[1]
