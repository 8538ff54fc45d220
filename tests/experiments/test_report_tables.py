"""`iga-ds report` on a synthetic results folder written here."""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from iga_ds.cli import main
from iga_ds.errors import DataError
from iga_ds.experiments.report import build_report
from iga_ds.experiments.results import load_results

BENCHES = ("logiqa2", "synthetic")
SEEDS = (0, 1, 2)


def _eval(bench: str, id_acc: float, ood_acc: float, lcs: dict[int, float] | None) -> dict:
    out = {
        "schema": "iga-ds.eval/1", "benchmark": bench, "accuracy": (id_acc + ood_acc) / 2,
        "id_accuracy": id_acc, "ood_accuracy": ood_acc, "delta_gap": id_acc - ood_acc,
        "items": [{"id": "x"}],
    }
    if lcs:
        out["lcs"] = {"default_layer": max(lcs), "layers": {str(k): v / 100 for k, v in lcs.items()},
                      "layers_x1e-2": {str(k): v for k, v in lcs.items()}}
    return out


def _write_results(root: Path) -> dict:
    """Cells for ERM, Pareto and IGA x 3 seeds plus one IGA ablation; returns the raw numbers."""
    rng = random.Random(7)
    truth: dict = {}
    plan = [("erm", None, 60.0, 14.0), ("pareto", None, 66.0, 9.0), ("iga", None, 72.0, 3.0),
            ("iga_binary", "iga_binary", 69.0, 4.0)]
    for method, ablation, base_acc, base_lcs in plan:
        for seed in SEEDS:
            cell = root / f"{method}-s{seed}"
            (cell / "eval").mkdir(parents=True)
            wall = rng.uniform(1000, 3000)
            info = {"method": method, "seed": seed, "ablation": ablation, "wall_time_s": wall, "epochs": 1,
                    "peak_mem_gb": 10.0, "trainable_params": 2_000_000}
            (cell / "cell.json").write_text(json.dumps(info))
            for bench in BENCHES:
                id_acc = base_acc + 8 + rng.uniform(-1, 1)
                ood_acc = base_acc + rng.uniform(-1, 1)
                lcs = {1: base_lcs * 0.8 + rng.uniform(0, 0.1), 2: base_lcs + rng.uniform(0, 0.1)} if bench == "synthetic" else None
                (cell / "eval" / f"{bench}.json").write_text(json.dumps(_eval(bench, id_acc, ood_acc, lcs)))
                truth[(method, seed, bench)] = (id_acc, ood_acc, lcs)
            truth[(method, seed, "wall")] = wall
            (cell / "metrics.jsonl").write_text(
                "".join(json.dumps({"step": s, "loss": (1 + 0.1 * seed) / (s + 1), "mask_mean": 1 - 0.01 * s}) + "\n"
                        for s in range(20))
            )
    return truth


