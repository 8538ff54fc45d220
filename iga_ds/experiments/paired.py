"""The report's rows by the paper's definitions, and its paired comparisons against ERM-SFT.

Each row's training setting is read from its cells' ``cell_spec.json`` (method, grouping,
domains, cue) and said in the paper's terms, so that a row's label never has to carry the
definition. The headline baseline is ERM-SFT as the paper defines it: LoRA SFT on all isomer
records with no group-level structure (``grouping: none``). Every other row is compared with it
on the same seeds and the same isomer groups: OOD accuracy, and where the evaluation scored
counterfactual-cue rewrites, the cue effect and the flip rate (:mod:`iga_ds.metrics.cue`), each
with a 95% bootstrap interval over isomer groups (:mod:`iga_ds.metrics.paired`). The share of
clipped steps and the update size against the baseline stand beside them: a row that moved the
adapter less, or whose steps were clipped more, may look robust only because it learned less.
"""
from __future__ import annotations

from typing import Any, Sequence

from iga_ds.errors import UserError
from iga_ds.experiments.results import (
    METHOD_LABELS, Cell, benchmarks_of, cell_clipped_share, cue_domains, labels_in_order, row_order, wrong_cue_items,
)
from iga_ds.experiments.tables import DASH, Stat, group_rows, markdown
from iga_ds.experiments.update_size import update_ratios
from iga_ds.metrics.cue import counterfactual_pairs, group_totals
from iga_ds.metrics.paired import Interval, paired_difference, row_interval

NA = "n/a"
ERM_SFT_DEFINITION = ("ERM-SFT: LoRA SFT on all isomer records without any group-level structure (the paper's "
                      "definition; single instances, plain mean). CoT-Distill as the paper defines it (teacher "
                      "chain-of-thought targets, no isomer structure, no masking) is this same run here: the "
                      "targets of this benchmark are its chain of thought")


def _data_overrides(variant: dict[str, Any]) -> dict[str, Any]:
    return dict((variant.get("train") or {}).get("data") or {})


def is_erm_sft(variant: dict[str, Any] | None) -> bool:
    """Whether a cell trained ERM-SFT by the paper's definition at the grid's batch size: method erm on
    every domain's single instances (``grouping: none``), the planted cue, the seed split."""
    if not variant:
        return False
    return (variant.get("method") == "erm" and variant.get("grouping") == "none" and not variant.get("domains")
            and variant.get("cue", "planted") == "planted" and variant.get("split", "seed") == "seed"
            and variant.get("pairing", "isomer") == "isomer" and not _data_overrides(variant))


def paper_definition(variant: dict[str, Any] | None) -> str:
    """What a row trained, in the paper's terms (or why it is no paper row)."""
    if not variant:
        return "not recorded (no cell_spec.json)"
    method, grouping = variant.get("method"), variant.get("grouping", "groups")
    batches = "single instances" if grouping == "none" else "batches of whole isomer groups"
    if variant.get("cue") == "neutral":
        return f"control, not a paper row: method {method} on {batches} whose cue is independent of the answer"
    if variant.get("split") == "instance":
        return "ablation: instances split without regard to their groups (the paper's w/o seed-level split)"
    if variant.get("pairing") == "random":
        return "ablation: groups of unrelated problems (the paper's random pairing)"
    domains = variant.get("domains") or []
    if method == "erm" and len(domains) == 1:
        return f"LoRA-SFT: the seed problems in one domain ({domains[0]}), one instance per problem"
    if method == "erm" and grouping == "none":
        sizes = _data_overrides(variant)
        return ERM_SFT_DEFINITION if not sizes else f"ERM-SFT at another batch size ({_sizes(sizes)}): grouping cost"
    if method == "erm":
        extra = f", {_sizes(_data_overrides(variant))}" if _data_overrides(variant) else ""
        return f"ERM, grouped batches: plain mean over {batches}{extra} (not a paper row)"
    name = METHOD_LABELS.get(str(method), str(method))
    params = ", ".join(f"{k}: {v}" for k, v in sorted((variant.get("params") or {}).items()))
    where = f" on {', '.join(domains)}" if domains else ""
    return f"{name} (method {method}{', ' + params if params else ''}) on {batches}{where}"


def _sizes(data: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(data.items()))


def definitions_table(cells: Sequence[Cell]) -> str:
    """One line per row: what it trained, in the paper's terms."""
    rows = group_rows(cells)
    main = row_order([lab for lab, group in rows.items() if not group[0].ablation])
    labels = main + sorted(lab for lab in rows if lab not in main)
    return markdown(["Row", "What it trained (paper's terms)"],
                    [[lab, paper_definition(rows[lab][0].variant)] for lab in labels])


