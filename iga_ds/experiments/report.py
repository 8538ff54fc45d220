"""``report.md``: tables shaped like the paper's main results, ablation, efficiency and LCS-by-layer
tables (mean +- sample std over seeds, best in bold), plus PNG figures (``figures.py``).

``iga-ds report DIR`` reads three kinds of folder (:func:`iga_ds.experiments.results.folder_kind`):
an experiment grid (the tables above), the demo's folder (its table, accuracy per domain, the
training losses and its figure) and a single training run (its settings, its loss curve in brief,
and its evaluation when one lies beside it).

Numbers come only from the result files; a value a cell lacks is shown as "–". Several results
folders ("students", e.g. the same grid trained from two bases) share one report: their headline
columns side by side, then each student's own tables under its name.
"""
from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

from iga_ds.errors import UserError
from iga_ds.experiments.figures import demo_figure, loss_figure, make_figures, run_mask_figure
from iga_ds.experiments.paired import check_against, headline_baseline, paired_section, selection_section
from iga_ds.experiments.tables import DASH, Stat, column, group_rows, markdown
from iga_ds.experiments.update_size import UPDATE_SIZE_NOTE, update_size_table
from iga_ds.experiments.results import (
    DEMO,
    DEMO_FIGURE,
    GRID,
    METHOD_LABELS,
    RUN,
    Cell,
    Demo,
    Run,
    benchmarks_of,
    cell_avg_delta_gap,
    cell_avg_headline,
    cell_cue_follow,
    cell_cue_follow_by_domain,
    cell_default_lcs,
    cell_final_loss,
    cell_lcs,
    cell_method_params,
    cell_median_step_ms,
    cell_metric_mean,
    cell_source,
    cue_domains,
    eval_files,
    folder_kind,
    headline_accuracy,
    is_iga_row,
    labels_in_order,
    load_demo,
    load_results,
    load_run,
    loss_summary,
    non_default_settings,
    row_order,
)
from iga_ds.files import atomic_write_text, check_output_file, read_json, read_text
from iga_ds.metrics.accuracy import accuracy_per_compute_hour

def _has_ood(cells: Sequence[Cell], bench: str) -> bool:
    return any(c.evals.get(bench, {}).get("ood_accuracy") is not None for c in cells)


def _has_cue(cells: Sequence[Cell], bench: str) -> bool:
    """Whether the evaluation measured shortcut reliance (items with a planted cue)."""
    return any(cell_cue_follow(c, bench) is not None for c in cells)


# -- the tables ---------------------------------------------------------------------------------


def main_table(cells: Sequence[Cell]) -> str:
    """Paper Table 2: ID and OOD accuracy per benchmark, LCS (x1e-2), average Delta-gap."""
    rows = group_rows(cells)
    order = row_order(list(rows))
    header, columns = ["Method"], []
    for bench in benchmarks_of(cells):
        header += [f"{bench} ID", f"{bench} OOD"]
        columns.append(column(rows, lambda c, b=bench: c.evals.get(b, {}).get("id_accuracy"), True, 1))
        columns.append(column(rows, lambda c, b=bench: c.evals.get(b, {}).get("ood_accuracy"), True, 1))
        if _has_cue(cells, bench):
            header.append(f"{bench} OOD follows wrong cue ↓")
            columns.append(column(rows, lambda c, b=bench: cell_cue_follow(c, b), False, 1))
    header += ["LCS (×1e-2) ↓", "Avg Δ-gap ↓", "Train loss, last 10%"]
    columns.append(column(rows, cell_default_lcs, False, 2))
    columns.append(column(rows, cell_avg_delta_gap, False, 2))
    columns.append(column(rows, cell_final_loss, None, 3))
    body = [[label] + [col[label] for col in columns] for label in order]
    return markdown(header, body)


CUE_DOMAIN_NOTE = (
    "The OOD items of the column \"OOD follows wrong cue\" split by domain: over the OOD items whose planted "
    "cue signals a wrong answer, the share the row answered as the cue signals, per domain (mean ± sample std "
    "over seeds; no bold, since a share near 0% is an answer against the cue, not its absence). A row that "
    "learned a rule per domain follows the cue in some domains and answers against it in others, which the "
    "pooled share averages away."
)


def cue_domain_table(cells: Sequence[Cell], bench: str) -> str | None:
    """Per row (method rows, then ablations): wrong-cue OOD following pooled and in each domain;
    None when no cell's evaluation of ``bench`` has wrong-cue items by domain."""
    domains = cue_domains(cells, bench)
    if not domains:
        return None
    rows, labels = group_rows(cells), labels_in_order(cells)
    columns = [column(rows, lambda c: cell_cue_follow(c, bench), None, 1)]
    columns += [column(rows, lambda c, d=d: cell_cue_follow_by_domain(c, bench).get(d), None, 1) for d in domains]
    header = ["Row", f"{bench}: all domains", *[f"{bench}: {d}" for d in domains]]
    return markdown(header, [[lab] + [col[lab] for col in columns] for lab in labels])


