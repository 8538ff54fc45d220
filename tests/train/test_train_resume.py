"""Checkpoints and resume: an interrupted run continues exactly where it stopped."""
from __future__ import annotations

import json
import os
import signal

import pytest

from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _train(tmp_path, data, base, out, on_step_end=None, **over):
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    cfg = config_from_dict(run_config_dict(tmp_path, data, output_dir=str(out), **over))
    return Trainer(cfg, base_model_dir=str(base), on_step_end=on_step_end, quiet=True).run()


def _adapter_tensors(adapter_dir):
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def _metric_steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=6, seed=1)
    return tmp, data, tiny_base(tmp, data)


def test_signal_then_resume_matches_uninterrupted_run(setup):
    import torch

    tmp, data, base = setup
    steps = 6  # 3 steps per epoch: the resumed part crosses an epoch boundary
    full = _train(tmp, data, base, tmp / "full", **{"schedule.max_steps": steps})
    assert full.status == "completed" and full.step == steps

    def interrupt(step, record):
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # what Slurm sends before the time limit

    first = _train(tmp, data, base, tmp / "cut", on_step_end=interrupt, **{"schedule.max_steps": steps})
    assert first.status == "stopped" and first.step == 2
    assert first.adapter_dir is None and (tmp / "cut" / "checkpoints" / "latest").is_file()
    # a killed run may leave metric lines past its checkpoint; fake one to check they are dropped
    with (tmp / "cut" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 99.0}) + "\n")

    second = _train(tmp, data, base, tmp / "cut", **{"schedule.max_steps": steps})
    assert second.status == "completed" and second.step == steps

    resumed = [h["loss"] for h in first.history] + [h["loss"] for h in second.history]
    assert resumed == [h["loss"] for h in full.history]  # same data order, same state: bit-equal
    assert [h["lr"] for h in second.history] == [h["lr"] for h in full.history[2:]]
    a, b = _adapter_tensors(full.adapter_dir), _adapter_tensors(second.adapter_dir)
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _metric_steps(tmp / "cut") == list(range(1, steps + 1))
    # how far each module moved: the resumed run's paths continue the stopped run's
    assert [h["update_norm"] for h in first.history + second.history] == [h["update_norm"] for h in full.history]
    moved = [json.loads((tmp / run / "update_norms.json").read_text()) for run in ("full", "cut")]
    assert moved[0] == moved[1] and moved[0]["steps"] == steps


def test_stop_file_stops_like_a_signal_and_is_removed(setup):
    """`touch OUTPUT_DIR/STOP`: checkpoint at the next step boundary, the file removed; a stale
    file from an earlier run is removed before training instead of stopping the new run."""
    tmp, data, base = setup
    out = tmp / "stopfile"
    out.mkdir()
    (out / "STOP").write_text("")  # left by an earlier run

    def request_stop(step, record):
        assert step != 1 or not (out / "STOP").exists()  # the stale file was gone before step 1
        if step == 2:
            (out / "STOP").write_text("")

    first = _train(tmp, data, base, out, on_step_end=request_stop, **{"schedule.max_steps": 4})
    assert first.status == "stopped" and first.step == 2
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert not (out / "STOP").exists()
    second = _train(tmp, data, base, out, **{"schedule.max_steps": 4})
    assert second.status == "completed" and second.step == 4
    assert _metric_steps(out) == [1, 2, 3, 4]


