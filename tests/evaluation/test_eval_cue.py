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


def test_each_ood_item_is_scored_again_with_its_cue_rewritten_both_ways():
    from iga_ds.evaluation.records import isomer_eval_items

    recs = [r for r in generate_groups(40, seed=4, shortcut=0.9) if r["meta"]["split"] == "test"]
    assert all("cue_counterfactual" in r["meta"] for r in recs)
    items = isomer_eval_items(recs[:8], recs[8:], "synthetic")
    ood = [i for i in items if i.split == "ood" and "counterfactual" not in i.meta]
    rewrites = {i.id: i for i in items if "counterfactual" in i.meta}
    assert len(rewrites) == 2 * len(ood) and not any(i.id.startswith("cf-") for i in items if i.split == "id")
    for item, rec in zip(ood, recs[8:]):
        for side in ("right", "wrong"):
            cf = rewrites[f"cf-{side}/{item.id}"]
            version = rec["meta"]["cue_counterfactual"][side]
            assert cf.problem == version["problem"] and cf.meta["cue_answer"] == version["cue_answer"]
            assert cf.meta["of"] == item.id and cf.meta["group_id"] == rec["group_id"] and cf.answer == item.answer
        assert rewrites[f"cf-right/{item.id}"].meta["cue_answer"] == item.answer
    # a model that always answers what the cue signals: every rewrite flips, the effect is 100 points
    outputs = {i.id: f"Answer: {i.meta.get('cue_answer', i.answer)}" for i in items}
    summary = summarize(score_items(items, outputs))
    assert summary["n"] == len(items) - len(rewrites)  # the rewrites stay out of the accuracies
    cf = summary["cue_counterfactual"]
    assert cf["n"] == len(ood) and cf["flip_rate"] == 100.0 and cf["cue_effect"] == 100.0
    assert cf["error_right"] == 0.0 and cf["groups"] == len({r["group_id"] for r in recs[8:]})
    # a model that ignores the cue and is always right: no effect, no flip
    summary = summarize(score_items(items, {i.id: f"Answer: {i.answer}" for i in items}))
    assert summary["cue_counterfactual"]["cue_effect"] == 0.0 and summary["cue_counterfactual"]["flip_rate"] == 0.0
    assert summary["ood_accuracy"] == 100.0


def test_data_without_rewrites_keeps_the_older_fields():
    recs = [r for r in generate_groups(20, seed=4, shortcut=0.9) if r["meta"]["split"] == "test"]
    for r in recs:
        r["meta"].pop("cue_counterfactual")
    from iga_ds.evaluation.records import isomer_eval_items

    items = isomer_eval_items(recs[:4], recs[4:], "synthetic")
    assert not any("counterfactual" in i.meta for i in items)
    assert "cue_counterfactual" not in summarize(score_items(items, {i.id: "Answer: yes" for i in items}))