def provenance_line(cells: Sequence[Cell]) -> str:
    """Which code the cells ran: each commit (``cell.json``'s ``source``) with its cells' tree
    state, and how many cells record no commit."""
    by_commit: dict[str, list[bool | None]] = defaultdict(list)
    for cell in cells:
        commit, clean = cell_source(cell)
        if commit is not None:
            by_commit[commit[:7]].append(clean)
    missing = len(cells) - sum(len(states) for states in by_commit.values())
    if not by_commit:
        return f"Provenance: no cell records the commit it ran at (`source` in cell.json; {_count(missing, 'cell')})."
    parts = [f"{_count(len(states), 'cell')} ran at commit {sha} ({_tree_state(states)})"
             for sha, states in sorted(by_commit.items(), key=lambda item: (-len(item[1]), item[0]))]
    text = "Provenance: " + ", ".join(parts)
    if missing:
        text += f"; {_count(missing, 'cell')} record{'s' if missing == 1 else ''} no commit"
    every = all(clean is True for states in by_commit.values() for clean in states)
    return text + ("; every recorded tree was clean." if every and missing else
                   "; every tree was clean." if every else "; not every tree was clean.")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _tree_state(states: Sequence[bool | None]) -> str:
    """How the trees of one commit's cells stood: clean, with uncommitted changes, or not recorded."""
    counts = {state: states.count(state) for state in (True, False, None) if state in states}
    if len(counts) == 1:
        return {True: "clean tree", False: "uncommitted changes", None: "tree state not recorded"}[next(iter(counts))]
    names = {True: "clean", False: "with uncommitted changes", None: "tree state not recorded"}
    return ", ".join(f"{n} {names[state]}" for state, n in counts.items())


def _iga_label(rows: dict[str, list[Cell]]) -> str | None:
    """The IGA row among method rows: at the shipped defaults if there is one (labelled ``IGA``,
    or named otherwise with every recorded parameter at its default), else the first IGA row."""
    labels = [label for label in row_order(list(rows)) if is_iga_row(label)]

    def at_defaults(label: str) -> bool:
        return all(c.variant is not None and c.variant.get("method") == "iga"
                   and not non_default_settings("iga", cell_method_params(c.info, c.variant) or {}) for c in rows[label])

    return next((label for label in labels if label == METHOD_LABELS["iga"]), None) \
        or next((label for label in labels if at_defaults(label)), None) or (labels[0] if labels else None)


def _full_iga(main_cells: Sequence[Cell]) -> tuple[str, list[Cell]]:
    """The row the ablations are measured against, and its label: "Full IGA", with the
    settings of a row that is not at the shipped defaults (``Full IGA (normalize: mean)``)."""
    full = [c for c in main_cells if c.method == "iga"]
    label = full[0].label if full and is_iga_row(full[0].label) else "IGA"
    return "Full " + label, full


def ablation_table(main_cells: Sequence[Cell], ablation_cells: Sequence[Cell]) -> str:
    """Paper Table 3: OOD accuracy (or accuracy where no OOD split) per benchmark and its change
    from full IGA, LCS, and the average change."""
    full_label, full = _full_iga(main_cells)
    erm = [c for c in main_cells if c.method == "erm"]
    rows: dict[str, list[Cell]] = {}
    if full:
        rows[full_label] = full
    rows.update(group_rows(ablation_cells))
    if erm:
        rows["ERM-SFT (reference)"] = erm
    cells_all = [c for group in rows.values() for c in group]
    benches = benchmarks_of(cells_all)
    header, columns = ["Variant"], []
    full_means = {b: Stat([headline_accuracy(c.evals[b]) for c in full if b in c.evals]).mean for b in benches}
    deltas: dict[str, list[float]] = defaultdict(list)
    for bench in benches:
        kind = "OOD" if _has_ood(cells_all, bench) else "Acc"
        header += [f"{bench} {kind}", "Δ"]
        acc = lambda c, b=bench: headline_accuracy(c.evals[b]) if b in c.evals else None  # noqa: E731
        columns.append(column(rows, acc, True, 1))
        delta_col = {}
        for label, group in rows.items():
            mean = Stat([acc(c) for c in group]).mean
            if mean is None or full_means[bench] is None:
                delta_col[label] = DASH
                continue
            delta = mean - full_means[bench]
            deltas[label].append(delta)
            delta_col[label] = "—" if label == full_label else f"{delta:+.1f}"
        columns.append(delta_col)
        if _has_cue(cells_all, bench):
            header.append(f"{bench} OOD follows wrong cue ↓")
            columns.append(column(rows, lambda c, b=bench: cell_cue_follow(c, b), False, 1))
    header += ["LCS (×1e-2) ↓", "Avg Δ vs IGA", "Train loss, last 10%"]
    columns.append(column(rows, cell_default_lcs, False, 2))
    columns.append({lab: (f"{sum(d) / len(d):+.2f}" if (d := deltas.get(lab)) else DASH) for lab in rows})
    columns.append(column(rows, cell_final_loss, None, 3))
    body = [[label] + [col[label] for col in columns] for label in rows]
    return markdown(header, body)


