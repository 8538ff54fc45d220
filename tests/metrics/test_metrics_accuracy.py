"""Accuracy per domain, Delta-gap, accuracy per compute-hour, mask statistics, training logs."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from iga_ds.errors import DataError
from iga_ds.files import read_jsonl as read_metrics_jsonl
from iga_ds.metrics import (
    accuracy_per_compute_hour,
    accuracy_per_domain,
    aggregate_module_stats,
    delta_gap,
    mask_keys,
    mask_statistics,
    mean_std,
    metric_series,
)


def test_accuracy_per_domain_counts():
    rows = [
        {"domain": "math", "correct": True},
        {"domain": "math", "correct": False},
        {"domain": "legal", "correct": True},
    ]
    acc = accuracy_per_domain(rows)
    assert acc["math"] == {"n": 2, "correct": 1, "accuracy": 50.0}
    assert acc["legal"]["accuracy"] == 100.0


def test_delta_gap_and_compute_hour():
    assert delta_gap(75.3, 65.1) == pytest.approx(10.2)
    assert delta_gap(None, 65.1) is None
    # the paper's Table 4 row for LoRA-SFT: 62.6 % over 2.1 h
    assert accuracy_per_compute_hour(62.6, 2.1 * 3600) == pytest.approx(62.6 / 2.1)
    assert accuracy_per_compute_hour(60.0, 3600, devices=8) == pytest.approx(7.5)
    with pytest.raises(ValueError):
        accuracy_per_compute_hour(60.0, 0)


def test_mean_std_is_sample_std():
    vals = [65.1, 65.7, 64.5]
    m, s = mean_std(vals)
    assert m == pytest.approx(statistics.mean(vals))
    assert s == pytest.approx(statistics.stdev(vals))
    assert mean_std([3.0]) == (3.0, 0.0)


def test_mask_statistics_against_direct_counts():
    mask = torch.tensor([[0.05, 0.3], [0.995, 1.0]])
    st = mask_statistics(mask)
    assert st["mask_mean"] == pytest.approx((0.05 + 0.3 + 0.995 + 1.0) / 4)
    assert st["mask_frac_below_half"] == 0.5
    assert st["mask_frac_below_tenth"] == 0.25
    assert st["mask_frac_above_099"] == 0.5
    assert (st["mask_min"], st["mask_max"]) == (pytest.approx(0.05), 1.0)


def test_aggregate_module_stats_weights_by_size():
    small = mask_statistics(torch.zeros(2))
    big = mask_statistics(torch.ones(6))
    agg = aggregate_module_stats([dict(small, gir=1.0), dict(big, gir=2.0)], weights=[2, 6])
    # equals the statistics of the concatenated mask
    whole = mask_statistics(torch.cat([torch.zeros(2), torch.ones(6)]))
    for key, value in whole.items():
        assert agg[key] == pytest.approx(value), key
    assert agg["gir"] == 3.0


def test_read_metrics_jsonl_tolerates_truncated_tail(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps({"step": 1, "loss": 2.0, "mask_mean": 0.9}) + "\n"
        + json.dumps({"step": 2, "loss": 1.5, "mask_mean": 0.8}) + "\n"
        + '{"step": 3, "lo'
    )
    rows = read_metrics_jsonl(path)
    assert [r["step"] for r in rows] == [1, 2]
    assert metric_series(rows, "mask_mean") == ([1.0, 2.0], [0.9, 0.8])
    assert mask_keys(rows) == ["mask_mean"]


def test_read_metrics_jsonl_malformed_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(DataError, match=r"metrics.jsonl:2"):
        read_metrics_jsonl(path)