def headline_baseline(cells: Sequence[Cell]) -> str | None:
    """The label of the ERM-SFT row by the paper's definition; a row labelled ERM-SFT where no
    cell recorded how it trained."""
    rows = group_rows([c for c in cells if not c.ablation])
    defined = [lab for lab, group in rows.items() if all(is_erm_sft(c.variant) for c in group)]
    if defined:
        return METHOD_LABELS["erm"] if METHOD_LABELS["erm"] in defined else sorted(defined)[0]
    if METHOD_LABELS["erm"] in rows and all(c.variant is None for c in rows[METHOD_LABELS["erm"]]):
        return METHOD_LABELS["erm"]
    return None


def accuracy_totals(group: Sequence[Cell], bench: str) -> dict[int, dict[str, tuple[float, float]]]:
    """Per seed, per isomer group: (correct OOD items, OOD items), the counterfactual rewrites left out."""
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for cell in group:
        sums: dict[str, list[float]] = {}
        for row in cell.items.get(bench, []):
            if row["split"] == "ood" and not row.get("counterfactual"):
                entry = sums.setdefault(row["group"], [0.0, 0.0])
                entry[0] += row["correct"]
                entry[1] += 1.0
        if sums:
            out[cell.seed] = {g: (a, b) for g, (a, b) in sums.items()}
    return out


def cue_totals(group: Sequence[Cell], bench: str, statistic: str) -> dict[int, dict[str, tuple[float, float]]]:
    out = {}
    for cell in group:
        pairs = counterfactual_pairs(r for r in cell.items.get(bench, []) if r.get("counterfactual"))
        if pairs:
            out[cell.seed] = group_totals(pairs, statistic)
    return out


def cue_follow_totals(group: Sequence[Cell], bench: str, domain: str) -> dict[int, dict[str, tuple[float, float]]]:
    """Per seed, per isomer group: (wrong-cue OOD items of ``domain`` answered as the cue signals,
    such items)."""
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for cell in group:
        sums: dict[str, list[float]] = {}
        for row in wrong_cue_items(cell, bench):
            if row.get("domain") == domain:
                entry = sums.setdefault(row["group"], [0.0, 0.0])
                entry[0] += row["follows_wrong_cue"]
                entry[1] += 1.0
        if sums:
            out[cell.seed] = {g: (a, b) for g, (a, b) in sums.items()}
    return out


def _text(interval: Interval | None, signed: bool = False) -> str:
    return NA if interval is None else interval.text(1, signed)


def _update_size(group: Sequence[Cell], base: Sequence[Cell]) -> str:
    refs = {c.seed: c for c in base}
    return Stat([update_ratios(c, refs.get(c.seed)).displacement for c in group]).text(2)


def paired_table(cells: Sequence[Cell], bench: str, baseline: str) -> str:
    """Per row: OOD accuracy and its paired difference from ``baseline``, the cue effect and its
    difference, the flip rate (each with its 95% interval over isomer groups), the clipped steps
    and the update size against the baseline."""
    labels, rows = _paired_labels(cells, baseline)
    base = rows[baseline]
    acc_b, effect_b = accuracy_totals(base, bench), cue_totals(base, bench, "cue_effect")
    body = []
    for lab in labels:
        group = rows[lab]
        acc, effect = accuracy_totals(group, bench), cue_totals(group, bench, "cue_effect")
        same = lab == baseline
        body.append([lab, str(len({c.seed for c in group})), _text(row_interval(acc)),
                     "—" if same else _text(paired_difference(acc, acc_b), True),
                     _text(row_interval(effect), True), "—" if same else _text(paired_difference(effect, effect_b), True),
                     _text(row_interval(cue_totals(group, bench, "flip_rate"))),
                     Stat([cell_clipped_share(c) for c in group]).text(1), _update_size(group, base)])
    header = ["Row", "seeds", f"{bench} OOD acc. [95% CI]", f"Δ OOD acc. vs {baseline} [95% CI]",
              "cue effect, points [95% CI] ↓", f"Δ cue effect vs {baseline} [95% CI]", "flip rate, % [95% CI] ↓",
              "clipped steps, %", f"update size vs {baseline}"]
    return markdown(header, body)


def _paired_labels(cells: Sequence[Cell], baseline: str) -> tuple[list[str], dict[str, list[Cell]]]:
    """The paired tables' rows: the baseline, the other method rows in paper order, the ablations."""
    return [baseline] + [lab for lab in labels_in_order(cells) if lab != baseline], group_rows(cells)