def efficiency_table(cells: Sequence[Cell]) -> str:
    """Paper Table 4: training time per epoch, peak memory, trainable parameters, average OOD
    accuracy and accuracy per compute-hour (accuracy / wall-clock hours per epoch)."""
    rows = group_rows(cells)
    benches = benchmarks_of(cells)

    def acc_per_hour(c: Cell) -> float | None:
        acc, hours = cell_avg_headline(c, benches), c.train_hours_per_epoch
        return accuracy_per_compute_hour(acc, hours * 3600) if acc is not None and hours else None

    def params_m(c: Cell) -> float | None:
        p = c.info.get("trainable_params")
        return p / 1e6 if isinstance(p, (int, float)) else None

    columns = [
        column(rows, cell_median_step_ms, None, 1),
        column(rows, lambda c: c.train_hours_per_epoch, None, 3),
        column(rows, lambda c: c.info.get("peak_mem_gb"), None, 1),
        column(rows, params_m, None, 2),
        column(rows, lambda c: cell_avg_headline(c, benches), True, 1),
        column(rows, acc_per_hour, True, 2),
    ]
    header = ["Method", "Median step (ms)", "Train time/epoch (h)", "Peak mem (GB)", "Trainable params (M)", "Avg OOD acc (%)", "Acc/CHr"]
    return markdown(header, [[lab] + [col[lab] for col in columns] for lab in row_order(list(rows))])


def lcs_layer_table(cells: Sequence[Cell]) -> str | None:
    """Paper Table 6: LCS (x1e-2) at each layer computed; the IGA / ERM ratio when both exist."""
    rows = group_rows(cells)
    layers = sorted({layer for c in cells for layer in cell_lcs(c)})
    if not layers:
        return None
    order = row_order(list(rows))
    columns = [column(rows, lambda c, l=layer: cell_lcs(c).get(l), False, 3) for layer in layers]
    body = [[lab] + [col[lab] for col in columns] for lab in order]
    iga_label = _iga_label(rows)
    if iga_label and "ERM-SFT" in rows:
        ratio = []
        for layer in layers:
            iga = Stat([cell_lcs(c).get(layer) for c in rows[iga_label]]).mean
            erm = Stat([cell_lcs(c).get(layer) for c in rows["ERM-SFT"]]).mean
            ratio.append(f"{iga / erm:.2f}" if iga is not None and erm else DASH)
        body.append([f"{iga_label} / ERM ratio"] + ratio)
    # hidden state 0 is the embedding output, which LoRA on attention never changes
    names = [f"Layer {layer}" + (" (embeddings)" if layer == 0 else "") for layer in layers]
    return markdown(["Method"] + names, body)


MASK_COLUMNS = (  # (training-log key, header, scale, tail fraction)
    ("hook.mask_mean", "mask mean", 1.0, 1.0),
    ("hook.mask_mean", "mask mean, last 10% of steps", 1.0, 0.1),
    ("hook.mask_frac_below_half", "% below 1/2", 100.0, 1.0),
    ("hook.mask_frac_below_half", "% below 1/2, last 10%", 100.0, 0.1),
    ("hook.mask_min", "min", 1.0, 1.0),
    ("hook.energy_kept", "energy kept by rank r", 1.0, 1.0),
)


def mask_table(cells: Sequence[Cell]) -> str | None:
    """Does the mask act? Its statistics averaged over training (and over its last 10%), per
    row that logged them: mean mask, share of elements masked below 1/2, the smallest mask
    value, and the share of the masked matrix's energy the rank-r truncation keeps."""
    rows = {lab: group for lab, group in group_rows(cells).items()
            if any(cell_metric_mean(c, "hook.mask_mean") is not None for c in group)}
    if not rows:
        return None
    columns = []
    for key, _, scale, tail in MASK_COLUMNS:
        columns.append(column(rows, lambda c, k=key, f=scale, t=tail: (
            None if (v := cell_metric_mean(c, k, t)) is None else f * v), None, 3 if scale == 1.0 else 1))
    body = [[lab] + [col[lab] for col in columns] for lab in sorted(rows)]
    return markdown(["Row"] + [h for _, h, _, _ in MASK_COLUMNS], body)


def compare(a: Sequence[float | None], b: Sequence[float | None], higher_is_better: bool) -> tuple[str, float | None, float | None]:
    """(verdict, difference a - b, its standard error) for two rows' per-seed values. A
    difference counts when it exceeds twice its standard error over seeds: with a few seeds
    a screen, not a significance test."""
    sa, sb = Stat(a), Stat(b)
    if sa.mean is None or sb.mean is None:
        return "not measured", None, None
    diff = sa.mean - sb.mean
    if sa.n < 2 or sb.n < 2:
        return "one seed: not judged", diff, None
    se = math.sqrt(sa.std ** 2 / sa.n + sb.std ** 2 / sb.n)
    better = diff if higher_is_better else -diff
    if better > 2 * se and better > 1e-12:
        return "better", diff, se
    if -better > 2 * se and -better > 1e-12:
        return "worse", diff, se
    return "no difference at this size", diff, se