def test_stop_request_reason_names_what_asked(tmp_path):
    from iga_ds.train.checkpoint import StopSignal

    stop = StopSignal(tmp_path / "STOP")
    assert not stop.requested() and stop.reason is None
    (tmp_path / "STOP").write_text("")
    assert stop.requested() and stop.reason == "stop file STOP"
    stop.consume()
    assert not (tmp_path / "STOP").exists()
    stop.received = signal.SIGTERM
    assert stop.requested() and stop.reason == "SIGTERM"
    assert not StopSignal(None).requested()  # no file watched, no signal


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
def test_after_a_stop_a_repeated_sigusr1_cannot_end_the_process(tmp_path):
    """Without a stop, uninstall gives SIGUSR1 its old handler back; after one, it leaves it
    ignored, so a second request arriving during the exit cannot kill the rank."""
    from iga_ds.train.checkpoint import StopSignal

    before = signal.getsignal(signal.SIGUSR1)
    try:
        stop = StopSignal(tmp_path / "STOP").install()
        assert signal.getsignal(signal.SIGUSR1) == stop._handle
        stop.uninstall()
        assert signal.getsignal(signal.SIGUSR1) == before
        stop = StopSignal(tmp_path / "STOP").install()
        (tmp_path / "STOP").write_text("")
        assert stop.requested()
        stop.uninstall()
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR1)  # would end this process with the default action
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_checkpoints_are_pruned_and_exclude_frozen_weights(setup):
    tmp, data, base = setup
    out = tmp / "pruned"
    _train(tmp, data, base, out, **{"schedule.max_steps": 4, "checkpoint.every_steps": 1, "checkpoint.keep_last": 2})
    tags = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert tags == ["step_00000003", "step_00000004"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    import torch

    states = torch.load(out / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt", weights_only=False)
    names = list(states["module"].keys())
    assert any("lora_A" in n for n in names) and any("lora_B" in n for n in names)
    # frozen base weights are left out; DeepSpeed keeps only aliases of tied weights (lm_head)
    frozen_saved = [n for n in names if "lora_" not in n]
    assert set(frozen_saved) <= set(states["shared_params"]), frozen_saved
    assert not any(".mlp." in n or "norm" in n for n in names)


def test_resume_never_starts_over(setup):
    tmp, data, base = setup
    out = tmp / "restart"
    _train(tmp, data, base, out, **{"schedule.max_steps": 2})
    again = _train(tmp, data, base, out, resume="never", **{"schedule.max_steps": 2})
    assert [h["step"] for h in again.history] == [1, 2]


def test_a_resume_under_another_schedule_names_the_changes_and_refuses_unless_allowed(setup):
    """Other max_steps and lr than the checkpoint's: one line naming each change, old -> new;
    with checkpoint.allow_schedule_change the run continues under the new schedule (its lr, its
    number of steps)."""
    from iga_ds.engine.collector import FrozenCollector
    from iga_ds.errors import ConfigError
    from iga_ds.train.optim import lr_lambda

    tmp, data, base = setup
    out = tmp / "rescheduled"
    first = _train(tmp, data, base, out, **{"schedule.max_steps": 3, "checkpoint.stop_at_step": 1})
    assert first.status == "stopped" and first.step == 1
    with pytest.raises(ConfigError, match=r"another schedule \(seed 3 -> 4\)"):  # another order of the groups
        _train(tmp, data, base, out, seed=4, **{"schedule.max_steps": 3})
    changed = {"schedule.max_steps": 4, "schedule.lr": 1e-3}
    with pytest.raises(ConfigError) as refused:
        _train(tmp, data, base, out, **changed)
    message = str(refused.value)
    assert "\n" not in message and "step_00000001" in message, message
    assert "schedule.max_steps 3 -> 4" in message and "schedule.lr 0.005 -> 0.001" in message, message
    assert "total_steps 3 -> 4" in message and "checkpoint.allow_schedule_change=true" in message, message
    assert "schedule.warmup_ratio" not in message  # only what changed
    assert FrozenCollector._holders == 0  # the refused runs detached their hooks
    second = _train(tmp, data, base, out, **changed, **{"checkpoint.allow_schedule_change": True,
                                                         "schedule.weight_decay": 0.0})
    assert second.status == "completed" and second.step == 4
    shape = lr_lambda(4, 0.03, 0.0)  # the run's warm-up and floor are the defaults
    assert [h["lr"] for h in second.history] == pytest.approx([1e-3 * shape(k) for k in (1, 2, 3)])
    assert _metric_steps(out) == [1, 2, 3, 4]


EMA = {"method.name": "iga", "method.params": {"tau": 1.0, "variance": "ema", "variance_decay": 0.5}}


def test_iga_ema_resumes_exactly(setup):
    """IGA's moving averages are the method's state: S steps equal S1 steps, a checkpoint (its
    method_state file) and a resume for the rest, bit for bit; without the state they would not."""
    import torch

    from iga_ds.train.checkpoint import read_method_state

    tmp, data, base = setup
    steps = 4
    full = _train(tmp, data, base, tmp / "ema-full", **EMA, **{"schedule.max_steps": steps})
    first = _train(tmp, data, base, tmp / "ema-cut", **EMA, **{"schedule.max_steps": steps,
                                                                "checkpoint.stop_at_step": 2})
    assert first.status == "stopped"
    saved = read_method_state(tmp / "ema-cut" / "checkpoints" / "step_00000002")
    assert saved and all(key.split(".")[1] in ("ema_gA", "ema_gB", "ema_steps") for key in saved)
    assert {int(t) for key, t in saved.items() if key.endswith("ema_steps")} == {2}
    second = _train(tmp, data, base, tmp / "ema-cut", **EMA, **{"schedule.max_steps": steps})
    assert [h["loss"] for h in first.history + second.history] == [h["loss"] for h in full.history]
    assert ([h["hook.mask_mean"] for h in first.history + second.history]
            == [h["hook.mask_mean"] for h in full.history])
    a, b = _adapter_tensors(full.adapter_dir), _adapter_tensors(second.adapter_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a method that keeps no state refuses the averages in one line, rather than dropping them
    # (the changed parameters allowed: else the resume stops at the change, tests/train/test_fault_table.py)
    from iga_ds.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^resume: .*step_00000004: iga with variance 'batch' keeps no state"):
        _train(tmp, data, base, tmp / "ema-cut", **{"method.name": "iga", "schedule.max_steps": steps,
                                                    "checkpoint.allow_changes": ["method.params"]})
    # the state is what made it exact: a resume that starts the averages over differs
    for share in (tmp / "ema-cut" / "checkpoints" / "step_00000002").glob("method_state_rank*"):
        share.unlink()
    (tmp / "ema-cut" / "checkpoints" / "latest").write_text("step_00000002")
    fresh = _train(tmp, data, base, tmp / "ema-cut", **EMA, **{"schedule.max_steps": steps})
    assert [h["hook.mask_mean"] for h in fresh.history] != [h["hook.mask_mean"] for h in full.history[2:]]


def test_iga_debiased_trains_on_halves_and_refuses_an_odd_group_count(setup):
    from iga_ds.errors import ConfigError

    tmp, data, base = setup
    debiased = {"method.name": "iga", "method.params": {"variance": "debiased"}}
    run = _train(tmp, data, base, tmp / "debiased", **debiased, **{"schedule.max_steps": 2})
    assert run.status == "completed"
    # the logged losses stay per domain (4), though the hook captured 2 x 4 (domain, half) slots
    assert all(len([k for k in h if k.startswith("loss.")]) == 4 for h in run.history)
    assert all(0 < h["hook.mask_mean"] <= 1 for h in run.history)
    with pytest.raises(ConfigError, match=r"data.groups_per_step: .*two equal halves; expected an even number, got 3"):
        _train(tmp, data, base, tmp / "debiased-odd", **debiased,
               **{"schedule.max_steps": 1, "data.groups_per_step": 3})
