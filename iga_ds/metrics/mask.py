"""Mask statistics: does the variance mask act at all, and how does that change over training?

The paper's mask M = exp(-tau V) is 1 to many digits at LLM gradient scale when V is raw
(see the normalization options of the IGA method), so a run should show its mask statistics.
``mask_statistics`` summarizes one mask; ``aggregate_module_stats`` combines per-module
statistics into one line per step (weighted by module size); ``read_metrics_jsonl`` and
``metric_series`` read a training log back for plots.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from iga_ds.errors import DataError

if TYPE_CHECKING:
    import torch


def mask_statistics(mask: "torch.Tensor") -> dict[str, float]:
    """Mean, min, max and the fractions of elements the mask damps (<0.5, <0.1) or passes (>0.99)."""
    import torch

    m = mask.detach().to(torch.float64).flatten()
    if m.numel() == 0:
        raise ValueError("mask_statistics of an empty mask")
    return {
        "mask_mean": float(m.mean()),
        "mask_min": float(m.min()),
        "mask_max": float(m.max()),
        "mask_frac_below_half": float((m < 0.5).double().mean()),
        "mask_frac_below_tenth": float((m < 0.1).double().mean()),
        "mask_frac_above_099": float((m > 0.99).double().mean()),
    }


def aggregate_module_stats(
    per_module: Sequence[Mapping[str, float]], weights: Sequence[float] | None = None
) -> dict[str, float]:
    """Combine per-module statistics into one set for the whole adapter.

    Keys ending in ``_min`` take the minimum, ``_max`` the maximum, ``gir`` the sum (GIR is
    additive over parameters); every other key is the mean weighted by ``weights`` (use the
    module's element count so that fractions are fractions of all mask elements).
    """
    if not per_module:
        return {}
    w = [1.0] * len(per_module) if weights is None else [float(x) for x in weights]
    if len(w) != len(per_module):
        raise ValueError(f"{len(per_module)} modules but {len(w)} weights")
    keys = sorted({k for stats in per_module for k in stats})
    out: dict[str, float] = {}
    for key in keys:
        pairs = [(float(s[key]), wi) for s, wi in zip(per_module, w) if key in s]
        values = [v for v, _ in pairs]
        if key.endswith("_min"):
            out[key] = min(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        elif key == "gir" or key.endswith("/gir"):
            out[key] = sum(values)
        else:
            total = sum(wi for _, wi in pairs)
            out[key] = sum(v * wi for v, wi in pairs) / total if total > 0 else float("nan")
    return out


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a training log (one JSON object per line).

    A truncated last line (the writer was killed mid-write) is dropped; a malformed line
    elsewhere is an error naming file and line.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines):
                break  # the log was being written when the run stopped
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def metric_series(rows: Iterable[Mapping[str, Any]], key: str, x_key: str = "step") -> tuple[list[float], list[float]]:
    """(x, y) of every row that has both keys and a numeric value."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        y = row.get(key)
        if isinstance(y, (int, float)) and not isinstance(y, bool):
            x = row.get(x_key, i)
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


def mask_keys(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The numeric keys of a training log that describe the mask (``mask`` in the name)."""
    keys: set[str] = set()
    for row in rows:
        keys.update(k for k, v in row.items() if "mask" in k and isinstance(v, (int, float)))
    return sorted(keys)