def _pm(values) -> str:
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def _row(report: str, label: str, section: str) -> list[str]:
    part = report.split(section, 1)[1]
    line = next(l for l in part.splitlines() if l.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_report_tables_and_figures(tmp_path):
    truth = _write_results(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()

    # Table 2: columns logiqa2 ID, logiqa2 OOD, synthetic ID, synthetic OOD, LCS, Avg gap
    iga = _row(report, "IGA", "## Main results")
    erm = _row(report, "ERM-SFT", "## Main results")
    want_ood = _pm([truth[("iga", s, "logiqa2")][1] for s in SEEDS])
    assert iga[2] == "**" + want_ood.replace(" ±", "** ±")  # best OOD accuracy: bold
    assert erm[2] == _pm([truth[("erm", s, "logiqa2")][1] for s in SEEDS])
    lcs_vals = [truth[("iga", s, "synthetic")][2][2] for s in SEEDS]
    assert iga[5] == f"**{statistics.mean(lcs_vals):.2f}** ± {statistics.stdev(lcs_vals):.2f}"  # lowest LCS: bold
    gaps = [statistics.mean([truth[("erm", s, b)][0] - truth[("erm", s, b)][1] for b in BENCHES]) for s in SEEDS]
    assert erm[6].replace("**", "") == f"{statistics.mean(gaps):.2f} ± {statistics.stdev(gaps):.2f}"
    assert report.index("| ERM-SFT |") < report.index("| Pareto-GS |") < report.index("| IGA |")
    # training loss over the last 10% of 20 logged steps (2 steps), per seed, then over seeds
    final = [statistics.mean((1 + 0.1 * s) / (k + 1) for k in (18, 19)) for s in SEEDS]
    want_loss = f"{statistics.mean(final):.3f} ± {statistics.stdev(final):.3f}"
    assert iga[7] == want_loss  # not bolded: a lower training loss is not better

    # Table 3: the ablation row and its change from full IGA
    abl = _row(report, "binary mask (AND-style)", "## Ablations")
    full = statistics.mean([truth[("iga", s, "logiqa2")][1] for s in SEEDS])
    mine = statistics.mean([truth[("iga_binary", s, "logiqa2")][1] for s in SEEDS])
    assert abl[2] == f"{mine - full:+.1f}"
    assert abl[7] == want_loss
    assert _row(report, "Full IGA", "## Ablations")[2] == "—"
    assert "| ERM-SFT (reference) |" in report

    # Table 4: accuracy per compute-hour = average OOD accuracy / hours per epoch
    eff = _row(report, "Pareto-GS", "## Efficiency")
    per_seed = [
        statistics.mean([truth[("pareto", s, b)][1] for b in BENCHES]) / (truth[("pareto", s, "wall")] / 3600)
        for s in SEEDS
    ]
    assert eff[6].replace("**", "") == f"{statistics.mean(per_seed):.2f} ± {statistics.stdev(per_seed):.2f}"
    assert eff[4] == "2.00 ± 0.00"  # trainable params in millions, the same for every seed
    assert eff[1] == "–"  # no step times in these training logs

    # Table 6 and its IGA / ERM ratio
    ratio = _row(report, "IGA / ERM ratio", "## LCS by layer")
    iga2 = statistics.mean(truth[("iga", s, "synthetic")][2][2] for s in SEEDS)
    erm2 = statistics.mean(truth[("erm", s, "synthetic")][2][2] for s in SEEDS)
    assert ratio[2] == f"{iga2 / erm2:.2f}"
    assert "| Method | Layer 1 | Layer 2 |" in report  # no hidden state 0 computed, no embeddings label

    for name in ("ood_accuracy", "lcs_layers", "mask_stats", "ood_vs_time"):
        png = tmp_path / "figures" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"figures/{name}.png" in report


def test_single_seed_and_missing_values(tmp_path):
    cell = tmp_path / "a"
    cell.mkdir()
    (cell / "cell.json").write_text(json.dumps({"method": "iga", "seed": 0}))
    (cell / "eval.json").write_text(json.dumps({"benchmark": "synthetic", "accuracy": 50.0, "id_accuracy": 50.0,
                                                "ood_accuracy": None, "delta_gap": None}))
    report = build_report(load_results(tmp_path))
    row = _row(report, "IGA", "## Main results")
    assert row[1:] == ["50.0", "–", "–", "–", "–"]  # one seed: no ± ; no OOD split, LCS or log: dashes
    assert "No ablation runs." in report


def test_report_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "none")]) == 2
    assert "no such results folder" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "cell.json").write_text(json.dumps({"method": "iga", "seed": "zero"}))
    with pytest.raises(DataError, match=r"c/cell.json: field 'seed': expected an integer"):
        load_results(tmp_path)
    (tmp_path / "c" / "cell.json").write_text("{oops")
    assert main(["report", str(tmp_path)]) == 2
    assert "cell.json:1: not valid JSON" in capsys.readouterr().err


# -- shortcut reliance, mask statistics, claims ---------------------------------------------------


