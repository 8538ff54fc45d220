"""The report's wrong-cue following per domain (table, paired differences, figure) against a plain
count over per-item records written here, and its provenance line from cells with and without
``cell.json``'s ``source``."""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from iga_ds.errors import DataError
from iga_ds.evaluation.runner import summarize
from iga_ds.experiments.report import build_report, provenance_line, write_report
from iga_ds.experiments.results import load_results
from iga_ds.metrics.paired import paired_difference

DOMAINS = ("legal", "math", "science")
SEEDS = (0, 1, 2)
GROUPS = 30
# per row: the chance it follows a wrong cue, per domain
PLAN = {"erm": {"legal": 0.9, "math": 1.0, "science": 0.1}, "iga": {"legal": 0.6, "math": 0.9, "science": 0.4}}


def _item_rows(rng: random.Random, follow: dict[str, float]) -> list[dict]:
    """Scored rows as the evaluation runner writes them: ID and OOD items with a planted cue that
    agrees or conflicts with the gold answer, plus counterfactual rewrites (which the per-domain
    share leaves out). The items are the same for every cell, as a grid's are; the answers vary."""
    items = random.Random(5)
    rows = []
    for g in range(GROUPS):
        for domain in DOMAINS:
            for split in ("id", "ood"):
                gold = items.choice(["yes", "no"])
                other = {"yes": "no", "no": "yes"}[gold]
                cue = gold if items.random() < 0.4 else other
                chance = follow[domain] if cue != gold else 0.2  # of answering what the cue signals / a wrong answer
                pred = (cue if cue != gold else other) if rng.random() < chance else gold
                rows.append({"id": f"{split}/g{g}/{domain}", "group_id": f"g{g}", "domain": domain, "split": split,
                             "kind": "text", "gold": gold, "cue_answer": cue, "prediction": pred,
                             "correct": pred == gold, "correct_symbolic": pred == gold})
            wrong = "no" if rows[-1]["gold"] == "yes" else "yes"
            rows.append({"id": f"cf-wrong/g{g}/{domain}", "group_id": f"g{g}", "domain": domain, "split": "ood",
                         "kind": "text", "gold": rows[-1]["gold"], "cue_answer": wrong, "prediction": wrong,
                         "correct": False, "correct_symbolic": False, "counterfactual": "wrong",
                         "of": rows[-1]["id"]})
    return rows


def _follow(rows: list[dict], domain: str | None) -> list[bool] | None:
    """Plainly: on OOD items (no rewrites) whose cue differs from the gold answer, in ``domain``
    (None: every domain), whether the prediction is the cue's answer."""
    return [r["prediction"] == r["cue_answer"] for r in rows
            if r["split"] == "ood" and "counterfactual" not in r and r["cue_answer"] != r["gold"]
            and (domain is None or r["domain"] == domain)]


def _grid(root: Path) -> dict:
    rng = random.Random(11)
    raw = {}
    for method, follow in PLAN.items():
        for seed in SEEDS:
            cell = root / f"{method}-s{seed}"
            (cell / "eval").mkdir(parents=True)
            (cell / "cell.json").write_text(json.dumps({"method": method, "seed": seed}))
            rows = _item_rows(rng, follow)
            result = {"benchmark": "synthetic", **summarize(rows), "items": rows}
            (cell / "eval" / "synthetic.json").write_text(json.dumps(result))
            raw[(method, seed)] = rows
    return raw


def _pm(values) -> str:
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def _table_row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def _share(flags: list[bool]) -> float:
    return 100.0 * sum(flags) / len(flags)


def test_the_per_domain_table_is_the_share_of_wrong_cue_ood_items_answered_as_the_cue(tmp_path):
    raw = _grid(tmp_path)
    report = build_report(load_results(tmp_path))
    section = report.split("## OOD wrong-cue following per domain")[1].split("\n## ")[0]
    assert "| Row | synthetic: all domains | synthetic: legal | synthetic: math | synthetic: science |" in section
    for method, label in (("erm", "ERM-SFT"), ("iga", "IGA")):
        row = _table_row(section, label)
        assert row[1] == _pm([_share(_follow(raw[(method, s)], None)) for s in SEEDS])
        for k, domain in enumerate(DOMAINS):
            assert row[2 + k] == _pm([_share(_follow(raw[(method, s)], domain)) for s in SEEDS]), (label, domain)
    # the pooled column here is the main table's "OOD follows wrong cue", the runner's own figure
    assert _table_row(report.split("## Main results")[1], "IGA")[3].replace("**", "") == _table_row(section, "IGA")[1]


