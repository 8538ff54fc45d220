"""docs/REPLICATION.md is what `iga-ds report` makes of the archived runs, to the byte."""
from __future__ import annotations

import tarfile
from pathlib import Path

from iga_ds.experiments.report import write_report

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = ROOT / "docs" / "results" / "replication-2026-11-26" / "runs.tar.xz"
TITLE = "Controlled replication: IGA against ERM on a planted shortcut"


def test_replication_report_regenerates_from_the_archived_runs(tmp_path):
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    out = tmp_path / "docs" / "REPLICATION.md"
    out.parent.mkdir()
    write_report(tmp_path / "replication", out, figures=True, title=TITLE,
                 discussion=ROOT / "docs" / "replication_discussion.md")
    assert out.read_text(encoding="utf-8") == (ROOT / "docs" / "REPLICATION.md").read_text(encoding="utf-8")
    assert sorted(p.name for p in (out.parent / "figures").iterdir()) == sorted(
        ["lcs_layers.png", "mask_stats.png", "ood_accuracy.png", "ood_vs_time.png"])
