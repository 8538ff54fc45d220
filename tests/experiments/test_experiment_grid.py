"""`iga-ds experiment` without training: grid expansion, grid errors, cell run configs, data
transforms, resume decisions (cells replaced by a stand-in), and the shipped grid files."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from iga_ds.errors import ConfigError, UserError
from iga_ds.experiments import experiment as ex

REPO = Path(__file__).resolve().parents[2]
GRIDS = sorted((REPO / "configs" / "experiments").glob("*.yaml"))

GRID = """
train:
  model: {name_or_path: "builtin:tiny"}
  data: {groups_per_step: 4, groups_per_micro_batch: 2}
  schedule: {max_steps: 3}
data:
  synthetic: {groups: 40, seed: 3, id_groups: 2, ood_groups: 2}
seeds: [0, 7]
methods:
  erm: {}
  iga: {params: {tau: 0.5}}
  lora_sft: {method: erm, domains: [math]}
ablations:
  tau_2.0: {params: {tau: 2.0}}
  normalize_snr: {params: {normalize: snr}, label: "normalize = snr"}
"""


def write_grid(tmp_path: Path, text: str = GRID) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_grid_expands_variants_times_seeds_into_stable_names(tmp_path):
    grid = ex.load_grid(write_grid(tmp_path))
    names = [c.name for c in grid.cells()]
    variants = ["erm", "iga", "lora_sft", "tau_2.0", "normalize_snr"]
    # seed-major: a complete first table before the second seed starts
    assert names == [f"{v}-s0" for v in variants] + [f"{v}-s7" for v in variants]
    assert [c.name for c in ex.load_grid(write_grid(tmp_path)).cells()] == names  # stable
    info = {c.name: c.info() for c in grid.cells()}
    assert info["lora_sft-s0"] == {"method": "lora_sft", "seed": 0, "ablation": None, "train_method": "erm"}
    # an ablation modifies iga unless it names its method; report rows group by label
    assert info["tau_2.0-s7"] == {"method": "iga", "seed": 7, "ablation": "tau_2.0", "train_method": "iga"}
    assert info["normalize_snr-s0"]["label"] == "normalize = snr"


def test_a_benchmark_dir_is_a_path_beside_the_grid_or_a_hub_id(tmp_path):
    (tmp_path / "reclor").mkdir()
    text = GRID.replace("seeds: [0, 7]", "seeds: [0]\nbenchmarks: [{benchmark: reclor, dir: reclor}, "
                        "{benchmark: arb, dir: \"org/arb-copy:law\", name: arb_law}]")
    grid = ex.load_grid(write_grid(tmp_path, text))
    dirs = {b["name"]: b["dir"] for b in grid.benchmarks}
    assert dirs == {"reclor": str(tmp_path / "reclor"), "arb_law": "org/arb-copy:law"}


def test_every_cell_gets_its_own_run_config(tmp_path):
    grid = ex.load_grid(write_grid(tmp_path))
    cells = {c.name: c for c in grid.cells()}
    run = ex.cell_run_dict(grid, cells["tau_2.0-s7"], tmp_path / "out" / "tau_2.0-s7", "fit.jsonl")
    assert run["output_dir"] == str(tmp_path / "out" / "tau_2.0-s7")
    assert run["method"] == {"name": "iga", "params": {"tau": 2.0}}
    assert run["seed"] == 7 and run["resume"] == "never" and run["data"]["train"] == "fit.jsonl"
    assert run["schedule"]["max_steps"] == 3
    lora_sft = ex.cell_run_dict(grid, cells["lora_sft-s0"], tmp_path / "c", "fit.jsonl")
    assert lora_sft["data"]["domains"] == ["math"] and lora_sft["method"]["name"] == "erm"
    assert "domains" not in grid.run.get("data", {})  # no variant leaks into the shared settings


def test_ungrouped_training_keeps_the_number_of_sequences_per_step(tmp_path):
    grid = ex.load_grid(write_grid(tmp_path, GRID + "  cot_distill: {method: erm, grouping: none}\n"))
    cell = next(c for c in grid.cells() if c.variant.key == "cot_distill")
    run = ex.cell_run_dict(grid, cell, tmp_path / "c", "t.jsonl")
    # four domains x 4 groups per step = 16 single instances per step
    assert run["data"]["domains"] == [ex.POOLED_DOMAIN]
    assert run["data"]["groups_per_step"] == 16 and run["data"]["groups_per_micro_batch"] == 8


@pytest.mark.parametrize(
    "edit, key",
    [
        (("methods:", "methods:\n  bogus_method: {}"), "methods.bogus_method.method"),
        (("iga: {params: {tau: 0.5}}", "iga: {params: {tau: 0.5, colour: red}}"), "methods.iga.params"),
        (("iga: {params: {tau: 0.5}}", "iga: {params: 3}"), "methods.iga.params"),
        (("iga: {params: {tau: 0.5}}", "iga: {pairs: random}"), "methods.iga.pairs"),
        (("tau_2.0: {params: {tau: 2.0}}", "tau_2.0: {params: {tau: 2.0}, pairing: shuffled}"), "ablations.tau_2.0.pairing"),
        (("tau_2.0: {params: {tau: 2.0}}", "tau_2.0: {grouping: none}"), "ablations.tau_2.0.grouping"),
        (("tau_2.0: {params: {tau: 2.0}}", "tau_2.0: {domains: [math]}"), "ablations.tau_2.0.domains"),
        (("tau_2.0: {params: {tau: 2.0}}", "erm: {}"), "ablations.erm"),
        (("seeds: [0, 7]", "seeds: [0, 0]"), "seeds"),
        (("seeds: [0, 7]", "seeds: 3"), "seeds"),
        (("seeds: [0, 7]", "seeds: [0]\neval: {batch_size: 0}"), "eval.batch_size"),
        (("seeds: [0, 7]", "seeds: [0]\neval: {lcs_layers: penultimate}"), "eval.lcs_layers"),
        (("seeds: [0, 7]", "seeds: [0]\nbenchmarks: [{benchmark: logiqa2}]"), "benchmarks[0].dir"),
        (("id_groups: 2", "id_groups: 2, shortcut: 1.5"), "data.synthetic.shortcut"),
        (("id_groups: 2", "id_groups: 2, colour: red"), "data.synthetic.colour"),
        (("max_steps: 3", "max_steps: soon"), "schedule.max_steps"),
        (("lora_sft: {method: erm, domains: [math]}", "lora_sft: {method: erm, train: {lora: {r: 0}}}"),
         "methods.lora_sft: run config: lora.r"),
        (("seeds: [0, 7]", "seeds: [0]\nmodels: [a]"), "models: unknown key"),
        (("id_groups: 2", "id_groups: 2, test_cue: sometimes"), "data.synthetic.test_cue"),
        (("id_groups: 2", "id_groups: 2, shortcut_by_domain: {math: 1.0, medical: 0.9, legal: 0.7, art: 0.3}"),
         "data.synthetic.shortcut_by_domain.art"),
        (("id_groups: 2", "id_groups: 2, shortcut_by_domain: {math: 1.0, medical: 0.9, legal: 0.7, science: 2}"),
         "data.synthetic.shortcut_by_domain.science"),
        (("id_groups: 2", "id_groups: 2, shortcut_by_domain: {math: 1.0}"), "data.synthetic.shortcut_by_domain"),
        (("seeds: [0, 7]", "seeds: [0]\nselection: {lr: [0.001, 0.001]}"), "selection.lr"),
        (("seeds: [0, 7]", "seeds: [0]\nselection: {seeds: [0]}"), "selection.lr"),
        (("seeds: [0, 7]", "seeds: [0]\nselection: {lr: [0.001], metric: ood_accuracy}"), "selection.metric"),
        (("seeds: [0, 7]", "seeds: [0]\nselection: {lr: [0.001], max_steps: [0]}"), "selection.max_steps"),
    ],
)
def test_grid_errors_name_the_key(tmp_path, edit, key):
    old, new = edit
    assert old in GRID
    with pytest.raises(ConfigError) as err:
        ex.load_grid(write_grid(tmp_path, GRID.replace(old, new, 1)))
    message = str(err.value)
    assert key in message and str(tmp_path / "grid.yaml") in message and "\n" not in message


def test_missing_data_file_and_bad_yaml_are_clear(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train: .*nowhere.jsonl not found"):
        ex.load_grid(write_grid(tmp_path, "data: {train: nowhere.jsonl}\nmethods: {erm: {}}\n"))
    with pytest.raises(ConfigError, match=r"grid.yaml:\d+: not valid YAML"):
        ex.load_grid(write_grid(tmp_path, "methods:\n  erm: {\n"))


# -- data transforms ---------------------------------------------------------------------------


def _records(groups: int, prefix: str, domains=("math", "medical", "legal", "science")) -> list[dict]:
    return [
        {"group_id": f"{prefix}{g}", "seed_id": f"{prefix}{g}", "domain": d, "problem": f"p {prefix}{g} {d}",
         "cot": "c", "answer": "yes" if g % 2 else "no"}
        for g in range(groups) for d in domains
    ]


def _write(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_ungroup_makes_one_group_per_instance_of_the_chosen_domains():
    records = _records(3, "g")
    out = ex.ungroup(records, ["math", "legal"])
    assert len(out) == 6 and {r["domain"] for r in out} == {ex.POOLED_DOMAIN}
    assert len({r["group_id"] for r in out}) == 6
    assert sorted((r["meta"]["orig_group_id"], r["meta"]["orig_domain"]) for r in out) == sorted(
        (r["group_id"], r["domain"]) for r in records if r["domain"] in ("math", "legal"))


def test_instance_split_leaks_isomers_of_test_instances_into_training(tmp_path):
    text = GRID + "  leak: {method: erm, split: instance, grouping: none}\n"
    grid = ex.load_grid(write_grid(tmp_path, text))
    fit, ids, oods = _records(30, "f"), _records(3, "i"), _records(3, "o")
    prepared = ex.PreparedData(_write(tmp_path / "fit.jsonl", fit), _write(tmp_path / "id.jsonl", ids),
                               _write(tmp_path / "ood.jsonl", oods))
    cell = next(c for c in grid.cells() if c.variant.key == "leak")
    (tmp_path / "cell").mkdir()
    train_file, test_id, test_ood = ex.cell_data(grid, cell, prepared, tmp_path / "cell")
    train = [json.loads(x) for x in Path(train_file).read_text().splitlines()]
    trained = {(r["meta"]["orig_group_id"], r["meta"]["orig_domain"]) for r in train}
    tested = {(r["group_id"], r["domain"]) for r in test_id + test_ood}
    assert not trained & tested  # no test instance itself is trained on ...
    trained_groups = {g for g, _ in trained}
    assert any(g in trained_groups for g, _ in tested)  # ... but isomers of test instances are
    assert {g[0] for g, _ in ((r["group_id"], 0) for r in test_ood)} <= {"o"}
    assert all(not r["group_id"].startswith("o") for r in test_id)
    assert len(test_id) <= len(ids) and len(test_ood) <= len(oods)
    assert len(train) + len(tested) <= len(fit) + len(ids) + len(oods)


def test_random_pairing_cell_trains_on_fake_groups(tmp_path):
    grid = ex.load_grid(write_grid(tmp_path, GRID + "  random_pairing: {pairing: random}\n"))
    fit = _records(8, "f")
    prepared = ex.PreparedData(_write(tmp_path / "fit.jsonl", fit), None, None)
    cell = next(c for c in grid.cells() if c.variant.key == "random_pairing")
    (tmp_path / "cell").mkdir()
    train_file, _, _ = ex.cell_data(grid, cell, prepared, tmp_path / "cell")
    train = [json.loads(x) for x in Path(train_file).read_text().splitlines()]
    assert len(train) == len(fit) and all(r["group_id"].startswith("pair-") for r in train)
    by_group: dict[str, set] = {}
    for r in train:
        by_group.setdefault(r["group_id"], set()).add(r["meta"]["orig_group_id"])
    assert any(len(origins) > 1 for origins in by_group.values())  # groups mix logical problems
    # an unmodified cell trains on the shared file itself
    plain = next(c for c in grid.cells() if c.variant.key == "erm")
    assert ex.cell_data(grid, plain, prepared, tmp_path / "cell")[0] == prepared.train


# -- resume decisions, with a stand-in for training and evaluation ---------------------------------


def _fake_run_cell(calls):
    def run_cell(grid, cell, out, prepared, progress=True, launcher=None):
        calls.append(cell.name)
        folder = out / cell.name
        folder.mkdir(parents=True)
        (folder / "scratch.txt").write_text("work in progress")
        (folder / "cell_spec.json").write_text(json.dumps(grid.cell_spec(cell), default=str))  # as run_cell does
        info = {**cell.info(), "spec_hash": ex._spec_hash(grid.cell_spec(cell)), "evaluations": {}}
        (folder / ex.MARKER).write_text(json.dumps(info))
        return info

    return run_cell


def test_finished_cells_are_skipped_and_killed_ones_wiped_and_rerun(tmp_path, monkeypatch, capsys):
    grid = ex.load_grid(write_grid(tmp_path, GRID.replace("seeds: [0, 7]", "seeds: [0]")))
    out = tmp_path / "out"
    calls: list[str] = []
    monkeypatch.setattr(ex, "run_cell", _fake_run_cell(calls))
    monkeypatch.setattr(ex, "prepare_data", lambda grid, out, log=print: None)
    ex.run_grid(grid, out, report=False)
    assert calls == [c.name for c in grid.cells()]
    # a killed cell: folder without marker, with leftovers
    (out / "iga-s0" / ex.MARKER).unlink()
    (out / "iga-s0" / "leftover.bin").write_bytes(b"x")
    calls.clear()
    ex.run_grid(grid, out, report=False)
    assert calls == ["iga-s0"]
    assert not (out / "iga-s0" / "leftover.bin").exists()
    lines = capsys.readouterr().out.splitlines()
    assert any("erm-s0: finished earlier, skipped" in line for line in lines)
    assert any("iga-s0: no cell.json" in line and "wiping" in line for line in lines)
    assert all(ex.cell_status(grid, c, out) == "done" for c in grid.cells())
    # --only restricts the cells
    calls.clear()
    (out / "erm-s0" / ex.MARKER).unlink()
    (out / "iga-s0" / ex.MARKER).unlink()
    ex.run_grid(grid, out, only=["iga-*"], report=False)
    assert calls == ["iga-s0"] and ex.cell_status(grid, grid.cells()[0], out) == "partial"


def test_a_finished_cell_of_another_grid_is_not_reused(tmp_path, monkeypatch):
    grid = ex.load_grid(write_grid(tmp_path, GRID.replace("seeds: [0, 7]", "seeds: [0]")))
    out = tmp_path / "out"
    monkeypatch.setattr(ex, "run_cell", _fake_run_cell([]))
    monkeypatch.setattr(ex, "prepare_data", lambda grid, out, log=print: None)
    ex.run_grid(grid, out, report=False)
    changed = ex.load_grid(write_grid(tmp_path, GRID.replace("seeds: [0, 7]", "seeds: [0]")
                                      .replace("max_steps: 3", "max_steps: 4")))
    # the message names the setting that changed
    with pytest.raises(UserError, match=r"erm-s0/cell.json: this cell was finished with other settings .*"
                                        r"\(run\.schedule\.max_steps: was 3, now 4\)"):
        ex.run_grid(changed, out, report=False)


def test_a_grid_resumes_in_another_checkout(tmp_path, monkeypatch):
    """Cells record paths relative to the grid file: a grid and its results moved together (another
    clone, another machine) are still finished, while another DeepSpeed file is a change."""
    import shutil

    from iga_ds.config.deepspeed import default_ds_config

    text = GRID.replace("seeds: [0, 7]", "seeds: [0]").replace("train:\n", "train:\n  deepspeed: ds/zero2.json\n", 1)
    for checkout in ("a", "b"):
        (tmp_path / checkout / "ds").mkdir(parents=True)
        shutil.copy(default_ds_config(), tmp_path / checkout / "ds" / "zero2.json")
        write_grid(tmp_path / checkout, text)
    monkeypatch.setattr(ex, "run_cell", _fake_run_cell([]))
    monkeypatch.setattr(ex, "prepare_data", lambda grid, out, log=print: None)
    first = ex.load_grid(tmp_path / "a" / "grid.yaml")
    ex.run_grid(first, tmp_path / "a" / "out", report=False)
    assert str(tmp_path) not in (tmp_path / "a" / "out" / "erm-s0" / "cell_spec.json").read_text()
    shutil.move(tmp_path / "a" / "out", tmp_path / "b" / "out")
    moved = ex.load_grid(tmp_path / "b" / "grid.yaml")
    assert all(ex.cell_status(moved, c, tmp_path / "b" / "out") == "done" for c in moved.cells())
    other = ex.load_grid(write_grid(tmp_path / "b", text.replace("ds/zero2.json", str(default_ds_config()))))
    with pytest.raises(UserError, match=r"\(run\.deepspeed: was 'ds/zero2.json', now '.*/ds_configs/[a-z0-9_]+\.json'\)"):
        ex.cell_status(other, other.cells()[0], tmp_path / "b" / "out")


def test_dry_run_lists_cells_with_their_state(tmp_path, capsys):
    from iga_ds.cli import main

    path = write_grid(tmp_path)
    (tmp_path / "out" / "iga-s0").mkdir(parents=True)
    assert main(["experiment", "--grid", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "10 cells"
    state = {line.split()[0]: line.split()[1] for line in lines[:-1]}
    assert state["iga-s0"] == "partial" and state["erm-s0"] == "todo"
    assert main(["experiment", "--grid", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)]) == 2
    assert "grid file not found" in capsys.readouterr().err


# -- the shipped grid files --------------------------------------------------------------------


def test_grid_files_are_shipped():
    assert {p.name for p in GRIDS} >= {"smoke_cpu.yaml", "baselines.yaml", "ablations.yaml"}


@pytest.mark.parametrize("path", GRIDS, ids=lambda p: p.name)
def test_grid_file_opens_with_its_command_and_loads(path, monkeypatch):
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# iga-ds experiment --grid configs/experiments/{path.name} --out "), first
    monkeypatch.chdir(REPO)
    grid = ex.load_grid(path.relative_to(REPO))
    assert grid.cells()
    raw = yaml.safe_load(path.read_text())
    for key in raw.get("ablations") or {}:
        # the report's ablation table knows these names, or the grid gives the row a label
        from iga_ds.experiments.results import ABLATION_LABELS

        assert key in ABLATION_LABELS or raw["ablations"][key].get("label"), key


def test_baseline_and_ablation_grids_hold_the_paper_rows():
    from iga_ds.experiments.results import ABLATION_LABELS, METHOD_LABELS

    base = ex.load_grid(REPO / "configs/experiments/baselines.yaml")
    keys = {v.key for v in base.variants}
    assert keys == {"erm", "lora_sft", "cot_distill", "irm", "vrex", "pcgrad", "sand_mask", "pareto", "iga"}
    assert keys <= set(METHOD_LABELS) and len(base.seeds) >= 3
    abl = ex.load_grid(REPO / "configs/experiments/ablations.yaml")
    akeys = {v.key for v in abl.variants if v.kind == "ablation"}
    assert set(ABLATION_LABELS) <= akeys
    assert {"normalize_none", "normalize_mean", "normalize_snr"} <= akeys
    assert {v.key for v in abl.variants if v.kind == "method"} == {"erm", "iga"}
    by_key = {v.key: v for v in abl.variants}
    assert by_key["random_pairing"].pairing == "random" and by_key["instance_split"].split == "instance"
    assert by_key["n2"].domains == ("math", "medical") and by_key["single_domain"].domains == ("math",)


@pytest.mark.parametrize("name, answer_only", [("replication.yaml", False), ("replication_answer_only.yaml", True)])
def test_replication_grid_holds_every_paper_row_and_its_control(name, answer_only):
    from iga_ds.experiments.results import ABLATION_LABELS

    base = ex.load_grid(REPO / "configs/experiments/baselines.yaml")
    rep = ex.load_grid(REPO / "configs/experiments" / name)
    methods = {v.key: v for v in rep.variants if v.kind == "method"}
    ablations = {v.key: v for v in rep.variants if v.kind == "ablation"}
    assert {v.key for v in base.variants} <= set(methods) and len(rep.seeds) >= 3
    assert methods["erm_no_shortcut"].cue == "neutral" and methods["erm_no_shortcut"].method == "erm"
    # the IGA row: the shipped defaults; the archived first run's grid kept normalize: mean, its
    # Full IGA row then being the normalize_mean row
    assert set(ABLATION_LABELS) - {"normalize_mean"} <= set(ablations)
    assert methods["iga"].params == ({"tau": 0.5, "normalize": "mean"} if answer_only else {})
    taus = {v.params.get("tau", 0.5) for v in ablations.values() if v.key.startswith("tau_")}
    assert len(taus | {methods["iga"].params.get("tau", 0.5)}) >= 4
    assert rep.data["synthetic"]["shortcut"] > 0 and rep.data["synthetic"]["answer_only"] is answer_only
    if not answer_only:  # chain-of-thought targets: room to decode the longest solution
        assert rep.eval.max_new_tokens >= 48


def test_dry_run_into_a_closed_pipe_stops_quietly(tmp_path):
    import subprocess
    import sys

    cmd = (f"'{sys.executable}' -m iga_ds experiment --grid configs/experiments/replication.yaml "
           f"--out '{tmp_path / 'out'}' --dry-run | head -n 1")
    proc = subprocess.run(["bash", "-c", cmd + "; exit ${PIPESTATUS[0]}"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.startswith("erm-s0")
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
    assert proc.returncode in (0, 141)  # 141 when the pipe closed before the listing ended


# -- the selection stage -----------------------------------------------------------------------

SELECTING = GRID.replace("seeds: [0, 7]", "seeds: [0, 7]\nselection: {lr: [1.0e-3, 2.0e-3, 5.0e-4], seeds: [0, 1]}")


def _scoring_run_cell(calls, score):
    """A stand-in for training: its ID accuracy is ``score(variant key, lr)``."""
    def run_cell(grid, cell, out, prepared, progress=True, launcher=None, validation_only=False):
        calls.append((cell.name, validation_only, cell.variant.train.get("schedule", {}).get("lr")))
        folder = out / cell.name
        folder.mkdir(parents=True)
        lr = cell.variant.train.get("schedule", {}).get("lr")
        evals = {"synthetic": {"id_accuracy": score(cell.variant.key, lr), "ood_accuracy": None}}
        info = {**cell.info(), "spec_hash": ex._spec_hash(grid.cell_spec(cell)), "evaluations": evals}
        (folder / ex.MARKER).write_text(json.dumps(info))
        return info

    return run_cell


def test_selection_runs_first_on_id_data_and_each_row_trains_at_its_choice(tmp_path, monkeypatch):
    grid = ex.load_grid(write_grid(tmp_path, SELECTING))
    assert grid.selection.candidates() == [{"lr": 5e-4}, {"lr": 1e-3}, {"lr": 2e-3}]
    out, calls = tmp_path / "out", []
    # erm: best at 2e-3; iga: 1e-3 and 2e-3 tie, so the smaller wins; the rest: all equal, the smallest
    scores = {"erm": {5e-4: 50, 1e-3: 60, 2e-3: 70}, "iga": {5e-4: 50, 1e-3: 80, 2e-3: 80}}
    score = lambda key, lr: scores.get(key.split("_lr")[0], {}).get(lr, 40.0)  # noqa: E731
    monkeypatch.setattr(ex, "run_cell", _scoring_run_cell(calls, score))
    monkeypatch.setattr(ex, "prepare_data", lambda grid, out, log=print: None)
    assert ex.cell_status(grid, grid.cells()[0], out) == "waiting"
    ex.run_grid(grid, out, only=["erm-*", "iga-*"], report=False)
    selected = [c for c in calls if c[1]]
    assert {name for name, _, _ in selected} == {f"{k}_lr{lr:g}-s{s}" for k in ("erm", "iga")
                                                   for lr in (5e-4, 1e-3, 2e-3) for s in (0, 1)}
    assert calls.index(selected[-1]) < min(i for i, c in enumerate(calls) if not c[1])  # selection first
    chosen = json.loads((out / ex.SELECTION_FILE).read_text())["rows"]
    assert chosen["erm"]["chosen"] == {"lr": 2e-3} and chosen["iga"]["chosen"] == {"lr": 1e-3}
    assert "chosen" not in chosen["lora_sft"]  # its candidates did not run
    main = {name: lr for name, v, lr in calls if not v}
    assert main == {"erm-s0": 2e-3, "erm-s7": 2e-3, "iga-s0": 1e-3, "iga-s7": 1e-3}
    assert ex.cell_status(grid, grid.cells()[0], out) == "done"
    assert ex.cell_status(grid, next(c for c in grid.cells() if c.variant.key == "lora_sft"), out) == "waiting"
    with pytest.raises(UserError, match="lora_sft has no selected schedule"):
        ex.selected_grid(grid, out, ["lora_sft"])
    # the candidates alone, by pattern; then the report lists every candidate tried
    calls.clear()
    ex.run_grid(grid, out, only=["selection/lora_sft_*"], report=False)
    assert len(calls) == 6 and all(v for _, v, _ in calls)
    assert json.loads((out / ex.SELECTION_FILE).read_text())["rows"]["lora_sft"]["chosen"] == {"lr": 5e-4}


def test_a_row_with_its_own_learning_rates_is_selected_among_them(tmp_path, monkeypatch):
    text = SELECTING.replace("lora_sft: {method: erm, domains: [math]}",
                             "lora_sft: {method: erm, domains: [math]}\n  sgd: {method: erm, selection_lr: [0.2, 0.05], "
                             "train: {schedule: {optimizer: sgd}}}")
    grid = ex.load_grid(write_grid(tmp_path, text))
    sgd = next(v for v in grid.variants if v.key == "sgd")
    assert grid.selection.candidates(sgd) == [{"lr": 0.05}, {"lr": 0.2}]
    out, calls = tmp_path / "out", []
    monkeypatch.setattr(ex, "run_cell", _scoring_run_cell(calls, lambda key, lr: 90.0 if lr == 0.2 else 10.0))
    monkeypatch.setattr(ex, "prepare_data", lambda grid, out, log=print: None)
    ex.run_grid(grid, out, only=["sgd-*"], report=False)
    assert {name for name, v, _ in calls if v} == {f"sgd_lr{lr:g}-s{s}" for lr in (0.05, 0.2) for s in (0, 1)}
    assert json.loads((out / ex.SELECTION_FILE).read_text())["rows"]["sgd"]["chosen"] == {"lr": 0.2}
    assert {name: lr for name, v, lr in calls if not v} == {"sgd-s0": 0.2, "sgd-s7": 0.2}
    with pytest.raises(ConfigError, match="methods.sgd.selection_lr: names candidates, but the grid has no selection"):
        ex.load_grid(write_grid(tmp_path, text.replace("selection: {lr: [1.0e-3, 2.0e-3, 5.0e-4], seeds: [0, 1]}", "")))


def test_selection_report_lists_every_candidate():
    from iga_ds.experiments.paired import selection_section

    text = "\n".join(selection_section({"metric": "id_accuracy", "seeds": [0], "rule": "highest",
                                        "rows": {"erm": {"candidates": [{"lr": 5e-4, "id_accuracy": 50.0},
                                                                        {"lr": 1e-3, "id_accuracy": None}],
                                                         "chosen": {"lr": 5e-4}}}}))
    assert "| erm | lr 0.0005 | 50.0 | chosen |" in text and "| erm | lr 0.001 | – |  |" in text


def test_the_new_synthetic_keys_pass_through(tmp_path):
    text = GRID.replace("id_groups: 2", "id_groups: 2, test_cue: adversarial, "
                        "shortcut_by_domain: {science: 0.3, math: 1, medical: 0.9, legal: 0.7}")
    synth = ex.load_grid(write_grid(tmp_path, text)).data["synthetic"]
    assert synth["test_cue"] == "adversarial"
    assert synth["shortcut_by_domain"] == {"math": 1.0, "medical": 0.9, "legal": 0.7, "science": 0.3}


@pytest.mark.parametrize("name", ["shift_smollm2.yaml", "control_smollm2.yaml"])
def test_shift_and_control_grids_hold_the_rows_and_state_the_rule_first(name):
    path = REPO / "configs/experiments" / name
    grid = ex.load_grid(path)
    header = path.read_text().split("\ntrain:", 1)[0]
    assert "in-distribution accuracy only" in header and "ties go to the smaller" in header
    assert "Every candidate tried and every row is reported" in header
    rows = {v.key: v for v in grid.variants}
    assert rows["erm_sft"].grouping == "none" and rows["erm_sft"].label == "ERM-SFT"
    assert rows["erm_grouped"].grouping == "groups" and rows["control"].cue == "neutral"
    assert rows["control"].grouping == "none" and rows["lora_sft"].domains == ("math",)
    assert {rows[k].params.get("tau", 0.5) for k in ("iga_tau0.25", "iga", "iga_tau1.0")} == {0.25, 0.5, 1.0}
    assert rows["iga_chain_rule_svd"].method == "iga_svd" and rows["iga_chain_rule_svd"].params == {"factors": "chain_rule"}
    assert rows["no_mask"].method == "mean_no_mask" and rows["no_mask"].params == {"projection": "svd", **rows["iga_chain_rule_svd"].params}
    assert grid.seeds == [0, 1, 2, 3, 4] and grid.selection.lr == (5e-4, 1e-3, 2e-3)
    cue = grid.data["synthetic"]["shortcut_by_domain"]
    assert grid.data["synthetic"]["test_cue"] == "independent"
    assert (len(set(cue.values())) == 1) == (name == "control_smollm2.yaml")
    sizes = {k: ex.cell_run_dict(grid, ex.Cell(rows[k], 0), REPO / "c", "t.jsonl")["data"]["groups_per_step"]
             for k in ("erm_grouped_g16", "erm_sft_b64", "erm_sft")}
    assert sizes == {"erm_grouped_g16": 16, "erm_sft_b64": 64, "erm_sft": 16}  # sequences: 64, 64, 16


def test_estimates_scale_finished_cells_by_work_and_the_launch_order_puts_the_longest_first(tmp_path, capsys):
    from iga_ds.cli import main

    text = GRID.replace("  lora_sft: {method: erm, domains: [math]}\n",
                        "  lora_sft: {method: erm, domains: [math]}\n"
                        "  big: {method: erm, train: {data: {groups_per_step: 16}}}\n")
    grid = ex.load_grid(write_grid(tmp_path, text))
    out = tmp_path / "out"
    cells = grid.cells()
    work = {c.name: ex.cell_work(grid, c) for c in cells}
    # 4 groups x 4 domains x 3 steps; lora_sft: one domain; big: 16 groups
    assert (work["erm-s0"], work["lora_sft-s0"], work["big-s0"]) == (48.0, 12.0, 192.0)
    assert ex.cell_estimates(grid, out, [], cells)[0]["erm-s0"] is None  # nothing finished yet
    for name, seconds in (("erm-s0", 24.0), ("iga-s0", 96.0), ("iga-s7", 48.0)):
        (out / name).mkdir(parents=True)
        (out / name / "cell.json").write_text(json.dumps({"wall_time_s": seconds}))
    est, _ = ex.cell_estimates(grid, out, [], cells)
    assert est["erm-s7"] == pytest.approx(24.0)  # its row's 0.5 s per unit of work
    assert est["iga-s7"] == pytest.approx(48.0 * (2.0 + 1.0) / 2)  # the row's mean rate
    assert est["big-s0"] == pytest.approx(192.0 * 1.0)  # no finished cell of its row: the grid's median rate
    names = [c.name for c in cells]
    order = ex.launch_order(["selection/x_lr1-s0", *names], {**est, "selection/x_lr1-s0": 1.0}, work)
    assert order[:3] == ["selection/x_lr1-s0", "big-s0", "big-s7"]
    assert order.index("iga-s0") < order.index("erm-s0")  # 72 s before 24 s
    # nothing known: by work alone, ties in the listing's order
    blank = dict.fromkeys(names)
    assert ex.launch_order(names, blank, work)[:3] == ["big-s0", "big-s7", "erm-s0"]
    assert main(["experiment", "--grid", str(tmp_path / "grid.yaml"), "--out", str(tmp_path / "fresh"),
                 "--dry-run", "--launch-order"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "big-s0" and lines[0].endswith("est -")