def _cue_cells(root: Path) -> dict:
    """ERM, IGA and one IGA ablation x 3 seeds on one synthetic evaluation with a cue; IGA logs
    mask statistics. Returns the raw per-seed values."""
    rng = random.Random(3)
    raw: dict = {}
    plan = [("erm", None, 53.0, 97.0), ("iga", None, 60.0, 40.0), ("tau_8.0", "tau_8.0", 60.5, 41.0)]
    for method, ablation, ood, follow in plan:
        for seed in SEEDS:
            cell = root / f"{ablation or method}-s{seed}"
            (cell / "eval").mkdir(parents=True)
            info = {"method": "iga" if ablation else method, "seed": seed, "ablation": ablation,
                    "wall_time_s": 10.0, "epochs": 1}
            (cell / "cell.json").write_text(json.dumps(info))
            o, f = ood + rng.uniform(-0.5, 0.5), follow + rng.uniform(-0.5, 0.5)
            ev = _eval("synthetic", 89.0, o, None) | {"ood_cue_follow": f}
            (cell / "eval" / "synthetic.json").write_text(json.dumps(ev))
            masks = [rng.uniform(0.5, 1.0) for _ in range(20)] if method == "iga" or ablation else []
            rows = [{"step": s + 1, "step_time_s": 0.01 * (s + 1), **({"hook.mask_mean": m} if masks else {})}
                    for s, m in enumerate(masks or [None] * 20)]
            (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            raw[(ablation or method, seed)] = (o, f, masks)
    return raw


def test_report_shows_cue_following_mask_statistics_and_claims(tmp_path):
    raw = _cue_cells(tmp_path)
    report = build_report(load_results(tmp_path), title="Replication", discussion="## Discussion\n\nText.")
    assert report.startswith("# Replication\n") and report.rstrip().endswith("Text.")
    iga = _row(report, "IGA", "## Main results")
    assert iga[3] == "**" + _pm([raw[("iga", s)][1] for s in SEEDS]).replace(" ±", "** ±")  # lower is better
    # mask table: mean over all steps and over the last 10% (2 of 20 steps), per seed, then over seeds
    row = _row(report, "IGA", "## Mask statistics")
    assert row[1] == f"{statistics.mean(statistics.mean(raw[('iga', s)][2]) for s in SEEDS):.3f} ± " \
                     f"{statistics.stdev(statistics.mean(raw[('iga', s)][2]) for s in SEEDS):.3f}"
    assert row[2].startswith(f"{statistics.mean(statistics.mean(raw[('iga', s)][2][-2:]) for s in SEEDS):.3f}")
    assert "ERM-SFT |" not in report.split("## Mask statistics")[1].split("##")[0]
    claims = report.split("## The paper's claims")[1]
    follow = _row(claims, "synthetic OOD follows wrong cue", "IGA against ERM-SFT")
    d = statistics.mean(raw[("iga", s)][1] for s in SEEDS) - statistics.mean(raw[("erm", s)][1] for s in SEEDS)
    assert follow[3] == f"{d:+.1f}" and follow[5] == "better"
    ood = _row(claims, "synthetic OOD accuracy", "IGA against ERM-SFT")
    assert ood[5] == "better"
    # Full IGA against tau = 8.0: half a point apart with seed noise of the same size
    abl = _row(claims, "tau_8.0", "Full IGA against")
    assert abl[4] == "no difference at this size"


def test_compare_counts_a_difference_beyond_twice_its_standard_error():
    from iga_ds.experiments.report import compare

    a, b = [10.0, 11.0, 12.0], [5.0, 6.0, 7.0]
    verdict, diff, se = compare(a, b, higher_is_better=True)
    assert verdict == "better" and diff == 5.0 and abs(se - (2 * 1.0 / 3) ** 0.5) < 1e-12
    assert compare(a, b, higher_is_better=False)[0] == "worse"
    assert compare([10.0, 12.0, 14.0], [9.0, 11.0, 13.0], True)[0] == "no difference at this size"
    assert compare([1.0], [2.0], True)[0] == "one seed: not judged"
    assert compare([None], [2.0, 3.0], True)[0] == "not measured"


def test_report_title_survives_the_figures(tmp_path):
    _cue_cells(tmp_path / "r")
    assert main(["report", str(tmp_path / "r"), "--title", "My grid", "--out", str(tmp_path / "R.md")]) == 0
    text = (tmp_path / "R.md").read_text()
    assert text.startswith("# My grid\n") and "](figures/" in text


def test_report_discussion_file_must_exist(tmp_path, capsys):
    _cue_cells(tmp_path / "r")
    assert main(["report", str(tmp_path / "r"), "--no-figures", "--discussion", str(tmp_path / "none.md")]) != 0
    assert "none.md: discussion file not found" in capsys.readouterr().err


def test_mask_figure_series_is_the_seed_mean_then_a_trailing_average():
    from iga_ds.experiments.figures import _seed_mean_series
    from iga_ds.experiments.results import Cell

    a = [0.2, 0.4, 0.9, 0.5, 0.3]
    b = [0.6, 0.0, 0.1, 0.7]  # one step fewer: the last step averages one seed only
    cells = [Cell(f"c{i}", "iga", i, None, "IGA", {},
                  metrics=[{"step": s + 1, "hook.mask_mean": v} for s, v in enumerate(vals)])
             for i, vals in enumerate((a, b))]
    xs, ys = _seed_mean_series(cells, "hook.mask_mean", window=2)
    means = [(a[i] + b[i]) / 2 if i < len(b) else a[i] for i in range(len(a))]
    want = [means[0]] + [(means[i - 1] + means[i]) / 2 for i in range(1, len(means))]
    assert xs == [1, 2, 3, 4, 5] and max(abs(y - w) for y, w in zip(ys, want)) < 1e-12


def test_the_iga_row_compared_is_the_one_at_the_shipped_defaults_and_labels_follow_recorded_params(tmp_path):
    """The claims table takes the IGA row whose parameters are all the shipped defaults, whatever
    its label; a cell that recorded its parameters is labelled by them, not by the defaults of
    the package reading it."""
    from iga_ds.methods.iga.common import DEFAULT_TAU

    plan = {  # key: (label given, params the row gave, params the run recorded, OOD accuracy)
        "erm_sft": ("ERM-SFT", {}, None, 50.0),
        "iga_svd": ("IGA (the earlier map)", {"projection": "svd"}, None, 40.0),
        "iga_named": ("IGA (tau as shipped)", {"tau": DEFAULT_TAU}, None, 60.0),
        "iga": (None, {}, {"tau": DEFAULT_TAU / 2}, 45.0),  # the key names the row: "IGA"
    }
    for key, (label, params, recorded, ood) in plan.items():
        for seed in SEEDS:
            cell = tmp_path / f"{key}-s{seed}"
            (cell / "eval").mkdir(parents=True)
            method = "erm" if key == "erm_sft" else "iga"
            info = {"method": key, "train_method": method, "seed": seed, "ablation": None, "wall_time_s": 1.0,
                    **({"label": label} if label else {}), **({"method_params": recorded} if recorded else {})}
            (cell / "cell.json").write_text(json.dumps(info))
            variant = {"key": key, "method": method, "params": params, "label": label}
            (cell / "cell_spec.json").write_text(json.dumps({"variant": variant, "seed": seed}))
            (cell / "eval" / "synthetic.json").write_text(json.dumps(_eval("synthetic", 80.0, ood + seed, None)))
    report = build_report(load_results(tmp_path))
    assert "| IGA (tau as shipped) against ERM-SFT |" in report
    assert f"| IGA (tau: {DEFAULT_TAU / 2}) |" in report  # from the recorded parameters


def test_a_runs_mask_figure_says_what_each_panel_measures(tmp_path, monkeypatch):
    """A training run's figure (`iga-ds report RUN`): each panel titled with what it measures
    (not the log's key) and a y axis label, no "mean over seeds" for its one seed, and each line
    the statistic's trailing average (it had raw keys for titles and no y labels)."""
    from iga_ds.experiments import figures
    from iga_ds.experiments.results import Cell

    mean = [0.9, 0.7, 0.6, 0.55, 0.5, 0.52]
    metrics = [{"step": s + 1, "loss": 1.0, "hook.mask_mean": v, "hook.mask_min": 0.0,
                "hook.mask_frac_below_half": 1.0 - v} for s, v in enumerate(mean)]
    drawn = {}

    def keep(fig, path):  # what the figure holds, read before it is closed
        drawn["suptitle"] = fig._suptitle.get_text()
        drawn["panels"] = [(ax.get_title(), ax.get_ylabel(), [line.get_ydata().tolist() for line in ax.lines])
                           for ax in fig.axes]
        return str(path)

    monkeypatch.setattr(figures, "_save", keep)
    cell = Cell("run", "iga", 0, None, "IGA (tau: 0.5)", {}, metrics=metrics)
    assert figures.run_mask_figure(cell, tmp_path / "mask_stats.png", window=2) is not None
    assert "IGA (tau: 0.5)" in drawn["suptitle"] and "seeds" not in drawn["suptitle"], drawn["suptitle"]
    titles = [title for title, _, _ in drawn["panels"]]
    assert len(titles) == 3 and not any("mask_" in t or "hook." in t for t in titles), titles
    assert all(ylabel for _, ylabel, _ in drawn["panels"]), drawn["panels"]
    trailing = [mean[0]] + [(mean[i - 1] + mean[i]) / 2 for i in range(1, len(mean))]
    plotted = dict(zip(("frac_below_half", "mean", "min"), (lines[0] for _, _, lines in drawn["panels"])))
    assert max(abs(a - b) for a, b in zip(plotted["mean"], trailing)) < 1e-12
    assert max(abs(a - (1 - b)) for a, b in zip(plotted["frac_below_half"], trailing)) < 1e-12
