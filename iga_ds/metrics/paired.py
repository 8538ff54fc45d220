"""Bootstrap intervals over isomer groups, for one row of runs and for the paired difference of two.

Errors cluster within isomer groups (the N renderings of one problem), so items are not
independent draws: the intervals here resample *groups*, never items. A row is several runs
(seeds) of one setting, scored on the same groups. Every statistic is a ratio of per-group sums,
``sum_g num[s][g] / sum_g den[s][g]`` for the run of seed ``s`` (accuracy: correct items over
items; a cue effect: summed error differences over item pairs). A row's value is the mean of
that ratio over its seeds; the difference of two rows is the mean over the seeds both have of
their per-seed difference (paired by seed), and every bootstrap draw resamples one set of groups
used by every seed of both rows (paired by group). The interval is the percentile interval of
the draws.

``totals`` arguments map ``seed -> {group: (num, den)}``. Only groups with ``den > 0`` in every
run taken part are used, so a ratio never divides by zero. numpy is imported when called.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

Totals = Mapping[int, Mapping[str, tuple[float, float]]]

N_BOOT = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A statistic (in the caller's unit times ``scale``), its bootstrap interval, and what it rests on."""

    value: float
    low: float
    high: float
    n_seeds: int
    n_groups: int

    def text(self, digits: int = 1, signed: bool = False) -> str:
        sign = "+" if signed else ""
        return f"{self.value:{sign}.{digits}f} [{self.low:{sign}.{digits}f}, {self.high:{sign}.{digits}f}]"


def resample_counts(n_groups: int, n_boot: int = N_BOOT, seed: int = 0):
    """``n_boot x n_groups`` integer matrix: how often each group is drawn in each bootstrap
    resample (``n_groups`` draws with replacement each). Deterministic for a given ``seed``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n_groups, size=(n_boot, n_groups))
    counts = np.zeros((n_boot, n_groups), dtype=np.int64)
    rows = np.repeat(np.arange(n_boot), n_groups)
    np.add.at(counts, (rows, draws.ravel()), 1)
    return counts


def shared_groups(runs: Sequence[Mapping[str, tuple[float, float]]]) -> list[str]:
    """The groups every run scored (``den > 0`` in each), sorted: the units a bootstrap resamples."""
    if not runs:
        return []
    common = set.intersection(*({g for g, (_, den) in run.items() if den > 0} for run in runs))
    return sorted(common)


def _matrices(runs: Sequence[Mapping[str, tuple[float, float]]], groups: Sequence[str]):
    import numpy as np

    num = np.array([[float(run[g][0]) for g in groups] for run in runs], dtype=np.float64)
    den = np.array([[float(run[g][1]) for g in groups] for run in runs], dtype=np.float64)
    return num, den


def _interval(point: float, draws, n_seeds: int, n_groups: int, level: float, scale: float) -> Interval:
    import numpy as np

    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(draws, [alpha, 1.0 - alpha])
    return Interval(scale * float(point), scale * float(low), scale * float(high), n_seeds, n_groups)


def row_interval(totals: Totals, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0,
                 scale: float = 100.0) -> Interval | None:
    """A row's statistic (mean over seeds of each seed's ratio) with its interval over groups;
    None without a group every seed scored."""
    seeds = sorted(totals)
    runs = [totals[s] for s in seeds]
    groups = shared_groups(runs)
    if not groups:
        return None
    num, den = _matrices(runs, groups)
    point = (num.sum(axis=1) / den.sum(axis=1)).mean()
    counts = resample_counts(len(groups), n_boot, seed)
    draws = ((counts @ num.T) / (counts @ den.T)).mean(axis=1)
    return _interval(point, draws, len(seeds), len(groups), level, scale)


def paired_difference(a: Totals, b: Totals, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0,
                      scale: float = 100.0) -> Interval | None:
    """Row ``a`` minus row ``b``: the mean over their common seeds of the per-seed difference,
    with its interval from resampling the groups both scored (the same draw for every seed and
    both rows); None without a common seed or group."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    runs_a, runs_b = [a[s] for s in seeds], [b[s] for s in seeds]
    groups = shared_groups(runs_a + runs_b)
    if not groups:
        return None
    num_a, den_a = _matrices(runs_a, groups)
    num_b, den_b = _matrices(runs_b, groups)
    point = (num_a.sum(axis=1) / den_a.sum(axis=1) - num_b.sum(axis=1) / den_b.sum(axis=1)).mean()
    counts = resample_counts(len(groups), n_boot, seed)
    diff = (counts @ num_a.T) / (counts @ den_a.T) - (counts @ num_b.T) / (counts @ den_b.T)
    return _interval(point, diff.mean(axis=1), len(seeds), len(groups), level, scale)
