"""Shortcut reliance: how often a model answers what a planted cue signals when the cue is wrong."""
import random

from iga_ds.data.synth import generate_groups
from iga_ds.evaluation.records import isomer_items
from iga_ds.evaluation.runner import score_items, summarize


def test_cue_conflict_counts_follow_and_accuracy_on_conflicting_items_only():
    recs = [r for r in generate_groups(200, seed=4, shortcut=0.9) if r["meta"]["split"] == "test"]
    items = isomer_items(recs, name="synthetic")
    assert all(i.meta["cue_answer"] == r["meta"]["cue_answer"] for i, r in zip(items, recs))
    rng = random.Random(0)
    # a model that follows the cue on half of the items and answers right on the rest
    follows = [rng.random() < 0.5 for _ in items]
    outputs = {i.id: f"Answer: {i.meta['cue_answer'] if f else i.answer}" for i, f in zip(items, follows)}
    summary = summarize(score_items(items, outputs))
    conflict = [(f, r) for f, r in zip(follows, recs) if not r["meta"]["cue_agrees"]]
    assert summary["cue_conflict"]["id"]["n"] == len(conflict) > 20
    expected_follow = 100.0 * sum(f for f, _ in conflict) / len(conflict)
    assert summary["ood_cue_follow"] is None  # every item here is in the ID split
    assert abs(summary["cue_conflict"]["id"]["follow_cue"] - expected_follow) < 1e-9
    assert abs(summary["cue_conflict"]["id"]["accuracy"] - (100.0 - expected_follow)) < 1e-9


def test_no_cue_no_conflict_block():
    recs = generate_groups(20, seed=4)
    items = isomer_items(recs)
    summary = summarize(score_items(items, {i.id: f"Answer: {i.answer}" for i in items}))
    assert summary["cue_conflict"] == {} and summary["ood_cue_follow"] is None
