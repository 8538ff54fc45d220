"""Bootstrap intervals over isomer groups (iga_ds.metrics.paired) and the counterfactual cue
statistics (iga_ds.metrics.cue): against a direct loop, and on cases whose answer is known."""
from __future__ import annotations

import random

import pytest

from iga_ds.metrics.cue import counterfactual_pairs, cue_counterfactual_summary, group_totals
from iga_ds.metrics.paired import paired_difference, resample_counts, row_interval, shared_groups


def _quantile(values, q):
    """Linear interpolation between order statistics (numpy's default), written out."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _slow_row(totals, n_boot, seed, scale=100.0):
    seeds = sorted(totals)
    groups = shared_groups([totals[s] for s in seeds])
    counts = resample_counts(len(groups), n_boot, seed).tolist()

    def value(weights):
        per_seed = []
        for s in seeds:
            num = sum(w * totals[s][g][0] for w, g in zip(weights, groups))
            den = sum(w * totals[s][g][1] for w, g in zip(weights, groups))
            per_seed.append(num / den)
        return sum(per_seed) / len(per_seed)

    draws = [value(c) for c in counts]
    return scale * value([1] * len(groups)), scale * _quantile(draws, 0.025), scale * _quantile(draws, 0.975)


def _slow_diff(a, b, n_boot, seed, scale=100.0):
    seeds = sorted(set(a) & set(b))
    groups = shared_groups([a[s] for s in seeds] + [b[s] for s in seeds])
    counts = resample_counts(len(groups), n_boot, seed).tolist()

    def ratio(run, weights):
        return sum(w * run[g][0] for w, g in zip(weights, groups)) / sum(w * run[g][1] for w, g in zip(weights, groups))

    def value(weights):
        return sum(ratio(a[s], weights) - ratio(b[s], weights) for s in seeds) / len(seeds)

    draws = [value(c) for c in counts]
    return scale * value([1] * len(groups)), scale * _quantile(draws, 0.025), scale * _quantile(draws, 0.975)


def _random_totals(rng, seeds, groups, p):
    return {s: {f"g{g}": (sum(rng.random() < p for _ in range(4)), 4) for g in range(groups)} for s in seeds}


def test_resampling_draws_each_group_set_with_replacement():
    counts = resample_counts(7, 50, seed=3)
    assert counts.shape == (50, 7) and (counts.sum(axis=1) == 7).all() and (counts >= 0).all()
    assert (resample_counts(7, 50, seed=3) == counts).all()  # deterministic


def test_row_interval_and_paired_difference_match_a_direct_loop():
    rng = random.Random(1)
    a = _random_totals(rng, [0, 1, 2], 25, 0.7)
    b = _random_totals(rng, [0, 1, 2, 3], 25, 0.5)
    b[1].pop("g3")  # a group one run lacks is left out of both rows' draws
    got = row_interval(a, n_boot=300, seed=5)
    assert (got.value, got.low, got.high) == pytest.approx(_slow_row(a, 300, 5))
    assert got.n_seeds == 3 and got.n_groups == 25
    diff = paired_difference(a, b, n_boot=300, seed=5)
    assert (diff.value, diff.low, diff.high) == pytest.approx(_slow_diff(a, b, 300, 5))
    assert diff.n_seeds == 3 and diff.n_groups == 24  # seed 3 unpaired; g3 missing in b's seed 1


def test_known_answers():
    every = {s: {f"g{g}": (4.0, 4.0) for g in range(10)} for s in (0, 1)}
    one = row_interval(every)
    assert (one.value, one.low, one.high) == (100.0, 100.0, 100.0)  # all items: interval degenerate
    same = paired_difference(every, every)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)
    # b is a shifted by exactly one correct item of four in every group: the difference is 25 points
    a = {0: {f"g{g}": (float(g % 3 + 1), 4.0) for g in range(12)}}
    b = {0: {g: (n - 1, d) for g, (n, d) in a[0].items()}}
    d = paired_difference(a, b)
    assert d.value == pytest.approx(25.0) and d.low == pytest.approx(25.0) and d.high == pytest.approx(25.0)
    assert row_interval({}) is None and paired_difference(a, {1: a[0]}) is None


def _cf_rows(group, of, right_pred, wrong_pred, gold="yes"):
    return [{"counterfactual": side, "of": of, "group_id": group, "prediction": pred, "correct": pred == gold}
            for side, pred in (("right", right_pred), ("wrong", wrong_pred))]


def test_cue_statistics_on_constructed_pairs():
    # every item flips to the cue's answer: flip rate 100, cue effect 100 points
    rows = [r for g in range(6) for d in range(4) for r in _cf_rows(f"g{g}", f"g{g}/{d}", "yes", "no")]
    summary = cue_counterfactual_summary(rows)
    assert summary == {"n": 24, "groups": 6, "cue_effect": 100.0, "flip_rate": 100.0, "error_right": 0.0,
                       "error_wrong": 100.0}
    pairs = counterfactual_pairs(rows)
    flip = row_interval({0: group_totals(pairs, "flip_rate")})
    assert (flip.value, flip.low, flip.high) == (100.0, 100.0, 100.0)
    # a model that ignores the cue, right or wrong alike: no effect, no flip, whatever its accuracy
    rows = [r for g in range(6) for r in _cf_rows(f"g{g}", f"g{g}/x", "no" if g % 2 else "yes",
                                                  "no" if g % 2 else "yes")]
    summary = cue_counterfactual_summary(rows)
    assert summary["cue_effect"] == 0.0 and summary["flip_rate"] == 0.0 and summary["error_wrong"] == 50.0
    # a flip between two wrong answers changes no error: flip 100, effect 0
    rows = [r for g in range(3) for r in _cf_rows(f"g{g}", f"g{g}/x", "maybe", "no")]
    assert cue_counterfactual_summary(rows)["flip_rate"] == 100.0
    assert cue_counterfactual_summary(rows)["cue_effect"] == 0.0
    assert cue_counterfactual_summary(rows[:1]) == {}  # an item without its twin is no pair
