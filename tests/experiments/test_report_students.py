"""The report's update-size table against ERM-SFT, and several results folders side by side."""
from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from iga_ds.errors import DataError
from iga_ds.experiments.report import build_report, write_report
from iga_ds.experiments.results import load_results

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (0, 1, 2)
MODULES = [f"base_model.model.model.layers.{layer}.self_attn.{kind}"
           for layer in (0, 1) for kind in ("q_proj", "k_proj", "v_proj", "o_proj")]


def _cell(root: Path, name: str, method: str, seed: int, ood: float, ablation: str | None = None,
          label: str | None = None, norms: dict | None = None, follow: float | None = None) -> None:
    folder = root / name
    (folder / "eval").mkdir(parents=True)
    info = {"method": method, "seed": seed, "ablation": ablation, **({"label": label} if label else {})}
    (folder / "cell.json").write_text(json.dumps(info))
    result = {"benchmark": "synthetic", "id_accuracy": ood + 10, "ood_accuracy": ood, "delta_gap": 10.0}
    if follow is not None:
        result["ood_cue_follow"] = follow
    (folder / "eval" / "synthetic.json").write_text(json.dumps(result))
    if norms is not None:
        (folder / "update_norms.json").write_text(json.dumps({"steps": 600, "modules": norms}))


def _norms(rng: random.Random, scale: float, modules=MODULES) -> dict:
    return {m: {"path": scale * rng.uniform(2, 4), "displacement": scale * rng.uniform(0.5, 1.5)} for m in modules}


def _write_grid(root: Path) -> dict:
    """ERM, IGA, a control and an ablation x 3 seeds with update norms; a LoRA-SFT row without.
    Returns the norms each cell was given."""
    rng = random.Random(11)
    given: dict = {}
    for seed in SEEDS:
        for name, method, ablation, label, scale, modules in [
            ("erm", "erm", None, None, 1.0, MODULES),
            ("control", "erm", None, "ERM-SFT, no shortcut in training (control)", 3.0, MODULES),
            ("iga", "iga", None, None, 0.4, MODULES[:-1]),  # one module fewer: only common modules count
            ("tau_2.0", "iga", "tau_2.0", None, 0.7, MODULES),
        ]:
            given[(name, seed)] = _norms(rng, scale, modules)
            _cell(root, f"{name}-s{seed}", method, seed, 50.0 + seed, ablation, label, given[(name, seed)])
        _cell(root, f"lora_sft-s{seed}", "lora_sft", seed, 45.0)
    return given


def _slow_ratios(mine: dict, erm: dict) -> list[float]:
    """The table's columns for one seed, computed the obvious way."""
    common = sorted(set(mine) & set(erm))
    per_module = sorted(mine[m]["displacement"] / erm[m]["displacement"] for m in common)
    mid = len(per_module) // 2
    median = per_module[mid] if len(per_module) % 2 else (per_module[mid - 1] + per_module[mid]) / 2
    total = math.sqrt(sum(mine[m]["displacement"] ** 2 for m in common)) / math.sqrt(
        sum(erm[m]["displacement"] ** 2 for m in common))
    path = sum(mine[m]["path"] for m in common) / sum(erm[m]["path"] for m in common)
    by_type = []
    for kind in ("q_proj", "k_proj", "v_proj", "o_proj"):
        of_kind = [mine[m]["displacement"] / erm[m]["displacement"] for m in common if m.endswith("." + kind)]
        by_type.append(statistics.median(of_kind))
    return [total, median, per_module[0], per_module[-1], path] + by_type


def _pm(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def _section(report: str, heading: str) -> str:
    return report.split(heading, 1)[1].split("\n#", 1)[0]


def _rows(section: str) -> dict[str, list[str]]:
    lines = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])}


UPDATE_HEADING = "## How far each row moved the adapter, against ERM-SFT"


def test_update_size_ratios_are_the_per_seed_ratios_to_erm_then_mean_and_std(tmp_path):
    given = _write_grid(tmp_path)
    report = build_report(load_results(tmp_path))
    section = _section(report, UPDATE_HEADING)
    assert "learned less" in section  # why the table is there
    header = section.split("| Row |", 1)[1].splitlines()[0]
    assert [h.strip() for h in header.strip("|").split("|")][-4:] == [
        "q_proj, median", "k_proj, median", "v_proj, median", "o_proj, median"]
    rows = _rows(section)
    # main-table rows in their order, then the ablation; the control is a row, never the reference
    assert list(rows) == ["ERM-SFT", "LoRA-SFT", "ERM-SFT, no shortcut in training (control)", "IGA", "tau = 2.0"]
    for name, label in [("iga", "IGA"), ("control", "ERM-SFT, no shortcut in training (control)"),
                        ("tau_2.0", "tau = 2.0")]:
        per_seed = [_slow_ratios(given[(name, s)], given[("erm", s)]) for s in SEEDS]
        assert rows[label] == [_pm([seed[i] for seed in per_seed]) for i in range(9)], label
    assert rows["ERM-SFT"] == ["1.00 ± 0.00"] * 9
    assert rows["LoRA-SFT"] == ["–"] * 9  # no update_norms.json