def claims_section(cells: Sequence[Cell]) -> str | None:
    """The paper's claims as checks computed from the runs: IGA against ERM-SFT, and Full IGA
    against each ablation."""
    main = group_rows([c for c in cells if not c.ablation])
    iga_label = _iga_label(main)
    if iga_label is None or "ERM-SFT" not in main:
        return None
    iga, erm = main[iga_label], main["ERM-SFT"]
    lines = ["Rule: a difference counts when it exceeds twice its standard error over seeds "
             "(sqrt(s1²/n1 + s2²/n2)); with 3 seeds this is a screen, not a significance test.", ""]
    body = []
    for bench in benchmarks_of(cells):
        checks = [("OOD accuracy", lambda c, b=bench: c.evals.get(b, {}).get("ood_accuracy"), True),
                  ("ID accuracy", lambda c, b=bench: c.evals.get(b, {}).get("id_accuracy"), True),
                  ("Δ-gap (ID - OOD)", lambda c, b=bench: c.evals.get(b, {}).get("delta_gap"), False)]
        if _has_cue(cells, bench):
            checks.append(("OOD follows wrong cue", lambda c, b=bench: cell_cue_follow(c, b), False))
        for name, value, higher in checks:
            verdict, diff, se = compare([value(c) for c in iga], [value(c) for c in erm], higher)
            body.append([f"{bench} {name}", Stat([value(c) for c in iga]).text(1), Stat([value(c) for c in erm]).text(1),
                         DASH if diff is None else f"{diff:+.1f}", DASH if se is None else f"{se:.1f}", verdict])
    verdict, diff, se = compare([cell_default_lcs(c) for c in iga], [cell_default_lcs(c) for c in erm], False)
    body.append(["LCS (×1e-2)", Stat([cell_default_lcs(c) for c in iga]).text(2),
                 Stat([cell_default_lcs(c) for c in erm]).text(2), DASH if diff is None else f"{diff:+.2f}",
                 DASH if se is None else f"{se:.2f}", verdict])
    lines.append(markdown([f"{iga_label} against ERM-SFT", iga_label, "ERM-SFT", "difference", "std. error",
                            f"{iga_label} is"], body))
    ablations = group_rows([c for c in cells if c.ablation])
    if ablations:
        benches = benchmarks_of(cells)
        body = []
        for label, group in sorted(ablations.items()):
            for bench in benches:
                value = lambda c, b=bench: headline_accuracy(c.evals[b]) if b in c.evals else None  # noqa: E731
                verdict, diff, se = compare([value(c) for c in iga], [value(c) for c in group], True)
                row = [label, bench, DASH if diff is None else f"{diff:+.1f}", DASH if se is None else f"{se:.1f}", verdict]
                if _has_cue(cells, bench):
                    cue = lambda c, b=bench: cell_cue_follow(c, b)  # noqa: E731
                    v2, d2, _ = compare([cue(c) for c in iga], [cue(c) for c in group], False)
                    row += [DASH if d2 is None else f"{d2:+.1f}", v2]
                body.append(row)
        full = f"Full {iga_label}"
        header = [f"{full} against", "evaluation", "OOD acc. difference", "std. error", f"{full} is"]
        if any(_has_cue(cells, b) for b in benches):
            header += ["wrong-cue following difference", f"{full} is"]
        lines += ["", markdown(header, body)]
    return "\n".join(lines)


