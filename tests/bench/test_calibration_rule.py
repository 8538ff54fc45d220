"""bench/choose_calibration.py: the rule that fixes the replication's steps and learning rate."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "choose_calibration.py"


@pytest.fixture
def rule(monkeypatch):
    spec = importlib.util.spec_from_file_location("choose_calibration", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _cell(root: Path, lr: float, steps: int, control: bool, ood: float, cue: float) -> None:
    name = f"{'control' if control else 'erm'}_{lr}_{steps}-s0"
    folder = root / name
    (folder / "eval").mkdir(parents=True)
    info = {"method": "erm", "seed": 0, "ablation": None, "train_method": "erm"}
    (folder / "cell.json").write_text(json.dumps(info))
    variant = {"method": "erm", "params": {}, "train": {"schedule": {"lr": lr, "max_steps": steps}}}
    if control:
        variant["cue"] = "neutral"
    (folder / "cell_spec.json").write_text(json.dumps({"run": {"schedule": {"lr": 1.0, "warmup_ratio": 0.1}},
                                                       "variant": variant}))
    result = {"benchmark": "synthetic", "id_accuracy": ood + 1, "ood_accuracy": ood, "ood_cue_follow": cue}
    (folder / "eval" / "synthetic.json").write_text(json.dumps(result))


def _calibration(root: Path, table: dict) -> None:
    """table: (lr, steps) -> (control OOD, control cue, ERM cue)."""
    for (lr, steps), (ood, control_cue, erm_cue) in table.items():
        _cell(root, lr, steps, True, ood, control_cue)
        _cell(root, lr, steps, False, ood - 5, erm_cue)


def test_the_largest_gap_among_controls_in_range_wins(rule, tmp_path):
    _calibration(tmp_path, {
        (1e-3, 600): (99.0, 1.0, 40.0),   # the largest gap, but the control solved the task
        (1e-3, 300): (90.0, 8.0, 20.0),   # gap 12: the choice
        (3e-4, 300): (70.0, 20.0, 30.0),  # gap 10
        (3e-4, 600): (50.0, 30.0, 60.0),  # gap 30, but the control did not learn the task
    })
    rows = rule.settings(tmp_path)
    gaps = {(s.lr, s.steps): s.gap for s in rows}
    assert gaps == pytest.approx({(1e-3, 600): 39.0, (1e-3, 300): 12.0, (3e-4, 300): 10.0, (3e-4, 600): 30.0})
    chosen, in_range = rule.choose(rows)
    assert (chosen.lr, chosen.steps, in_range) == (1e-3, 300, True)


def test_ties_go_to_fewer_steps_then_the_lower_rate_and_nothing_in_range_falls_back(rule, tmp_path):
    _calibration(tmp_path / "tie", {(1e-3, 600): (90.0, 5.0, 15.0), (1e-3, 300): (90.0, 5.0, 15.0),
                                    (3e-4, 300): (90.0, 5.0, 15.0)})
    chosen, _ = rule.choose(rule.settings(tmp_path / "tie"))
    assert (chosen.lr, chosen.steps) == (3e-4, 300)
    _calibration(tmp_path / "none", {(1e-3, 600): (99.0, 1.0, 9.0), (1e-3, 300): (98.0, 1.0, 21.0)})
    chosen, in_range = rule.choose(rule.settings(tmp_path / "none"))
    assert (chosen.steps, in_range) == (300, False)


def test_set_grid_writes_the_choice_into_a_copy_of_the_replication_grid(tmp_path):
    from iga_ds.experiments.grid import load_grid

    _calibration(tmp_path / "runs", {(3e-4, 600): (80.0, 10.0, 30.0), (1e-3, 300): (80.0, 10.0, 20.0)})
    grid_dir = tmp_path / "configs" / "experiments"
    grid_dir.mkdir(parents=True)
    grid = grid_dir / "replication_smollm2.yaml"
    shutil.copy(ROOT / "configs" / "experiments" / "replication_smollm2.yaml", grid)
    (tmp_path / "ds_configs").mkdir()
    shutil.copy(ROOT / "ds_configs" / "zero2.json", tmp_path / "ds_configs")
    before = grid.read_text()
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "runs"), "--set-grid", str(grid)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "chosen: lr 0.0003, 600 steps" in done.stdout
    schedule = load_grid(grid).run["schedule"]
    assert (schedule["lr"], schedule["max_steps"], schedule["warmup_ratio"]) == (3e-4, 600, 0.1)
    changed = [(a, b) for a, b in zip(before.splitlines(), grid.read_text().splitlines()) if a != b]
    assert len(changed) == 1 and "# calibrated" in changed[0][1]  # one line, its comment kept


def test_an_incomplete_calibration_is_one_line_and_exit_2(tmp_path):
    _cell(tmp_path, 1e-3, 300, False, 80.0, 20.0)  # ERM without its control
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "incomplete" in done.stderr and "lr 0.001, 300 steps" in done.stderr
