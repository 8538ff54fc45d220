"""`iga-ds experiment` for real, shrunk: two cells trained (DeepSpeed ZeRO-2 on the CPU) and
evaluated, a killed cell rerun while the finished one is skipped, then `iga-ds report`."""
from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import pytest
from tiny_models import shrunk_tiny_base_config

from iga_ds.methods import method_class


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_cells_train_evaluate_resume_and_report(tmp_path, monkeypatch, capsys):
    from iga_ds.cli import main
    from iga_ds.experiments.results import load_results
    from iga_ds.train.pretrain import default_tiny_base

    monkeypatch.setenv("IGA_DS_CACHE", str(tmp_path / "cache"))
    shrunk = shrunk_tiny_base_config()
    base = default_tiny_base(shrunk, groups=10, progress=False, log=lambda msg: None)
    logiqa = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks" / "logiqa2"
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent(f"""\
        train:
          model: {{name_or_path: "{base}"}}
          lora: {{r: 2, alpha: 4}}
          data: {{groups_per_step: 2, groups_per_micro_batch: 2, max_length: 192}}
          schedule: {{lr: 2.0e-3, max_steps: 3}}
          logging: {{tensorboard: false, progress: false}}
        data:
          synthetic: {{groups: 30, seed: 2, shortcut: 0.9, id_groups: 2, ood_groups: 2}}
        benchmarks:
          - {{name: logiqa_fixture, benchmark: logiqa2, dir: "{logiqa}", limit: 3}}
        eval: {{max_new_tokens: 16, batch_size: 16, dtype: float32, lcs_layers: [0, 1]}}
        seeds: [0]
        methods:
          iga: {{params: {{tau: 0.5, normalize: mean}}}}
        ablations:
          mean_no_mask: {{method: mean_no_mask}}
        """))
    out = tmp_path / "out"
    args = ["experiment", "--grid", str(grid), "--out", str(out), "--no-progress", "--no-report"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "[1/2] iga-s0: done in" in first and "[2/2] mean_no_mask-s0: done in" in first

    for name in ("iga-s0", "mean_no_mask-s0"):
        cell = out / name
        info = json.loads((cell / "cell.json").read_text())
        assert info["seed"] == 0 and info["steps"] == 3 and info["trainable_params"] > 0
        # every parameter the method ran with, so labels survive a change of the defaults
        if name == "iga-s0":
            assert info["method_params"]["tau"] == 0.5 and info["method_params"]["normalize"] == "mean"
        assert set(info["method_params"]) == set(inspect.signature(method_class(info["train_method"])).parameters) - {"self"}
        assert not (cell / "checkpoints").exists() and (cell / "adapter" / "adapter_config.json").is_file()
        ev = json.loads((cell / "eval" / "synthetic.json").read_text())
        items = ev["items"]
        items = [i for i in items if not i.get("counterfactual")]  # the cue rewrites are scored apart
        assert sum(i["split"] == "id" for i in items) == 2 * 4 and sum(i["split"] == "ood" for i in items) == 2 * 4
        ood = [i["correct"] for i in items if i["split"] == "ood"]
        assert ev["ood_accuracy"] == pytest.approx(100.0 * sum(ood) / len(ood))
        assert info["evaluations"]["synthetic"]["ood_accuracy"] == ev["ood_accuracy"]
        assert set(ev["lcs"]["layers"]) == {"0", "1"} and ev["lcs"]["groups"] == 4
        bench = json.loads((cell / "eval" / "logiqa_fixture.json").read_text())
        assert bench["benchmark"] == "logiqa_fixture" and len(bench["items"]) == 3 and "lcs" not in bench
        steps = [json.loads(line)["step"] for line in (cell / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3]
    resolved = (out / "mean_no_mask-s0" / "config.resolved.yaml").read_text()
    assert "method: mean_no_mask" in resolved and "seed: 0" in resolved
    cells = {c.name: c for c in load_results(out)}
    assert cells["iga-s0"].method == "iga" and cells["iga-s0"].ablation is None
    assert cells["mean_no_mask-s0"].ablation == "mean_no_mask"

    # a killed cell: no marker, a half-written evaluation left behind; the finished one stays
    killed = out / "mean_no_mask-s0"
    (killed / "cell.json").unlink()
    (killed / "eval" / "synthetic.json").write_text("{half")
    kept_eval = (out / "iga-s0" / "eval" / "synthetic.json").stat().st_mtime_ns
    assert main(args) == 0
    second = capsys.readouterr().out
    assert "iga-s0: finished earlier, skipped" in second
    assert "mean_no_mask-s0: no cell.json" in second and "[2/2] mean_no_mask-s0: done in" in second
    assert (out / "iga-s0" / "eval" / "synthetic.json").stat().st_mtime_ns == kept_eval
    rerun = json.loads((killed / "eval" / "synthetic.json").read_text())  # whole again
    assert json.loads((killed / "cell.json").read_text())["evaluations"]["synthetic"]["ood_accuracy"] == \
        rerun["ood_accuracy"]

    # the report reads the folder; its ablation row's OOD entry is the cell's figure
    assert main(["report", str(out), "--no-figures"]) == 0
    report = (out / "report.md").read_text()
    assert "## Main results (paper Table 2)" in report and "## Ablations (paper Table 3)" in report
    row = next(line for line in report.splitlines() if line.startswith("| all domains, plain mean"))
    assert f"{rerun['ood_accuracy']:.1f}" in row


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launcher_trains_a_cell_on_two_processes(tmp_path, monkeypatch, capsys):
    """`--launcher 'torchrun --standalone --nproc_per_node 2'`: the cell trains with world size 2 (gloo on the
    CPU), then is evaluated here; cell.json records both devices."""
    import sys

    from iga_ds.cli import main
    from iga_ds.train.pretrain import default_tiny_base

    monkeypatch.setenv("IGA_DS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    shrunk = shrunk_tiny_base_config()
    base = default_tiny_base(shrunk, groups=10, progress=False, log=lambda msg: None)
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent(f"""\
        train:
          model: {{name_or_path: "{base}"}}
          lora: {{r: 2, alpha: 4}}
          data: {{groups_per_step: 2, groups_per_micro_batch: 1, max_length: 192}}
          schedule: {{max_steps: 2}}
          logging: {{tensorboard: false, progress: false}}
        data:
          synthetic: {{groups: 30, seed: 2, id_groups: 1, ood_groups: 1}}
        eval: {{max_new_tokens: 8, batch_size: 8, dtype: float32, lcs: false}}
        methods:
          iga: {{}}
        """))
    out = tmp_path / "out"
    launcher = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2"
    assert main(["experiment", "--grid", str(grid), "--out", str(out), "--no-progress", "--no-report",
                 "--launcher", launcher]) == 0
    info = json.loads((out / "iga-s0" / "cell.json").read_text())
    assert info["num_devices"] == 2 and info["steps"] == 2 and info["peak_mem_gb"] is None
    assert (out / "iga-s0" / "run.yaml").is_file() and (out / "iga-s0" / "eval" / "synthetic.json").is_file()
    assert "[1/1] iga-s0: done in" in capsys.readouterr().out


def _builtin_tiny_grid(path: Path, tiny: dict) -> Path:
    """Two cells on the built-in tiny base: `iga` on the grid's shape, `longer_base` on a shape
    pretrained one step further (so the grid needs two bases)."""
    shape = json.dumps({**tiny, "corpus_groups": 10})
    path.write_text(textwrap.dedent(f"""\
        train:
          model: {{name_or_path: "builtin:tiny", tiny: {shape}}}
          lora: {{r: 2, alpha: 4}}
          data: {{groups_per_step: 2, groups_per_micro_batch: 2, max_length: 192}}
          schedule: {{max_steps: 2}}
          logging: {{tensorboard: false, progress: false}}
        data:
          synthetic: {{groups: 30, seed: 2, shortcut: 0.9, id_groups: 1, ood_groups: 1}}
        eval: {{max_new_tokens: 8, batch_size: 8, dtype: float32, lcs: false}}
        seeds: [0]
        methods:
          iga: {{}}
        ablations:
          longer_base: {{method: iga, train: {{model: {{tiny: {{steps: {tiny["steps"] + 1}}}}}}}}}
        """))
    return path


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_prepare_makes_the_data_and_every_base_once_and_trains_nothing(tmp_path, monkeypatch, capsys):
    from iga_ds.cli import main
    from tiny_models import SHRUNK_TINY_BASE

    monkeypatch.setenv("IGA_DS_CACHE", str(tmp_path / "cache"))
    grid = _builtin_tiny_grid(tmp_path / "grid.yaml", SHRUNK_TINY_BASE)
    out = tmp_path / "out"
    args = ["experiment", "--grid", str(grid), "--out", str(out), "--prepare", "--no-progress"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.count("pretraining from scratch") == 2 and first.count("tiny base ready:") == 2
    assert (out / "data" / "prepared.json").is_file()
    assert len([p for p in (tmp_path / "cache" / "tiny-base").iterdir() if p.is_dir()]) == 2
    assert not any(out.glob("*/cell.json")) and not (out / "iga-s0").exists()
    assert main(args) == 0  # everything cached: nothing is built again
    again = capsys.readouterr().out
    assert "pretraining from scratch" not in again and again.count("tiny base ready:") == 2


def test_grid_parallel_stops_when_it_cannot_list_the_cells(tmp_path):
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    grid = _builtin_tiny_grid(tmp_path / "grid.yaml", {"steps": 1})
    env = dict(os.environ, IGA_DS_CLI=str(tmp_path / "no-such-command"))
    proc = subprocess.run(["bash", str(repo / "launch/grid_parallel.sh"), str(grid), str(tmp_path / "out"), "2"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    # before: "0 cells to run" and exit 0, as if the grid were finished
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "could not list the cells" in proc.stderr and "IGA_DS_CLI" in proc.stderr
    assert "cells to run" not in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_grid_parallel_prepares_then_runs_cells_side_by_side_and_reports(tmp_path):
    import os
    import subprocess
    import sys

    from tiny_models import SHRUNK_TINY_BASE

    repo = Path(__file__).resolve().parents[2]
    grid = _builtin_tiny_grid(tmp_path / "grid.yaml", SHRUNK_TINY_BASE)
    out = tmp_path / "out"
    env = dict(os.environ, IGA_DS_CACHE=str(tmp_path / "cache"), IGA_DS_CLI=f"{sys.executable} -m iga_ds",
               DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(repo / "launch/grid_parallel.sh"), str(grid), str(out), "2"], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "grid_parallel: 2 cells to run, 2 at a time" in proc.stdout
    assert "data and bases ready" in proc.stdout
    prepare_log = (out / "logs" / "prepare.log").read_text()
    assert prepare_log.count("pretraining from scratch") == 2
    for cell in ("iga-s0", "longer_base-s0"):
        assert json.loads((out / cell / "cell.json").read_text())["steps"] == 2
    # the cells found the bases `--prepare` built: a cell whose base key differed would have
    # pretrained (silently) a third one
    assert len([p for p in (tmp_path / "cache" / "tiny-base").iterdir() if p.is_dir()]) == 2
    assert (out / "report.md").is_file()
    # rerun: nothing left to do
    again = subprocess.run(["bash", str(repo / "launch/grid_parallel.sh"), str(grid), str(out), "2"], cwd=repo,
                           env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "0 cells to run" in again.stdout, again.stdout + again.stderr