def report_body(cells: Sequence[Cell], level: int = 2, against: Sequence[str] = ()) -> list[str]:
    """The lines of one results folder's report under its title, with sections at heading ``level``:
    the whole report's body, or one student's among several; ``against``: rows to pair every row
    against, beside ERM-SFT."""

    h = "#" * level
    main_cells = [c for c in cells if not c.ablation]
    ablation_cells = [c for c in cells if c.ablation]
    seeds = sorted({c.seed for c in cells})
    parts = [
        f"{len(cells)} runs: {len(group_rows(main_cells))} methods, {len(group_rows(ablation_cells))} ablations, "
        f"seeds {', '.join(map(str, seeds))}. Entries are mean ± sample std over seeds (std shown "
        "when there is more than one seed); best in bold. Accuracies in %, LCS in units of 1e-2.",
        "",
        provenance_line(cells),
        "",
        f"{h} Main results (paper Table 2)",
        "",
        main_table(main_cells) if main_cells else "No runs without an ablation.",
        "",
    ]
    by_domain = [table for bench in benchmarks_of(cells) if (table := cue_domain_table(cells, bench))]
    if by_domain:
        parts += [f"{h} OOD wrong-cue following per domain", "", CUE_DOMAIN_NOTE, ""]
        parts += [line for table in by_domain for line in (table, "")]
    parts += [f"{h} Ablations (paper Table 3)", ""]
    parts += [ablation_table(main_cells, ablation_cells) if ablation_cells else "No ablation runs.", ""]
    parts += [f"{h} Efficiency (paper Table 4)", "", efficiency_table(main_cells) if main_cells else DASH, ""]
    lcs_table = lcs_layer_table(cells)
    parts += [f"{h} LCS by layer (paper Table 6)", "", lcs_table or "No evaluation computed LCS.", ""]
    masks = mask_table(cells)
    if masks:
        parts += [f"{h} Mask statistics over training", "", masks, ""]
    # the row labelled ERM-SFT; where a grid labels it otherwise, the ERM-SFT row by the paper's definition
    labels = {c.label for c in cells if not c.ablation}
    erm_sft = METHOD_LABELS["erm"] if METHOD_LABELS["erm"] in labels else headline_baseline(cells) or METHOD_LABELS["erm"]
    moved = update_size_table(cells, erm_sft)
    if moved:
        parts += [f"{h} How far each row moved the adapter, against {erm_sft}", "", UPDATE_SIZE_NOTE, "", moved, ""]
    parts += [f"{h} Rows by the paper's definitions, and paired comparisons against ERM-SFT", "",
              *paired_section(cells, against)]
    claims = claims_section(cells)
    if claims:
        parts += [f"{h} The paper's claims, checked on these runs", "", claims, ""]
    return parts


def _ending(discussion: str | None, figures: dict[str, str] | None) -> list[str]:
    """What follows the tables, once per report: the discussion, then the figures."""
    parts = []
    if discussion:
        parts += [discussion.strip(), ""]
    if figures:
        parts += ["## Figures", ""]
        parts += [f"![{caption}]({path})" for caption, path in figures.items()]
        parts.append("")
    return parts


def build_report(cells: Sequence[Cell], figures: dict[str, str] | None = None, title: str = "IGA results",
                 discussion: str | None = None, selection: dict | None = None, against: Sequence[str] = ()) -> str:
    chosen = ["## Selection of each row's schedule (in-distribution only)", "", *selection_section(selection)] \
        if selection else []
    return "\n".join([f"# {title}", "", *chosen, *report_body(cells, against=against), *_ending(discussion, figures)])


def side_by_side_table(students: Sequence[tuple[str, Sequence[Cell]]], bench: str) -> str:
    """Each student's ID, OOD (and wrong-cue) columns on ``bench``: a row per method row of any
    student, then a row per ablation (in the order first met), so that rows of the same setting
    line up across students."""
    all_cells = [c for _, cells in students for c in cells]
    labels = row_order(sorted({c.label for c in all_cells if not c.ablation}))
    labels += [label for label in dict.fromkeys(c.label for c in all_cells if c.ablation) if label not in labels]
    header, columns = ["Method"], []
    for name, cells in students:
        rows = group_rows(cells)
        header += [f"{name} ID", f"{name} OOD"]
        columns.append(column(rows, lambda c: c.evals.get(bench, {}).get("id_accuracy"), True, 1))
        columns.append(column(rows, lambda c: c.evals.get(bench, {}).get("ood_accuracy"), True, 1))
        if _has_cue(cells, bench):
            header.append(f"{name} OOD follows wrong cue ↓")
            columns.append(column(rows, lambda c: cell_cue_follow(c, bench), False, 1))
    return markdown(header, [[label] + [col.get(label, DASH) for col in columns] for label in labels])


def build_students_report(students: Sequence[tuple[str, Sequence[Cell]]], figures: dict[str, str] | None = None,
                          title: str = "IGA results", discussion: str | None = None) -> str:
    """Several results folders in one report: their headline columns side by side, then each
    student's own report body (tables and claims) under ``## Student: <name>``."""
    listed = "; ".join(f"{name} ({len(cells)} runs)" for name, cells in students)
    parts = [f"# {title}", "", f"{len(students)} students, one results folder each: {listed}. Each student's "
             "own tables and claims follow the side-by-side table, under its name.", "", "## Side by side", ""]
    benches = benchmarks_of([c for _, cells in students for c in cells])
    if benches:
        parts += [f"{benches[0]}: accuracy (%), mean ± sample std over seeds; the methods, then the ablations; "
                  "bold marks each student's best.", "", side_by_side_table(students, benches[0]), ""]
    else:
        parts += ["No evaluated runs.", ""]
    for name, cells in students:
        parts += [f"## Student: {name}", "", *report_body(cells, level=3)]
    return "\n".join(parts + _ending(discussion, figures))


