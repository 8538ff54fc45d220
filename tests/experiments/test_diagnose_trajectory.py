"""`iga-ds diagnose --every N` over a training run's checkpoints, and the optimizer state that a
real run saves: one short IGA run on a shrunk built-in base (a checkpoint every step) serves
the tests; an entry of the trajectory is a single diagnose of its checkpoint, and a killed
trajectory resumes without redoing its finished steps."""
from __future__ import annotations

import json
import os

import pytest
from test_train_support import run_config_dict
from tiny_models import SHRUNK_TINY_BASE

from iga_ds.cli import main
from iga_ds.data.synth import generate_groups
from iga_ds.experiments import diagnose_trajectory as dt
from iga_ds.files import write_jsonl

TINY = {**SHRUNK_TINY_BASE, "corpus_groups": 10}  # seconds to pretrain
# iga's ema variance carries statistics over steps: each checkpoint must start it afresh, as a single run does
METHODS = ["--method", "iga:tau=0.5", "--method", "iga:variance=ema", "--method", "sand_mask"]


def _train(root, name, steps, **over):
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    cfg = config_from_dict(run_config_dict(root, root / "cue.jsonl", output_dir=str(root / name), **{
        "model.tiny": TINY, "schedule.max_steps": steps, "checkpoint.every_steps": 1, "checkpoint.keep_last": 10,
        **over}))
    assert Trainer(cfg, quiet=True).run().status == "completed"
    return root / name


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(root, run folder, data): 4 steps of IGA on records with a planted cue, a checkpoint a step."""
    root = tmp_path_factory.mktemp("trajectory")
    os.environ["IGA_DS_CACHE"] = str(root / "cache")  # the suite's own; put back after the first test
    write_jsonl(root / "cue.jsonl", generate_groups(8, seed=11, shortcut=0.9))
    folder = _train(root, "run", 4, **{"method.name": "iga", "method.params": {"tau": 0.5}})
    return root, folder, str(root / "cue.jsonl")


def _diagnose(run_arg, data, out, *extra):
    argv = ["diagnose", "--run", str(run_arg), "--data", data, "--groups", "2", *METHODS, "--device", "cpu",
            "--no-progress", "--out", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_an_entry_is_the_single_diagnose_of_its_checkpoint(run, tmp_path, capsys):
    root, folder, data = run
    traj = _diagnose(folder, data, tmp_path / "traj.json", "--every", "2")
    assert [e["step"] for e in traj["steps"]] == [2, 4] and traj["complete"] and traj["figure"] == "traj.png"
    assert (tmp_path / "traj.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert f"wrote {tmp_path / 'traj.json'} and {tmp_path / 'traj.png'}" in printed
    assert [line.split()[:2] for line in printed.splitlines() if line.split()[:1] == ["4"]] == \
        [["4", "erm"], ["4", "iga:tau=0.5"], ["4", "iga:variance=ema"], ["4", "sand_mask"]]
    for entry in traj["steps"]:
        single = _diagnose(folder / "checkpoints" / f"step_{entry['step']:08d}", data, tmp_path / "one.json")
        assert {k: v for k, v in entry.items() if k not in ("step", "checkpoint")} == single
        opt = entry["after_optimizer"]["optimizer"]
        assert (opt["optimizer"], opt["step"], opt["moments"]) == ("adamw", entry["step"], "saved")
        assert opt["state"].endswith(f"step_{entry['step']:08d}/optimizer_full.safetensors")
        for space in ("factor", "weight"):
            assert entry["after_optimizer"][space]["methods"]["erm"]["task"] == 1.0
    # the weights differ from step to step: each checkpoint's adapter was the one measured
    assert traj["steps"][0]["factor"]["directions"] != traj["steps"][1]["factor"]["directions"]
    # a run's final adapter takes the state of the last checkpoint, which holds the same weights
    final = _diagnose(folder, data, tmp_path / "final.json")
    assert final["after_optimizer"]["optimizer"]["state"].endswith("step_00000004/optimizer_full.safetensors")
    assert final["after_optimizer"] == traj["steps"][1]["after_optimizer"]


def test_a_killed_trajectory_resumes_without_redoing_its_steps(run, tmp_path, monkeypatch):
    root, folder, data = run
    out = tmp_path / "traj.json"
    whole = _diagnose(folder, data, out, "--every", "1")
    assert [e["step"] for e in whole["steps"]] == [1, 2, 3, 4]
    # as a kill after step 2 leaves it
    out.write_text(json.dumps({**whole, "complete": False, "steps": whole["steps"][:2]}))
    measured = []
    real = dt.measure_model
    monkeypatch.setattr(dt, "measure_model", lambda loaded, source, *rest: measured.append(source.adapter) or
                        real(loaded, source, *rest))
    resumed = _diagnose(folder, data, out, "--every", "1")
    assert [p.parent.name for p in measured] == ["step_00000003", "step_00000004"]
    assert resumed == whole
    measured.clear()
    assert _diagnose(folder, data, out, "--every", "1") == whole and measured == []  # nothing left to do


@pytest.mark.parametrize("args, says", [
    (["--every", "5"], "--every 5: "),
    (["--every", "0"], "--every 0: expected a positive integer"),
    (["--every", "2", "--lora-r", "2"], "are for a base given a fresh one"),
])
def test_bad_trajectories_are_one_line_and_exit_2(run, tmp_path, capsys, args, says):
    root, folder, data = run
    rc = main(["diagnose", "--run", str(folder), "--data", data, "--groups", "2", "--out", str(tmp_path / "t.json"),
               *args])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.json").exists()


def test_a_trajectory_of_other_settings_or_of_no_run_is_refused(run, tmp_path, capsys):
    root, folder, data = run
    out = tmp_path / "traj.json"
    _diagnose(folder, data, out, "--every", "4")
    before = out.read_text()
    assert main(["diagnose", "--run", str(folder), "--data", data, "--groups", "1", *METHODS, "--every", "4",
                 "--out", str(out)]) == 2
    assert "holds a trajectory of other settings (groups)" in capsys.readouterr().err and out.read_text() == before
    single = tmp_path / "single.json"
    _diagnose(folder, data, single)
    assert main(["diagnose", "--run", str(folder), "--data", data, "--groups", "2", "--every", "4",
                 "--out", str(single)]) == 2
    assert "is not a trajectory's JSON" in capsys.readouterr().err
    assert main(["diagnose", "--run", str(folder / "checkpoints" / "step_00000004"), "--data", data, "--groups", "1",
                 "--every", "1", "--out", str(tmp_path / "no.json")]) == 2
    assert "--every needs a training run's folder" in capsys.readouterr().err


def test_an_sgd_runs_checkpoint_gives_the_momentum_step(run, tmp_path):
    root, _, data = run
    folder = _train(root, "sgd", 1, **{"schedule.optimizer": "sgd", "schedule.momentum": 0.8})
    result = _diagnose(folder / "checkpoints" / "step_00000001", data, tmp_path / "sgd.json")
    opt = result["after_optimizer"]["optimizer"]
    assert (opt["optimizer"], opt["momentum"], opt["moments"], opt["step"]) == ("sgd", 0.8, "saved", 1)