def test_logged_step_norms_add_a_path_column(tmp_path):
    rng = random.Random(5)
    logged = {}
    for name, method in (("erm", "erm"), ("iga", "iga")):
        _cell(tmp_path, f"{name}-s0", method, 0, 50.0, norms=_norms(rng, 1.0))
        logged[name] = [rng.uniform(0.1, 1.0) for _ in range(10)]
        rows = [{"step": s + 1, "update_norm": v} for s, v in enumerate(logged[name])]
        (tmp_path / f"{name}-s0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = _section(build_report(load_results(tmp_path)), UPDATE_HEADING)
    assert "| Path, logged step norms |" in section
    assert _rows(section)["IGA"][5] == f"{sum(logged['iga']) / sum(logged['erm']):.2f}"  # one seed: no ±


def test_no_update_norms_no_section(tmp_path):
    for seed in SEEDS:
        _cell(tmp_path, f"erm-s{seed}", "erm", seed, 50.0)
        _cell(tmp_path, f"iga-s{seed}", "iga", seed, 55.0)
    assert "moved the adapter" not in build_report(load_results(tmp_path))


@pytest.mark.parametrize("content, field", [
    ("{oops", ":1: not valid JSON"),
    ('{"modules": [1, 2]}', "field 'modules'"),
    ('{"modules": {"m.q_proj": {"path": 1.0}}}', "field 'modules.m.q_proj.displacement'"),
    ('{"modules": {"m.q_proj": {"path": -1.0, "displacement": 1.0}}}', "field 'modules.m.q_proj.path'"),
])
def test_a_malformed_update_norms_file_is_named(tmp_path, content, field):
    _cell(tmp_path, "erm-s0", "erm", 0, 50.0)
    (tmp_path / "erm-s0" / "update_norms.json").write_text(content)
    with pytest.raises(DataError) as err:
        load_results(tmp_path)
    assert "erm-s0/update_norms.json" in str(err.value) and field in str(err.value)


# -- several students ------------------------------------------------------------------------------


def _student(root: Path, ood: dict[str, float], follow: float | None) -> dict:
    """One results folder: per method, per-seed OOD accuracies around ``ood[method]``."""
    rng = random.Random(len(str(root)))
    values = {}
    for method, base in ood.items():
        for seed in SEEDS:
            values[(method, seed)] = base + rng.uniform(-2, 2)
            _cell(root, f"{method}-s{seed}", method, seed, values[(method, seed)],
                  follow=None if follow is None else follow + seed)
    _cell(root, "iga_binary-s0", "iga", 0, 40.0, ablation="iga_binary")
    return values


def _plain(text: str) -> str:
    return text.replace("**", "")


def test_two_students_side_by_side(tmp_path):
    a = _student(tmp_path / "a", {"erm": 50.0, "iga": 60.0}, follow=70.0)
    b = _student(tmp_path / "b", {"erm": 52.0, "pareto": 55.0}, follow=None)
    out = tmp_path / "out" / "students.md"
    write_report([tmp_path / "a", tmp_path / "b"], out, names=["Qwen 0.5B", "Llama-1B"],
                 discussion=None, title="Two students")
    report = out.read_text()
    assert report.startswith("# Two students\n\n2 students")
    assert "Qwen 0.5B (7 runs); Llama-1B (7 runs)" in report
    side = _section(report, "## Side by side")
    header = next(line for line in side.splitlines() if line.startswith("| Method"))
    assert [h.strip() for h in header.strip("|").split("|")] == [
        "Method", "Qwen 0.5B ID", "Qwen 0.5B OOD", "Qwen 0.5B OOD follows wrong cue ↓", "Llama-1B ID", "Llama-1B OOD"]
    rows = _rows(side)
    # the union of the method rows, in the paper's order, then the ablations (both students ran one)
    assert list(rows) == ["ERM-SFT", "Pareto-GS", "IGA", "binary mask (AND-style)"]
    assert [_plain(v) for v in rows["binary mask (AND-style)"]] == ["50.0", "40.0", "–", "50.0", "40.0"]

    def pm(values: dict, method: str, shift: float = 0.0) -> str:
        vals = [values[(method, s)] + shift for s in SEEDS]
        return f"{statistics.mean(vals):.1f} ± {statistics.stdev(vals):.1f}"

    assert [_plain(v) for v in rows["IGA"]] == [pm(a, "iga", 10), pm(a, "iga"), "71.0 ± 1.0", "–", "–"]
    assert [_plain(v) for v in rows["Pareto-GS"]] == ["–", "–", "–", pm(b, "pareto", 10), pm(b, "pareto")]
    assert _plain(rows["ERM-SFT"][4]) == pm(b, "erm")
    # each student's whole report, headings one level down, claims included
    for name in ("Qwen 0.5B", "Llama-1B"):
        body = report.split(f"## Student: {name}\n", 1)[1].split("\n## ", 1)[0]
        assert "\n### Main results (paper Table 2)\n" in body and "\n### Ablations (paper Table 3)\n" in body
    assert "### The paper's claims, checked on these runs" in report.split("## Student: Qwen 0.5B")[1].split(
        "## Student: Llama-1B")[0]  # IGA and ERM-SFT: claims; the other student has no IGA row
    assert report.count("\n# ") == 0 and report.count("## Figures") == 1
    for folder, name in (("qwen-0-5b", "Qwen 0.5B"), ("llama-1b", "Llama-1B")):
        png = out.parent / "figures" / folder / "ood_accuracy.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{name}: OOD accuracy per method](figures/{folder}/ood_accuracy.png)" in report
    assert not (tmp_path / "a" / "report.md").exists()


def _discussion(tmp_path: Path) -> Path:
    path = tmp_path / "discussion.md"
    path.write_text("## Discussion\n\nBoth students learned.\n")
    return path


def test_a_student_report_keeps_the_single_report_body(tmp_path):
    """A student's section is the single-folder report's body with every heading one level down."""
    _student(tmp_path / "a", {"erm": 50.0, "iga": 60.0}, follow=None)
    _student(tmp_path / "b", {"erm": 50.0}, follow=None)
    out = tmp_path / "r.md"
    write_report([tmp_path / "a", tmp_path / "b"], out, figures=False, names=["a", "b"],
                 discussion=_discussion(tmp_path))
    single = build_report(load_results(tmp_path / "a"))
    body = single.split("\n", 2)[2].replace("\n## ", "\n### ")
    report = out.read_text()
    assert f"## Student: a\n\n{body}" in report
    assert report.rstrip().endswith("Both students learned.")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "iga_ds", "report", *args], capture_output=True, text=True,
                          cwd=ROOT)