def slug(name: str) -> str:
    """A student's name as a folder name: lowercase, every run of other characters one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _student_names(roots: Sequence[Path], names: Sequence[str] | None) -> list[str]:
    names = list(names or [])
    if len(names) != len(roots):
        raise UserError(f"--name: {len(names)} given for {len(roots)} results folders; give one --name per "
                        "folder, in the same order")
    seen: dict[str, str] = {}
    for name in names:
        if not slug(name):
            raise UserError(f"--name {name!r}: expected a name with a letter or a digit")
        if slug(name) in seen:
            raise UserError(f"--name {seen[slug(name)]!r} and --name {name!r}: two students would share "
                            f"figures/{slug(name)}; give distinct names")
        seen[slug(name)] = name
    return names


def _draw(cells: Sequence[Cell], folder: Path, out: Path, prefix: str = "") -> dict[str, str]:
    """The figures of ``cells`` in ``folder``: {caption: path relative to the report when it can be}."""
    made = {}
    for caption, name in make_figures(cells, folder).items():
        path = Path(name)
        made[prefix + caption] = str(path.relative_to(out.parent) if path.is_relative_to(out.parent) else path)
    return made


def _selection(root: Path) -> dict | None:
    """The selection stage's record (``selection.json``, written by ``iga-ds experiment``), if any."""
    path = root / "selection.json"
    return read_json(path, objects=True) if path.is_file() else None


# -- a single training run and the demo's folder ------------------------------------------------

DEFAULT_TITLE = "IGA results"
# the sections whose table `iga-ds report` prints: the first of them a report has
HEADLINE_SECTIONS = ("Accuracy in and out of distribution", "Main results", "Evaluation", "Training loss")


def _num(value: Any, digits: int = 3) -> str:
    return DASH if not isinstance(value, (int, float)) or isinstance(value, bool) else f"{value:.{digits}f}"


def _cell_text(value: Any) -> str:
    """A value as a Markdown table entry (no line breaks, no column bars)."""
    text = value if isinstance(value, str) else str(value)
    return text.replace("|", "\\|").replace("\n", " ") if text else DASH


def _base_text(config: dict[str, Any]) -> str:
    model, resolved = config.get("model") or {}, config.get("resolved") or {}
    text = str(model.get("name_or_path") or DASH)
    if model.get("tiny"):
        text += " " + ", ".join(f"{k}={v}" for k, v in sorted(model["tiny"].items()))
    folder = resolved.get("base_model_dir")
    return text + (f" (at {folder})" if folder and folder != model.get("name_or_path") else "")


def run_settings_table(config: dict[str, Any]) -> str:
    """A training run's settings from its ``config.resolved.yaml``."""
    get = lambda section: config.get(section) or {}  # noqa: E731
    lora, data, sched, resolved = get("lora"), get("data"), get("schedule"), get("resolved")
    method = get("method")
    params = method.get("params") or {}
    body = [
        ["base model", _base_text(config)],
        ["method", str(method.get("name") or DASH) + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(params.items()))})"
                                                      if params else "")],
        ["LoRA", f"r {lora.get('r')}, alpha {lora.get('alpha')}, dropout {lora.get('dropout')}, modules "
                 f"{', '.join(lora.get('target_modules') or [])}"],
        ["data", f"{data.get('train')}; domains {', '.join((resolved.get('iga') or {}).get('domains') or []) or DASH}; "
                 f"{data.get('groups_per_step')} groups per step, max_length {data.get('max_length')}, prompt "
                 f"format {resolved.get('prompt_format') or data.get('prompt_format')}"],
        ["schedule", f"lr {sched.get('lr')}, {resolved.get('total_steps', sched.get('max_steps'))} steps, warmup ratio "
                     f"{sched.get('warmup_ratio')}, gradient clipping {sched.get('gradient_clipping')}"],
        ["seed", config.get("seed")],
        ["devices", resolved.get("world_size")],
        ["trainable parameters", f"{resolved['trainable_parameters']:,} of {resolved['total_parameters']:,}"
         if isinstance(resolved.get("trainable_parameters"), int) and isinstance(resolved.get("total_parameters"), int)
         else resolved.get("trainable_parameters", DASH)],
    ]
    return markdown(["setting", "value"], [[name, _cell_text(value)] for name, value in body])


def loss_lines(metrics: Sequence[dict[str, Any]]) -> list[str]:
    """The loss curve of a training log in brief: a sentence and a table or two."""
    summary = loss_summary(metrics)
    if summary is None:
        return ["No training loss logged (metrics.jsonl).", ""]
    s = summary
    lines = [f"{s['steps']} steps logged ({s['first_step']:.0f} to {s['last_step']:.0f}).", "",
             markdown(["first step", f"lowest (step {s['min_step']:.0f})", "last step",
                       f"mean, last 10% ({s['tail_steps']} steps)"],
                      [[_num(s["first"]), _num(s["min"]), _num(s["last"]), _num(s["tail_mean"])]]), ""]
    if s["per_domain"]:
        lines += ["Per domain, mean over the last 10% of steps:", "",
                  markdown(list(s["per_domain"]), [[_num(v) for v in s["per_domain"].values()]]), ""]
    if s["median_step_ms"] is not None:
        rate = f", {s['median_tokens_per_s']:.0f} tokens/s" if s["median_tokens_per_s"] is not None else ""
        lines += [f"Median step: {s['median_step_ms']:.0f} ms{rate}.", ""]
    return lines


