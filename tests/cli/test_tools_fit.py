"""The tools read each other's outputs (issue 48, item 3): `iga-ds eval` takes every base
training takes (`builtin:tiny` with its settings, or none: the run says), `iga-ds report` reads a
grid, the demo's folder and a single run, and the demo draws its figure.

One shrunk demo (one method) and one short run on `builtin:tiny` serve every test; the tiny
base is pretrained in a few steps into this module's own cache."""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from tiny_models import SHRUNK_TINY_BASE, shrunk_tiny_base_config

from iga_ds.cli import main

TINY = dict(SHRUNK_TINY_BASE, corpus_groups=10)  # the run's model.tiny: a corpus of 10 groups
TINY_FLAGS = [x for k, v in TINY.items() for x in ("--tiny", f"{k}={v}")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tools_fit")


@pytest.fixture(autouse=True)
def _cache(root, monkeypatch):
    # per test: the suite's environment is restored after each one
    monkeypatch.setenv("IGA_DS_CACHE", str(root / "cache"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def demo(root):
    """(demo folder, what it printed): the demo shrunk to seconds, ERM alone."""
    from iga_ds.experiments.demo import DemoSettings, run_demo

    settings = DemoSettings(groups=40, id_groups=2, ood_groups=2, steps=2, groups_per_step=2, lora_r=2,
                            max_new_tokens=8)
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv("IGA_DS_CACHE", str(root / "cache"))
        run_demo(root / "demo", methods=["erm"], settings=settings, base_config=shrunk_tiny_base_config(),
                 pretrain_groups=10, progress=False)
    return root / "demo", printed.getvalue()


@pytest.fixture(scope="module")
def tiny_run(root, demo):
    """A two-step run on `model.name_or_path: builtin:tiny` with shrunk `model.tiny` settings."""
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    cfg = {"output_dir": str(root / "run"), "model": {"name_or_path": "builtin:tiny", "tiny": TINY},
           "lora": {"r": 2, "alpha": 4}, "method": {"name": "iga"}, "resume": "never", "seed": 0,
           "data": {"train": str(demo[0] / "data" / "fit.jsonl"), "groups_per_step": 2,
                    "groups_per_micro_batch": 2, "max_length": 128},
           "schedule": {"lr": 2e-3, "max_steps": 2}, "logging": {"progress": False}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IGA_DS_CACHE", str(root / "cache"))
        Trainer(config_from_dict(cfg), quiet=True).run()
    return root / "run"


def _eval(run_args: list[str], data: Path, out: Path) -> dict:
    args = ["eval", *run_args, "--data", str(data), "--limit", "4", "--max-new-tokens", "4", "--batch-size", "4",
            "--no-lcs", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    return json.loads(out.read_text())


# -- the demo's figure --------------------------------------------------------------------------


def test_the_demo_draws_its_figure_and_names_it(demo):
    folder, printed = demo
    figure = folder / "figure.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 1000
    last = printed.strip().splitlines()[-3:]
    assert any(f"figure: {figure}" in line for line in last)  # named in its last lines
    assert any(f"iga-ds report {folder}" in line for line in last)
    assert "iga-ds" in last[-1]  # the last line still says how to reach iga-ds


# -- eval takes every base training takes ----------------------------------------------------


def test_eval_of_a_builtin_tiny_run_needs_no_base(tiny_run, demo, root):
    import yaml

    resolved = yaml.safe_load((tiny_run / "config.resolved.yaml").read_text())["resolved"]
    result = _eval(["--run", str(tiny_run)], demo[0] / "data" / "ood_test.jsonl", root / "by_run.json")
    assert result["model"]["base"] == str(Path(resolved["base_model_dir"]).resolve())
    assert result["model"]["base_spec"] == "builtin:tiny" and result["model"]["tiny"]["hidden_size"] == 32
    assert result["model"]["adapter"] == str((tiny_run / "adapter").resolve())
    assert result["model"]["run"] == str(tiny_run.resolve()) and result["n_scored"] == 4


def test_eval_takes_builtin_tiny_with_its_settings(tiny_run, demo, root, capsys):
    data = demo[0] / "data" / "ood_test.jsonl"
    by_run = _eval(["--run", str(tiny_run)], data, root / "by_run_again.json")
    # --base builtin:tiny and the run's adapter: the base the run trained, the same generations
    named = _eval(["--base", "builtin:tiny", *TINY_FLAGS, "--adapter", str(tiny_run / "adapter")], data,
                  root / "named.json")
    assert named["model"]["base"] == by_run["model"]["base"]
    assert [i["output"] for i in named["items"]] == [i["output"] for i in by_run["items"]]
    # without an adapter: the cached tiny base built with these settings
    bare = _eval(["--base", "builtin:tiny", *TINY_FLAGS], data, root / "bare.json")
    assert bare["model"]["base"] == by_run["model"]["base"] and bare["model"]["adapter"] is None
    capsys.readouterr()
    # settings no base was built with, and --tiny without builtin:tiny: one line each
    assert main(["eval", "--base", "builtin:tiny", "--tiny", "hidden_size=48", "--tiny", "num_heads=4",
                 "--data", str(data), "--out", str(root / "none.json")]) == 2
    err = capsys.readouterr().err
    assert "no tiny base with these settings" in err and len(err.strip().splitlines()) == 1
    assert main(["eval", "--base", str(tiny_run), "--tiny", "steps=3", "--data", str(data),
                 "--out", str(root / "none.json")]) == 2
    assert "--tiny" in capsys.readouterr().err
    assert main(["eval", "--data", str(data), "--out", str(root / "none.json")]) == 2
    assert "--base: required unless --run" in capsys.readouterr().err


# -- report reads a grid, the demo's folder and a single run ---------------------------------


def _links(report: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)


def test_report_reads_the_demo_folder(demo, capsys):
    folder = demo[0]
    assert main(["report", str(folder)]) == 0
    printed = capsys.readouterr().out
    assert f"{folder}: read as a demo folder" in printed
    report = (folder / "report.md").read_text()
    assert "Read as a demo folder" in report and "| Method | acc ID % | acc OOD % |" in report
    assert "## Accuracy per domain" in report and "## Training loss" in report
    assert _links(report) == ["figure.png"] and (folder / "figure.png").is_file()


def test_report_reads_a_single_run_with_and_without_its_evaluation(tiny_run, demo, root, capsys):
    assert main(["report", str(tiny_run), "--out", str(root / "run_report" / "report.md")]) == 0
    assert f"{tiny_run}: read as a training run" in capsys.readouterr().out
    report = (root / "run_report" / "report.md").read_text()
    assert report.startswith("# Training run run\n") and "Read as a training run" in report
    assert "| base model | builtin:tiny " in report and "| method | iga |" in report
    assert "2 steps logged (1 to 2)." in report and "No evaluation beside the run" in report
    for link in _links(report):  # the loss curve, drawn beside the report
        assert (root / "run_report" / link).stat().st_size > 0
    # the demo's run holds its evaluation
    run = demo[0] / "erm"
    assert main(["report", str(run), "--no-figures"]) == 0
    report = (run / "report.md").read_text()
    assert "## Evaluation" in report and "| synthetic | 16 |" in report and "Accuracy per domain" in report


def test_report_of_a_grid_is_as_before_and_says_so(tmp_path, capsys):
    from iga_ds.experiments.report import build_report
    from iga_ds.experiments.results import load_results

    cell = tmp_path / "grid" / "iga-s0"
    cell.mkdir(parents=True)
    (cell / "cell.json").write_text(json.dumps({"method": "iga", "seed": 0}))
    (cell / "eval.json").write_text(json.dumps({"benchmark": "synthetic", "accuracy": 50.0}))
    assert main(["report", str(tmp_path / "grid"), "--no-figures"]) == 0
    assert "read as an experiment grid" in capsys.readouterr().out
    assert (tmp_path / "grid" / "report.md").read_text() == build_report(load_results(tmp_path / "grid"))


def test_report_names_what_it_expected_of_another_folder(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a result")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path) in err
    assert "experiment grid" in err and "demo folder" in err and "training run" in err