def test_the_paired_per_domain_difference_resamples_groups_of_plainly_counted_items(tmp_path):
    raw = _grid(tmp_path)
    report = build_report(load_results(tmp_path))
    section = report.split("synthetic, per domain: of the OOD items")[1]
    assert "| Row | seeds | Δ legal, points [95% CI] | Δ math, points [95% CI] | Δ science, points [95% CI] |" in section
    assert _table_row(section, "ERM-SFT")[2:] == ["—"] * 3
    iga = _table_row(section, "IGA")
    for k, domain in enumerate(DOMAINS):
        def totals(method):  # seed -> {group: (wrong-cue items followed, wrong-cue items)}
            out = {}
            for seed in SEEDS:
                for r in raw[(method, seed)]:
                    flags = _follow([r], domain)
                    if flags:  # this row is a wrong-cue OOD item of the domain
                        a, b = out.setdefault(seed, {}).get(r["group_id"], (0, 0))
                        out[seed][r["group_id"]] = (a + flags[0], b + 1)
            return out
        point = statistics.mean(_share(_follow(raw[("iga", s)], domain)) - _share(_follow(raw[("erm", s)], domain))
                                for s in SEEDS)
        assert float(iga[2 + k].split(" [")[0]) == pytest.approx(point, abs=0.05 + 1e-9)
        assert iga[2 + k] == paired_difference(totals("iga"), totals("erm")).text(1, True)


def test_the_figure_is_drawn_with_cue_items_and_left_out_without(tmp_path):
    _grid(tmp_path / "cue")
    out = write_report(tmp_path / "cue", log=None)
    png = tmp_path / "cue" / "figures" / "cue_by_domain.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "(figures/cue_by_domain.png)" in out.read_text()
    plain = tmp_path / "plain" / "erm-s0"
    plain.mkdir(parents=True)
    (plain / "cell.json").write_text(json.dumps({"method": "erm", "seed": 0}))
    (plain / "eval.json").write_text(json.dumps({"benchmark": "synthetic", "ood_accuracy": 50.0, "ood_cue_follow": 70.0}))
    text = write_report(tmp_path / "plain", log=None).read_text()
    assert not (tmp_path / "plain" / "figures" / "cue_by_domain.png").exists()
    assert "per domain" not in text  # a pooled share without per-item records: no per-domain table


def _cells(root: Path, sources: list) -> list:
    for i, source in enumerate(sources):
        (root / f"c{i}").mkdir(parents=True)
        info = {"method": "erm", "seed": i} | ({} if source is None else {"source": source})
        (root / f"c{i}" / "cell.json").write_text(json.dumps(info))
    return load_results(root)


A, B = "a" * 40, "b1c2d3e" + "0" * 33


@pytest.mark.parametrize("sources, line", [
    ([None, None], "Provenance: no cell records the commit it ran at (`source` in cell.json; 2 cells)."),
    ([{"commit": A, "clean": True}] * 3, "Provenance: 3 cells ran at commit aaaaaaa (clean tree); every tree was clean."),
    ([{"commit": A, "clean": True}, {"commit": A, "clean": True}, {"commit": B, "clean": False}, None, None,
      {"commit": None, "clean": None}],
     "Provenance: 2 cells ran at commit aaaaaaa (clean tree), 1 cell ran at commit b1c2d3e (uncommitted changes); "
     "3 cells record no commit; not every tree was clean."),
    ([{"commit": A, "clean": True}, None], "Provenance: 1 cell ran at commit aaaaaaa (clean tree); 1 cell records no "
                                           "commit; every recorded tree was clean."),
    ([{"commit": B, "clean": True}, {"commit": B, "clean": False}, {"commit": B, "clean": None}],
     "Provenance: 3 cells ran at commit b1c2d3e (1 clean, 1 with uncommitted changes, 1 tree state not recorded); "
     "not every tree was clean."),
])
def test_the_provenance_line_names_each_commit_and_its_trees(tmp_path, sources, line):
    cells = _cells(tmp_path, sources)
    assert provenance_line(cells) == line
    assert f"\n{line}\n" in build_report(cells)


@pytest.mark.parametrize("source, message", [
    ("abc", r"field 'source': expected \{\"commit\""),
    ({"commit": 7, "clean": True}, r"field 'source.commit': expected a commit sha or null, got 7"),
    ({"commit": A, "clean": "yes"}, r"field 'source.clean': expected true, false or null, got 'yes'"),
])
def test_a_malformed_source_is_an_error_naming_the_field(tmp_path, source, message):
    with pytest.raises(DataError, match=r"c0/cell.json: " + message):
        _cells(tmp_path, [source])