def _eval_lcs(result: dict[str, Any]) -> float | None:
    lcs = result.get("lcs") or {}
    layers = lcs.get("layers_x1e-2") or {}
    value = layers.get(str(lcs.get("default_layer")), layers.get(lcs.get("default_layer")))
    return value if value is not None or not layers else list(layers.values())[-1]


def evaluation_lines(cell: Cell) -> list[str]:
    """Each evaluation of a run: its headline figures, then accuracy per domain."""
    header = ["evaluation", "items scored", "accuracy %", "ID %", "OOD %", "Δ-gap", "OOD follows wrong cue %",
              "LCS (×1e-2)"]
    body = [[name, _cell_text(r.get("n_scored", DASH)), _num(r.get("accuracy"), 1), _num(r.get("id_accuracy"), 1),
             _num(r.get("ood_accuracy"), 1), _num(r.get("delta_gap"), 1), _num(r.get("ood_cue_follow"), 1),
             _num(_eval_lcs(r), 2)] for name, r in cell.evals.items()]
    domains = sorted({d for r in cell.evals.values() for d in (r.get("per_domain") or {})})
    lines = [markdown(header, body), ""]
    if domains:
        rows = [[name] + [_num(((r.get("per_domain") or {}).get(d) or {}).get("accuracy"), 1) for d in domains]
                for name, r in cell.evals.items()]
        lines += ["Accuracy per domain (%):", "", markdown(["evaluation"] + domains, rows), ""]
    return lines


def build_run_report(run: Run, figures: dict[str, str] | None = None, title: str | None = None,
                     discussion: str | None = None) -> str:
    """The report of a single training run: settings, loss curve in brief, its evaluations."""
    found = ", ".join(str(p.relative_to(run.folder)) for p in eval_files(run.folder))
    parts = [f"# {title or 'Training run ' + run.folder.name}", "",
             f"Read as {RUN}: `{run.folder}` (config.resolved.yaml, metrics.jsonl"
             + (f", {found})." if found else ")."), "", "## Settings", "", run_settings_table(run.config), "",
             "## Training loss", "", *loss_lines(run.cell.metrics), "## Evaluation", ""]
    if run.cell.evals:
        parts += evaluation_lines(run.cell)
    else:
        parts += [f"No evaluation beside the run (eval.json or eval/*.json in `{run.folder}`); `iga-ds eval --run "
                  f"{run.folder} --data TEST.jsonl --out {run.folder}/eval.json` writes one.", ""]
    return "\n".join(parts + _ending(discussion, figures))


def demo_table(demo: Demo) -> str:
    """The demo's own table (results.json), with the wrong-cue share of each method's evaluation."""
    header = ["Method", "acc ID %", "acc OOD %", "Δ-gap", "OOD follows wrong cue %", "final loss", "train s", "eval s"]
    body = []
    for row in demo.results["rows"]:
        run = demo.runs.get(row["method"])
        cue = next((r.get("ood_cue_follow") for r in run.cell.evals.values()), None) if run else None
        body.append([row["method"], _num(row.get("id_accuracy"), 1), _num(row.get("ood_accuracy"), 1),
                     _num(row.get("delta_gap"), 1), _num(cue, 1), _num(row.get("final_loss")),
                     _num(row.get("train_seconds"), 0), _num(row.get("eval_seconds"), 0)])
    return markdown(header, body)


def build_demo_report(demo: Demo, figure: str | None = None, title: str | None = None,
                      discussion: str | None = None) -> str:
    """The report of the demo's folder: its table, accuracy per domain, training losses, the figure."""
    rows = demo.results["rows"]
    settings = demo.results.get("settings") or {}
    total = demo.results.get("total_seconds")
    parts = [f"# {title or 'Demo results'}", "",
             f"Read as {DEMO} (`iga-ds demo`): `{demo.folder}/results.json` and each method's training run, "
             f"`{demo.folder}/<method>`.", "",
             "Settings: " + ", ".join(f"{k} {v}" for k, v in settings.items())
             + (f"; total {total:.0f} s." if isinstance(total, (int, float)) else "."), "",
             "## Accuracy in and out of distribution", "", demo_table(demo), ""]
    domains = sorted({d for r in rows for d in (r.get("per_domain") or {})})
    if domains:
        parts += ["## Accuracy per domain (%)", "", markdown(["Method"] + domains, [
            [r["method"]] + [_num((r.get("per_domain") or {}).get(d), 1) for d in domains] for r in rows]), ""]
    summaries = {m: loss_summary(run.cell.metrics) for m, run in demo.runs.items()}
    losses = [[m, _num(s["first"]), _num(s["min"]), _num(s["last"]), _num(s["tail_mean"])]
              for m, s in summaries.items() if s]
    if losses:
        parts += ["## Training loss", "", markdown(["Method", "first step", "lowest", "last step",
                                                    "mean, last 10%"], losses), ""]
    return "\n".join(parts + _ending(discussion, {"ID and OOD accuracy per method, training loss": figure}
                                      if figure else None))


