"""schedule.optimizer: sgd, SGD with momentum under ZeRO-2: the update is -lr times the momentum
buffer, the buffer is checkpointed, a resume continues exactly, and options of the other optimizer are refused."""
from __future__ import annotations

import os

import pytest

from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl

os.environ.setdefault("DS_ACCELERATOR", "cpu")
SGD = {"schedule.optimizer": "sgd", "schedule.momentum": 0.9, "schedule.weight_decay": 0.0,
       "schedule.max_steps": 4, "checkpoint.every_steps": 1, "checkpoint.keep_last": 4}


def _train(tmp, data, base, out, **over):
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    cfg = config_from_dict(run_config_dict(tmp, data, output_dir=str(out), **over))
    return Trainer(cfg, base_model_dir=str(base), quiet=True).run()


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sgd")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=6, seed=2)
    return tmp, data, tiny_base(tmp, data)


@pytest.mark.parametrize("over, words", [
    ({"schedule.momentum": 0.5}, "schedule.momentum: acts with optimizer: sgd only"),
    ({"schedule.optimizer": "sgd", "schedule.betas": [0.9, 0.99]}, "schedule.betas: acts with optimizer: adamw"),
    ({"schedule.optimizer": "sgd", "schedule.momentum": 1.0}, "schedule.momentum: expected a number in [0, 1)"),
    ({"schedule.optimizer": "lion"}, "schedule.optimizer: expected"),
])
def test_options_of_the_other_optimizer_are_refused_in_one_line(tmp_path, over, words):
    from iga_ds.config.run import config_from_dict
    from iga_ds.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        config_from_dict(run_config_dict(tmp_path, tmp_path / "d.jsonl", **over))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_step_is_minus_lr_times_the_checkpointed_momentum_buffer(setup):
    import torch

    tmp, data, base = setup
    run = _train(tmp, data, base, tmp / "sgd", **SGD)
    assert run.status == "completed"
    ckpts = tmp / "sgd" / "checkpoints"
    before, after = (_tensors(ckpts / f"step_{s:08d}" / "adapter" / "adapter_model.safetensors") for s in (2, 3))
    state = _tensors(ckpts / "step_00000003" / "optimizer_full.safetensors")
    assert state and all(key.endswith("/momentum_buffer") for key in state)
    lr = run.history[2]["lr"]  # the lr step 3 took
    checked = 0
    for key, buf in state.items():
        name = key.rsplit("/", 1)[0].replace(".default", "")
        saved = next(k for k in after if k.endswith(name.split("base_model.model.", 1)[-1]))
        assert torch.allclose(after[saved] - before[saved], -lr * buf, rtol=1e-4, atol=1e-7), name
        checked += 1
    assert checked == len(after)


def test_an_sgd_run_resumed_from_its_checkpoint_matches_the_uninterrupted_one(setup):
    import torch

    tmp, data, base = setup
    full = _train(tmp, data, base, tmp / "full", **SGD)
    cut = _train(tmp, data, base, tmp / "cut", **SGD, **{"checkpoint.stop_at_step": 2})
    assert cut.status == "stopped" and cut.step == 2
    rest = _train(tmp, data, base, tmp / "cut", **SGD)
    assert [h["loss"] for h in cut.history + rest.history] == [h["loss"] for h in full.history]
    a, b = _tensors(full.adapter_dir / "adapter_model.safetensors"), _tensors(rest.adapter_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_optimizer_built_is_torchs_with_the_run_yamls_settings(optimizer):
    """One step of build_optimizer's optimizer equals torch's own, built by hand from the same
    settings (a momentum or beta not passed through would differ from the second step on)."""
    import torch

    from iga_ds.config.run import ScheduleConfig
    from iga_ds.train.optim import build_optimizer

    settings = {"sgd": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.7, "weight_decay": 0.01},
                "adamw": {"lr": 0.1, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.01}}[optimizer]
    schedule = ScheduleConfig(**settings)
    built, plain = (torch.nn.Parameter(torch.arange(6, dtype=torch.float64).reshape(2, 3)) for _ in range(2))
    ours = build_optimizer([built], schedule)
    theirs = (torch.optim.SGD([plain], lr=0.1, momentum=0.7, weight_decay=0.01) if optimizer == "sgd" else
              torch.optim.AdamW([plain], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01))
    for step in range(3):
        grad = torch.sin(torch.arange(6, dtype=torch.float64).reshape(2, 3) + step)
        for p, opt in ((built, ours), (plain, theirs)):
            p.grad = grad.clone()
            opt.step()
        assert torch.equal(built, plain), step
    assert ours.param_groups[0]["step"] == 3  # where DeepSpeed's elastic checkpoint reads it


@pytest.mark.parametrize("name", ["GroupStepAdamW", "GroupStepSGD"])
def test_an_empty_parameter_group_steps_nothing_and_keeps_its_count(name):
    """A trainer's no-decay group of a LoRA model is empty: the step count of each group is
    recorded without reading a parameter the empty group does not have (an IndexError before)."""
    import torch

    from iga_ds.engine import internals

    p = torch.nn.Parameter(torch.ones(2))
    optimizer = getattr(internals, name)([{"params": [p]}, {"params": []}], lr=0.1)
    for _ in range(2):
        p.grad = torch.ones(2)
        optimizer.step()
    assert [g["step"] for g in optimizer.param_groups] == [2, 0]
