"""Counterfactual cue use: each OOD item scored twice, its planted cue pointing once to the right
answer and once to a wrong one, the texts otherwise the same.

Per-item evaluation rows (``iga_ds.evaluation.runner``) of a counterfactual item carry
``counterfactual`` (``"right"`` or ``"wrong"``), ``of`` (the id of the item it rewrites) and
``group_id``. From the pairs:

- **cue effect** = error rate with the wrong cue - error rate with the right cue (points): how
  much the answer depends on the cue, with the task's own errors, which the two versions share,
  taken out;
- **flip rate** = share of items whose extracted answer changes with the cue alone.

A model that ignores the cue has both at 0, whatever its accuracy.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping

CUE_STATISTICS = ("cue_effect", "flip_rate", "error_right", "error_wrong")


def signals_wrong_answer(row: Mapping[str, Any]) -> bool:
    """Whether an evaluation row's planted cue points away from its gold answer (a cue-conflict item)."""
    return row.get("cue_answer") is not None and row.get("cue_answer") != row.get("gold")


def counterfactual_pairs(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per item scored with both cues: its group, whether each version was right and
    whether the extracted answer flipped; items missing a version are left out."""
    versions: dict[str, dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for row in rows:
        side = row.get("counterfactual")
        if side in ("right", "wrong") and row.get("correct") is not None:
            versions[str(row["of"])][side] = row
    pairs = []
    for of, both in sorted(versions.items()):
        if len(both) < 2:
            continue
        right, wrong = both["right"], both["wrong"]
        pairs.append({"of": of, "group": str(right.get("group_id", of)), "right_correct": bool(right["correct"]),
                      "wrong_correct": bool(wrong["correct"]),
                      "flipped": right.get("prediction") != wrong.get("prediction")})
    return pairs


def pair_value(pair: Mapping[str, Any], statistic: str) -> float:
    """One pair's contribution (0/1, or -1..1 for the cue effect) to ``statistic``."""
    err_right, err_wrong = 1.0 - pair["right_correct"], 1.0 - pair["wrong_correct"]
    if statistic == "cue_effect":
        return err_wrong - err_right
    if statistic == "flip_rate":
        return float(pair["flipped"])
    if statistic == "error_right":
        return err_right
    if statistic == "error_wrong":
        return err_wrong
    raise ValueError(f"unknown cue statistic {statistic!r}; expected one of {', '.join(CUE_STATISTICS)}")


def group_totals(pairs: Iterable[Mapping[str, Any]], statistic: str) -> dict[str, tuple[float, float]]:
    """``{group: (summed pair values, number of pairs)}``: the per-group sums that
    :mod:`iga_ds.metrics.paired` resamples."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for pair in pairs:
        entry = totals[pair["group"]]
        entry[0] += pair_value(pair, statistic)
        entry[1] += 1.0
    return {g: (num, den) for g, (num, den) in totals.items()}


def cue_counterfactual_summary(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Point estimates in % (points for the cue effect) over all pairs; ``{}`` without pairs."""
    pairs = counterfactual_pairs(rows)
    if not pairs:
        return {}
    n = len(pairs)
    out: dict[str, Any] = {"n": n, "groups": len({p["group"] for p in pairs})}
    for statistic in CUE_STATISTICS:
        out[statistic] = 100.0 * sum(pair_value(p, statistic) for p in pairs) / n
    return out