def _run_figures(run: Run, out: Path) -> dict[str, str]:
    folder = out.parent / "figures"
    made = {"Training loss": loss_figure([run.cell], folder / "loss.png"),
            "Mask statistics over training": run_mask_figure(run.cell, folder / "mask_stats.png", window=5)}
    return {caption: os.path.relpath(path, out.parent) for caption, path in made.items() if path}


def _demo_figure(demo: Demo, out: Path, draw: bool) -> str | None:
    """The demo's figure, relative to the report: the one the demo wrote, else (a folder from
    before the demo drew one) drawn now beside the report, under figures/ (``draw``)."""
    path = demo.folder / DEMO_FIGURE
    if not path.is_file() and draw:
        path = out.parent / "figures" / DEMO_FIGURE
        demo_figure(demo.results["rows"], {m: run.cell for m, run in demo.runs.items()}, path)
    return os.path.relpath(path, out.parent) if path.is_file() else None


def _write_single(kind: str, root: Path, out: str | Path | None, figures: bool, title: str,
                  discussion: str | Path | None) -> Path:
    """The report of a demo folder or of a single training run."""
    given = None if title == DEFAULT_TITLE else title
    out = Path(out) if out else root / "report.md"
    check_output_file(out)
    text = read_text(discussion, "discussion file") if discussion is not None else None
    if kind == DEMO:
        demo = load_demo(root)
        report = build_demo_report(demo, _demo_figure(demo, out, figures), given, text)
    else:
        run = load_run(root)
        report = build_run_report(run, _run_figures(run, out) if figures else None, given, text)
    atomic_write_text(out, report)
    return out


def headline_table(report: str) -> str | None:
    """The Markdown table a report leads with: the first table under the first of
    :data:`HEADLINE_SECTIONS` it has (the demo's table, a grid's main results, a training run's
    evaluation, else its loss), or None."""
    lines = report.splitlines()
    for name in HEADLINE_SECTIONS:
        start = next((i for i, line in enumerate(lines)
                      if line.startswith("#") and line.lstrip("#").strip().startswith(name)), None)
        table: list[str] = []
        for line in lines[start + 1:] if start is not None else []:
            if line.startswith("#") or (table and not line.startswith("|")):
                break
            if line.startswith("|"):
                table.append(line)
        if table:
            return "\n".join(table)
    return None


def write_report(root: str | os.PathLike | Sequence[str | os.PathLike], out: str | Path | None = None,
                 figures: bool = True, title: str = DEFAULT_TITLE, discussion: str | Path | None = None,
                 names: Sequence[str] | None = None, log: Callable[[str], None] | None = print,
                 against: Sequence[str] = ()) -> Path:
    """Write the report of the results folder ``root`` (an experiment grid, the demo's folder or
    a single training run; ``log`` says which), or of several grids side by side, one name in
    ``names`` each; ``discussion`` is a Markdown file appended as written (interpretation; every
    number stays in the generated tables); ``against``: row labels of a single grid to pair every
    row against, beside the headline ERM-SFT."""
    roots = [Path(root)] if isinstance(root, (str, os.PathLike)) else [Path(r) for r in root]
    students = len(roots) > 1 or bool(names)
    if not students:
        kind = folder_kind(roots[0])
        if log is not None:
            log(f"{roots[0]}: read as {kind}")
        if kind != GRID and against:
            raise UserError(f"--against: pairs rows of an experiment grid; {roots[0]} is {kind}")
        if kind != GRID:
            return _write_single(kind, roots[0], out, figures, title, discussion)
    if students:
        names = _student_names(roots, names)
        if against:
            raise UserError("--against: one experiment grid at a time")
        if out is None and len(roots) > 1:
            raise UserError("--out: required with several results folders (the report belongs to none of them)")
    loaded = [load_results(r) for r in roots]
    check_against(loaded[0], against)  # before anything is drawn
    out = Path(out) if out else roots[0] / "report.md"
    check_output_file(out)
    # read before the figures are drawn: a bad discussion file leaves nothing written
    text = read_text(discussion, "discussion file") if discussion is not None else None
    made: dict[str, str] = {}
    if figures and not students:
        made = _draw(loaded[0], out.parent / "figures", out)
    elif figures:
        for name, cells in zip(names, loaded):
            made.update(_draw(cells, out.parent / "figures" / slug(name), out, prefix=f"{name}: "))
    report = (build_students_report(list(zip(names, loaded)), made, title=title, discussion=text) if students
              else build_report(loaded[0], made, title=title, discussion=text, selection=_selection(roots[0]),
                                     against=against))
    atomic_write_text(out, report)
    return out