def test_cli_needs_one_name_per_folder(tmp_path):
    for folder in ("a", "b"):
        _cell(tmp_path / folder, "erm-s0", "erm", 0, 50.0)
    run = _cli(str(tmp_path / "a"), str(tmp_path / "b"), "--name", "only-one", "--out", str(tmp_path / "r.md"))
    assert run.returncode != 0
    assert len(run.stderr.strip().splitlines()) == 1 and "--name" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "r.md").exists()
    run = _cli(str(tmp_path / "a"), str(tmp_path / "b"), "--name", "x", "--name", "y")
    assert run.returncode != 0 and "--out" in run.stderr  # the report belongs to neither folder
    run = _cli(str(tmp_path / "a"), str(tmp_path / "b"), "--name", "x", "--name", "y", "--no-figures",
               "--out", str(tmp_path / "r.md"))
    assert run.returncode == 0, run.stderr
    assert "## Student: x" in (tmp_path / "r.md").read_text()


def test_cli_names_a_malformed_update_norms_file(tmp_path):
    _cell(tmp_path, "erm-s0", "erm", 0, 50.0)
    (tmp_path / "erm-s0" / "update_norms.json").write_text('{"modules": {"m": {"path": "far", "displacement": 1}}}')
    run = _cli(str(tmp_path), "--no-figures")
    assert run.returncode != 0 and len(run.stderr.strip().splitlines()) == 1
    assert "erm-s0/update_norms.json: field 'modules.m.path'" in run.stderr


def test_the_ratios_are_against_the_erm_sft_row_by_its_definition_whatever_its_label(tmp_path):
    """A grid that labels its ERM-SFT row ("ERM-SFT, 64 single instances per step") and records how
    it trained: the table's reference is that row, found by the paper's definition."""
    rng, label, given = random.Random(3), "ERM-SFT, 64 single instances per step", {}
    for seed in SEEDS:
        for name, method, scale in (("erm_sft", "erm", 1.0), ("erm_grouped", "erm", 0.5), ("iga", "iga", 0.3)):
            given[(name, seed)] = _norms(rng, scale)
            named = {"erm_sft": label, "erm_grouped": "ERM, grouped batches"}.get(name)  # no row labelled ERM-SFT
            _cell(tmp_path, f"{name}-s{seed}", method, seed, 50.0, label=named, norms=given[(name, seed)])
            variant = {"method": method, **({"grouping": "none"} if name == "erm_sft" else {})}
            (tmp_path / f"{name}-s{seed}" / "cell_spec.json").write_text(json.dumps({"variant": variant}))
    section = _section(build_report(load_results(tmp_path)), f"## How far each row moved the adapter, against {label}")
    rows = _rows(section)
    assert rows[label] == ["1.00 ± 0.00"] * 9
    per_seed = [_slow_ratios(given[("iga", s)], given[("erm_sft", s)]) for s in SEEDS]
    assert rows["IGA"] == [_pm([seed[i] for seed in per_seed]) for i in range(9)]