def domain_cue_table(cells: Sequence[Cell], bench: str, baseline: str) -> str | None:
    """Per row and domain: the difference from ``baseline`` in wrong-cue OOD following, with its
    95% interval over isomer groups; None where no evaluation has wrong-cue items by domain."""
    domains = cue_domains(cells, bench)
    if not domains:
        return None
    labels, rows = _paired_labels(cells, baseline)
    base = {d: cue_follow_totals(rows[baseline], bench, d) for d in domains}
    body = []
    for lab in labels:
        group = rows[lab]
        diffs = ["—" if lab == baseline else
                 _text(paired_difference(cue_follow_totals(group, bench, d), base[d]), True) for d in domains]
        body.append([lab, str(len({c.seed for c in group})), *diffs])
    header = ["Row", "seeds", *[f"Δ {d}, points [95% CI]" for d in domains]]
    return markdown(header, body)


PAIRED_NOTE = (
    "Intervals are 95% percentile intervals of 2000 bootstrap resamples of the isomer groups (errors cluster "
    "within a group, so items are not resampled one by one); a row's value is the mean over its seeds, and a "
    "difference is taken seed by seed against the baseline's run of the same seed, on one resample of groups "
    "for both rows. The cue effect is the error rate with the cue pointing to a wrong answer minus the error "
    "rate with the cue pointing to the right one, on the same OOD items otherwise unchanged; the flip rate is "
    "the share of those items whose extracted answer changes with the cue alone (n/a: the evaluation scored no "
    "such rewrites). Clipped steps: the share of logged steps whose gradient norm before clipping exceeded "
    "the clip. Update size: the whole-adapter displacement over the baseline's run of the same seed."
)


def check_against(cells: Sequence[Cell], against: Sequence[str]) -> None:
    """Every label in ``against`` names a method row of ``cells``."""
    labels = {c.label for c in cells if not c.ablation}
    for label in against:
        if label not in labels:
            raise UserError(f"--against {label!r}: no such row; the rows are: "
                            + "; ".join(row_order(sorted(labels))))


def paired_section(cells: Sequence[Cell], against: Sequence[str] = ()) -> list[str]:
    """The rows' definitions, then for every evaluation with an OOD split the paired table, and
    one more against each row labelled in ``against``; the lines of the section body."""
    parts = ["How each row's training maps to the paper's text, read from its cells' settings:", "",
             definitions_table(cells), ""]
    check_against(cells, against)
    baseline = headline_baseline(cells)
    benches = [b for b in benchmarks_of(cells) if any(r["split"] == "ood" for c in cells for r in c.items.get(b, []))]
    if baseline is None or not benches:
        return parts + ["No ERM-SFT row by the paper's definition (or no OOD items): no paired comparison.", ""]
    parts += [f"Headline baseline: the row \"{baseline}\" (ERM-SFT by the paper's definition). {PAIRED_NOTE}", ""]
    for bench in benches:
        parts += _paired_tables(cells, bench, baseline)
    for other in against:
        parts += [f"Every row against the row \"{other}\", paired the same way:", ""]
        parts += [line for bench in benches for line in _paired_tables(cells, bench, other)]
    return parts


def _paired_tables(cells: Sequence[Cell], bench: str, baseline: str) -> list[str]:
    """The paired table of ``bench`` against ``baseline``, then its per-domain wrong-cue differences."""
    parts = [paired_table(cells, bench, baseline), ""]
    by_domain = domain_cue_table(cells, bench, baseline)
    if by_domain:
        parts += [f"{bench}, per domain: of the OOD items whose cue signals a wrong answer, the share answered as "
                  f"the cue signals, the row's minus that of \"{baseline}\" (points), paired the same way:", "",
                  by_domain, ""]
    return parts


def selection_section(selection: dict[str, Any]) -> list[str]:
    """Every candidate of the selection stage (``selection.json``) with its in-distribution score,
    the chosen one marked: the rows' schedules were picked before any OOD number existed."""
    metric = str(selection.get("metric", "id_accuracy"))
    body = []
    for key, entry in (selection.get("rows") or {}).items():
        chosen = entry.get("chosen")
        for cand in entry.get("candidates", []):
            score = cand.get(metric)
            schedule = {k: v for k, v in cand.items() if k != metric}
            body.append([key, ", ".join(f"{k} {v:g}" for k, v in schedule.items()),
                         DASH if score is None else f"{score:.1f}", "chosen" if schedule == chosen else ""])
    seeds = ", ".join(map(str, selection.get("seeds", [])))
    return [f"Rule: {selection.get('rule', '')}, on {metric} (in-distribution only; seeds {seeds}). Every "
            "candidate tried:", "", markdown(["Row", "candidate", metric, ""], body), ""]
