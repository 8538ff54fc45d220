"""Accuracy per domain, the cross-domain Delta-gap, accuracy per compute-hour, mean +- std.

Definitions follow the paper's appendix "Evaluation Metrics": accuracy is the percentage of
exact matches; Delta-gap = Acc_ID - Acc_OOD (Eq. delta_gap); accuracy per compute-hour is the
average OOD accuracy divided by the training time (Table 4 divides by wall-clock hours per
epoch on the whole machine: 62.6 / 2.1 = 29.81).
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Mapping, Sequence


def accuracy(correct: Sequence[bool]) -> float | None:
    """Percentage of True values; None for an empty list (no data is not 0 %)."""
    if len(correct) == 0:
        return None
    return 100.0 * sum(bool(c) for c in correct) / len(correct)


def accuracy_by_group(rows: Iterable[Mapping], key: str, field: str = "correct") -> dict[str, dict]:
    """``{group: {"n", "correct", "accuracy"}}`` for rows grouped by ``row[key]``."""
    buckets: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        buckets[str(row[key])].append(bool(row[field]))
    return {
        name: {"n": len(vals), "correct": sum(vals), "accuracy": accuracy(vals)}
        for name, vals in sorted(buckets.items())
    }


def accuracy_per_domain(rows: Iterable[Mapping], field: str = "correct") -> dict[str, dict]:
    return accuracy_by_group(rows, "domain", field)


def delta_gap(id_accuracy: float | None, ood_accuracy: float | None) -> float | None:
    """Acc_ID - Acc_OOD in percentage points (smaller means more robust)."""
    if id_accuracy is None or ood_accuracy is None:
        return None
    return float(id_accuracy) - float(ood_accuracy)


def accuracy_per_compute_hour(accuracy_pct: float, train_seconds: float, devices: int = 1) -> float:
    """Accuracy (%) per hour of training.

    ``devices=1`` divides by wall-clock hours, as the paper's Table 4 does; pass the number of
    accelerators to divide by device-hours instead.
    """
    hours = float(train_seconds) * int(devices) / 3600.0
    if hours <= 0:
        raise ValueError(f"training time must be positive, got {train_seconds} s on {devices} device(s)")
    return float(accuracy_pct) / hours


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for a single seed)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("mean_std of no values")
    mean = sum(vals) / len(vals)
    if len(vals) == 1:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, math.sqrt(var)


def format_percent(value: float | None, missing: str = "–", suffix: str = "%", digits: int = 1) -> str:
    """An accuracy (or a difference of accuracies) for tables and summaries; ``missing`` for None."""
    return missing if value is None else f"{value:.{digits}f}{suffix}"
