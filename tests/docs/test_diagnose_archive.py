"""The trained-checkpoint diagnostic that docs/METHOD_NOTES.md quotes is the archived one: its
table and ratios are read back from results/diagnose-shift-smollm2/trained-erm-sft.json."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHIVE = ROOT / "results" / "diagnose-shift-smollm2"
ROWS = {"IGA, tau 0.25": "iga:tau=0.25", "IGA, tau 0.5": "iga:tau=0.5", "IGA, tau 1.0 (default)": "iga",
        "SAND-mask": "sand_mask:tau=0.5,k=10.0"}


def _archived(space: str) -> dict:
    return json.loads((ARCHIVE / "trained-erm-sft.json").read_text(encoding="utf-8"))[space]


def test_method_notes_table_is_the_archived_weight_space_shares():
    notes = (ROOT / "docs" / "METHOD_NOTES.md").read_text(encoding="utf-8")
    methods = _archived("weight")["methods"]
    for row, label in ROWS.items():
        line = next(line for line in notes.splitlines() if line.startswith(f"| {row} |"))
        task, cue, ratio = (float(x) for x in line.strip("| ").split(" | ")[1:])
        kept = methods[label]
        assert (task, cue) == (round(kept["task"], 2), round(kept["cue"], 2)), row
        assert ratio == round(kept["task"] / kept["cue"], 2), row


def test_method_notes_factor_space_ratios_and_directions_are_archived():
    notes = " ".join((ROOT / "docs" / "METHOD_NOTES.md").read_text(encoding="utf-8").split())
    factor = _archived("factor")["methods"]
    ratios = [round(factor[label]["task"] / factor[label]["cue"], 2) for label in ROWS.values()]
    assert f"factor space: {ratios[0]:.2f}, {ratios[1]:.2f}, {ratios[2]:.2f} for IGA, {ratios[3]:.2f} for SAND-mask" in notes
    directions = _archived("weight")["directions"]
    assert f"spread {directions['cue_spread']:.2f} against {directions['task_spread']:.2f}" in notes
    assert f"(cosine {directions['cos_task_cue']:.2f})" in notes


def test_the_text_table_is_the_json():
    """The archived console table prints the JSON's shares (3 decimals), row by row."""
    text = (ARCHIVE / "trained-erm-sft.txt").read_text(encoding="utf-8")
    weight, factor = _archived("weight")["methods"], _archived("factor")["methods"]
    for label in weight:
        line = next(line for line in text.splitlines() if re.match(rf"{re.escape(label)}\s", line))
        shown = [float(x) for x in line.split()[1:]]
        assert shown[0] == round(weight[label]["task"], 3) and shown[1] == round(weight[label]["cue"], 3), label
        assert shown[5] == round(factor[label]["task"], 3) and shown[6] == round(factor[label]["cue"], 3), label
