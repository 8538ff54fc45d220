"""Mask statistics: does the variance mask act at all, and how does that change over training?

The paper's mask M = exp(-tau V) is 1 to many digits at LLM gradient scale when V is raw
(see the normalization options of the IGA method), so a run should show its mask statistics.
``mask_statistics`` summarizes one mask; ``aggregate_module_stats`` combines per-module
statistics into one line per step (weighted by module size); ``metric_series`` and
``mask_keys`` read a training log's rows back for plots, and ``describe_mask_key`` says what
each statistic measures.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

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


# what each statistic of :func:`mask_statistics` measures: (a figure panel's title, its y axis)
MASK_STATISTICS = {
    "mask_mean": ("Mean mask value", "mean of M over elements"),
    "mask_min": ("Smallest mask value", "min of M"),
    "mask_max": ("Largest mask value", "max of M"),
    "mask_frac_below_half": ("Elements damped below 1/2", "fraction of elements, M < 0.5"),
    "mask_frac_below_tenth": ("Elements damped below 1/10", "fraction of elements, M < 0.1"),
    "mask_frac_above_099": ("Elements passed as they are", "fraction of elements, M > 0.99"),
}


def describe_mask_key(key: str) -> tuple[str, str]:
    """(title, y label) of a logged mask statistic (``hook.mask_mean`` as ``mask_mean``); a key
    of no known statistic is its own title, with the y label "value"."""
    name = key.rsplit(".", 1)[-1]
    return MASK_STATISTICS.get(name, (name, "value"))


def combine_rule(key: str) -> str:
    """How a statistic of the whole adapter follows from the modules' when no rule is given:
    keys ending in ``_min`` take the minimum, ``_max`` the maximum, ``gir`` the sum (GIR is
    additive over parameters), every other key the weighted mean."""
    if key.endswith("_min"):
        return "min"
    if key.endswith("_max"):
        return "max"
    if key == "gir" or key.endswith("/gir"):
        return "sum"
    return "mean"


def aggregate_module_stats(
    per_module: Sequence[Mapping[str, float]], weights: Sequence[float] | None = None,
    rules: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """Combine per-module statistics into one set for the whole adapter.

    ``rules`` maps each key to combine to ``mean`` (weighted by ``weights``: use the module's
    element count so that fractions are fractions of all mask elements), ``sum``, ``min`` or
    ``max``; without it every key present is combined by :func:`combine_rule`. A module that
    lacks a key is left out of that key's figure.
    """
    if not per_module:
        return {}
    w = [1.0] * len(per_module) if weights is None else [float(x) for x in weights]
    if len(w) != len(per_module):
        raise ValueError(f"{len(per_module)} modules but {len(w)} weights")
    if rules is None:
        rules = {k: combine_rule(k) for k in sorted({k for stats in per_module for k in stats})}
    out: dict[str, float] = {}
    for key, rule in rules.items():
        pairs = [(float(s[key]), wi) for s, wi in zip(per_module, w) if key in s]
        if not pairs:
            continue
        values = [v for v, _ in pairs]
        if rule == "min":
            out[key] = min(values)
        elif rule == "max":
            out[key] = max(values)
        elif rule == "sum":
            out[key] = sum(values)
        elif rule == "mean":
            total = sum(wi for _, wi in pairs)
            out[key] = sum(v * wi for v, wi in pairs) / total if total > 0 else float("nan")
        else:
            raise ValueError(f"{key}: combine rule must be mean, sum, min or max, got {rule!r}")
    return out


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
