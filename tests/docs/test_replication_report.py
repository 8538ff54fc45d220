"""docs/REPLICATION.md is what `iga-ds report` makes of the archived runs, to the byte."""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# each student's archived runs: (archive, the folder it unpacks to, the student's name in the report)
STUDENTS = [
    (ROOT / "results" / "replication-2026-11-26" / "runs.tar.xz", "replication", "tiny LLaMA, 4 layers"),
    (ROOT / "results" / "replication-smollm2-2026-11-27" / "runs.tar.xz", "replication-smollm2",
     "SmolLM2-135M-Instruct"),
    (ROOT / "results" / "shift-smollm2" / "shift-smollm2.tar.xz", "shift-smollm2",
     "SmolLM2-135M-Instruct, diverse environments"),
    (ROOT / "results" / "control-smollm2" / "control-smollm2.tar.xz", "control-smollm2",
     "SmolLM2-135M-Instruct, negative control"),
]


def _documented_report_command() -> list[str]:
    """The `iga-ds report` line of docs/replication_discussion.md's command block, as arguments."""
    text = (ROOT / "docs" / "replication_discussion.md").read_text(encoding="utf-8")
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    line = next(line for line in block.splitlines() if line.startswith("iga-ds report "))
    return shlex.split(line)[1:]


def test_replication_report_regenerates_from_the_archived_runs(tmp_path):
    """The documented command (docs/replication_discussion.md), run as written by the real
    program on the four unpacked archives, gives docs/REPLICATION.md and its figures."""
    for archive, _, _ in STUDENTS:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp_path / "runs", filter="data")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "replication_discussion.md", tmp_path / "docs")
    done = subprocess.run([sys.executable, "-m", "iga_ds", *_documented_report_command()], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "docs" / "REPLICATION.md"
    assert out.read_text(encoding="utf-8") == (ROOT / "docs" / "REPLICATION.md").read_text(encoding="utf-8")
    figures = sorted(str(p.relative_to(out.parent / "figures")) for p in (out.parent / "figures").rglob("*.png"))
    assert figures == sorted(f"{student}/{name}" for student in ("tiny-llama-4-layers", "smollm2-135m-instruct",
                                                             "smollm2-135m-instruct-diverse-environments",
                                                             "smollm2-135m-instruct-negative-control")
                             for name in ("cue_by_domain.png", "lcs_layers.png", "mask_stats.png", "ood_accuracy.png",
                                          "ood_vs_time.png"))
    documented = (ROOT / "docs" / "replication_discussion.md").read_text(encoding="utf-8")
    for _, folder, name in STUDENTS:  # the command shown names these folders and students
        assert f"runs/{folder} " in documented and f'--name "{name}"' in documented


def test_the_calibrated_schedule_is_what_the_rule_picks_from_the_archived_calibration(tmp_path, monkeypatch):
    """configs/experiments/replication_smollm2.yaml trains with the steps and rate that
    bench/choose_calibration.py picks from the archived calibration runs."""
    import importlib.util

    from iga_ds.experiments.grid import load_grid

    with tarfile.open(ROOT / "results" / "replication-smollm2-2026-11-27" / "calibration.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    spec = importlib.util.spec_from_file_location("choose_calibration", ROOT / "bench" / "choose_calibration.py")
    choose = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, choose)  # its dataclass looks itself up there
    spec.loader.exec_module(choose)
    chosen, in_range = choose.choose(choose.settings(tmp_path / "calibration-smollm2"))
    schedule = load_grid(ROOT / "configs" / "experiments" / "replication_smollm2.yaml").run["schedule"]
    assert in_range and (schedule["lr"], schedule["max_steps"]) == (chosen.lr, chosen.steps)


def test_the_replication_grid_runs_iga_at_the_shipped_defaults():
    """The main table's IGA row is what `get_method("iga")` builds; each IGA ablation differs
    from it in the one setting it is named after."""
    from iga_ds.experiments.grid import load_grid
    from iga_ds.methods import get_method

    grid = load_grid(ROOT / "configs" / "experiments" / "replication.yaml")
    variants = {v.key: v for v in grid.variants}

    def settings(variant) -> dict:
        method = get_method(variant.method, **variant.params)
        return {"tau": method.tau, "normalize": method.normalize}

    from iga_ds.methods.iga.common import DEFAULT_NORMALIZE, DEFAULT_TAU

    shipped = settings(variants["iga"])
    assert shipped == {"tau": DEFAULT_TAU, "normalize": DEFAULT_NORMALIZE}
    assert settings(variants["tau_2.0"]) == {**shipped, "tau": 2.0}
    assert settings(variants["normalize_mean"]) == {**shipped, "normalize": "mean"}
    for key in ("iga_no_projection", "iga_lora_space", "iga_binary", "random_pairing", "n2"):
        assert settings(variants[key]) == shipped, key
    assert settings(variants["mean_no_mask"]) == {**shipped, "tau": 0.0}  # no mask: nothing to threshold


def _cell(root: Path, name: str, method: str, params: dict, label: str | None = None, ood: float = 50.0) -> None:
    import json

    folder = root / name
    (folder / "eval").mkdir(parents=True)
    info = {"method": method, "seed": int(name[-1]), "ablation": None, "train_method": method}
    if label:
        info["label"] = label
    (folder / "cell.json").write_text(json.dumps(info))
    (folder / "cell_spec.json").write_text(json.dumps({"variant": {"method": method, "params": params}}))
    result = {"benchmark": "synthetic", "id_accuracy": ood + 10, "ood_accuracy": ood, "delta_gap": 10.0}
    (folder / "eval" / "synthetic.json").write_text(json.dumps(result))


def test_a_method_row_off_the_shipped_defaults_says_which_setting_it_is(tmp_path):
    from iga_ds.experiments.report import build_report
    from iga_ds.experiments.results import load_results
    from iga_ds.methods.iga.common import DEFAULT_TAU

    for seed in (0, 1):
        _cell(tmp_path, f"erm-s{seed}", "erm", {}, ood=50.0 + seed)
        _cell(tmp_path, f"iga-s{seed}", "iga", {"tau": DEFAULT_TAU}, ood=60.0 + seed)  # the default tau, said or not
        _cell(tmp_path, f"iga_mean-s{seed}", "iga", {"tau": DEFAULT_TAU, "normalize": "mean"}, ood=55.0 + seed)
        _cell(tmp_path, f"iga_t2-s{seed}", "iga", {"tau": 2.0, "normalize": "none"}, ood=52.0 + seed)
        _cell(tmp_path, f"sand-s{seed}", "sand_mask", {"tau": 0.9}, label="SAND-Mask, tau 0.9")
    labels = {c.name: c.label for c in load_results(tmp_path)}
    assert labels == {**{f"erm-s{s}": "ERM-SFT" for s in (0, 1)}, **{f"iga-s{s}": "IGA" for s in (0, 1)},
                      **{f"iga_mean-s{s}": "IGA (normalize: mean)" for s in (0, 1)},
                      **{f"iga_t2-s{s}": "IGA (normalize: none, tau: 2.0)" for s in (0, 1)},
                      **{f"sand-s{s}": "SAND-Mask, tau 0.9" for s in (0, 1)}}  # a label given is kept
    report = build_report(load_results(tmp_path))
    main = report.split("## Main results", 1)[1].split("##", 1)[0]
    rows = [line.split("|")[1].strip() for line in main.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == ["ERM-SFT", "SAND-Mask, tau 0.9", "IGA", "IGA (normalize: mean)", "IGA (normalize: none, tau: 2.0)"]
    # the claims compare the row at the shipped defaults with ERM-SFT (60.5 against 50.5)
    assert "| IGA against ERM-SFT | IGA | ERM-SFT |" in report
    assert "| synthetic OOD accuracy | 60.5 ± 0.7 | 50.5 ± 0.7 | +10.0 |" in report
