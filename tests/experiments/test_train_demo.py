"""`iga-ds demo` end to end, shrunk: synthetic data, tiny base, ERM and IGA, the table."""
from __future__ import annotations

import json

import pytest
from tiny_models import shrunk_tiny_base_config


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_runs_end_to_end_and_prints_the_table(tmp_path, monkeypatch, capsys):
    from iga_ds.experiments.demo import DemoSettings, run_demo

    monkeypatch.setenv("IGA_DS_CACHE", str(tmp_path / "cache"))
    settings = DemoSettings(groups=40, id_groups=4, ood_groups=4, steps=3, groups_per_step=2, lora_r=2,
                            max_new_tokens=24)
    base = shrunk_tiny_base_config()
    rows = run_demo(tmp_path / "demo", methods=["erm", "iga"], settings=settings, base_config=base,
                    pretrain_groups=10)
    captured = capsys.readouterr()
    out = captured.out
    assert "acc ID %" in out and "delta-gap" in out
    # the last line says how to reach iga-ds; progress in a log is a few plain lines, no redraws
    assert "iga-ds" in out.splitlines()[-1] and ("pip install -e ." in out or "--help" in out)
    progress = [line for line in captured.err.split("\n") if line.startswith(("train ", "generating"))]
    assert progress and len(progress) <= 2 * (3 + 10) + 4 and "\r" not in captured.err
    assert [r["method"] for r in rows] == ["erm", "iga"]
    saved = json.loads((tmp_path / "demo" / "results.json").read_text())
    for row in saved["rows"]:
        ev = json.loads((tmp_path / "demo" / row["method"] / "eval.json").read_text())
        # the OOD items' cue rewrites (scored for the cue effect) are items of their own
        rewrites = [i for i in ev["items"] if i.get("counterfactual")]
        items = [i for i in ev["items"] if not i.get("counterfactual")]
        assert sum(i["split"] == "id" for i in items) == 4 * 4 and sum(i["split"] == "ood" for i in items) == 4 * 4
        assert sorted(i["counterfactual"] for i in rewrites) == ["right"] * 16 + ["wrong"] * 16
        # the table's figures are the evaluation's, recomputed here from the scored items
        id_acc = 100.0 * sum(i["correct"] for i in items if i["split"] == "id") / 16
        assert row["id_accuracy"] == pytest.approx(id_acc)
        assert row["delta_gap"] == pytest.approx(row["id_accuracy"] - row["ood_accuracy"])
    # ID instances are held out of training; OOD instances come from the shortcut-free split
    fit = {json.loads(x)["group_id"] for x in (tmp_path / "demo" / "data" / "fit.jsonl").read_text().splitlines()}
    held = {json.loads(x)["group_id"] for x in (tmp_path / "demo" / "data" / "id_test.jsonl").read_text().splitlines()}
    assert fit and held and not fit & held
