"""``report.md``: tables shaped like the paper's main results, ablation, efficiency and LCS-by-layer
tables (mean +- sample std over seeds, best in bold), plus PNG figures (``figures.py``).

Numbers come only from the result files; a value a cell lacks is shown as "–".
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from iga_ds.experiments.figures import make_figures
from iga_ds.experiments.results import (
    Cell,
    benchmarks_of,
    cell_avg_delta_gap,
    cell_avg_headline,
    cell_cue_follow,
    cell_default_lcs,
    cell_final_loss,
    cell_lcs,
    cell_median_step_ms,
    cell_metric_mean,
    headline_accuracy,
    is_iga_row,
    load_results,
    row_order,
)
from iga_ds.files import atomic_write_text, check_output_file, read_text
from iga_ds.metrics.accuracy import accuracy_per_compute_hour, mean_std

DASH = "–"


# -- aggregation and formatting ------------------------------------------------------------------


class Stat:
    """Mean and sample std over seeds of one table entry (or nothing)."""

    def __init__(self, values: Sequence[float | None]):
        vals = [float(v) for v in values if v is not None]
        self.n = len(vals)
        self.mean, self.std = mean_std(vals) if vals else (None, None)

    def text(self, digits: int, bold: bool = False, with_std: bool = True) -> str:
        if self.mean is None:
            return DASH
        mean = f"{self.mean:.{digits}f}"
        mean = f"**{mean}**" if bold else mean
        return f"{mean} ± {self.std:.{digits}f}" if with_std and self.n > 1 else mean


def _group(cells: Sequence[Cell]) -> dict[str, list[Cell]]:
    rows: dict[str, list[Cell]] = defaultdict(list)
    for cell in cells:
        rows[cell.label].append(cell)
    return rows


def _best(stats: dict[str, Stat], higher_is_better: bool) -> set[str]:
    means = {k: s.mean for k, s in stats.items() if s.mean is not None}
    if len(means) < 2:
        return set()
    target = max(means.values()) if higher_is_better else min(means.values())
    return {k for k, m in means.items() if abs(m - target) < 1e-9}


def _column(
    rows: dict[str, list[Cell]], value: Callable[[Cell], float | None], higher_is_better: bool | None, digits: int
) -> dict[str, str]:
    stats = {label: Stat([value(c) for c in cells]) for label, cells in rows.items()}
    best = _best(stats, higher_is_better) if higher_is_better is not None else set()
    return {label: stats[label].text(digits, bold=label in best) for label in rows}


def _markdown(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _has_ood(cells: Sequence[Cell], bench: str) -> bool:
    return any(c.evals.get(bench, {}).get("ood_accuracy") is not None for c in cells)


def _has_cue(cells: Sequence[Cell], bench: str) -> bool:
    """Whether the evaluation measured shortcut reliance (items with a planted cue)."""
    return any(cell_cue_follow(c, bench) is not None for c in cells)


# -- the tables ---------------------------------------------------------------------------------


def main_table(cells: Sequence[Cell]) -> str:
    """Paper Table 2: ID and OOD accuracy per benchmark, LCS (x1e-2), average Delta-gap."""
    rows = _group(cells)
    order = row_order(list(rows))
    header, columns = ["Method"], []
    for bench in benchmarks_of(cells):
        header += [f"{bench} ID", f"{bench} OOD"]
        columns.append(_column(rows, lambda c, b=bench: c.evals.get(b, {}).get("id_accuracy"), True, 1))
        columns.append(_column(rows, lambda c, b=bench: c.evals.get(b, {}).get("ood_accuracy"), True, 1))
        if _has_cue(cells, bench):
            header.append(f"{bench} OOD follows wrong cue ↓")
            columns.append(_column(rows, lambda c, b=bench: cell_cue_follow(c, b), False, 1))
    header += ["LCS (×1e-2) ↓", "Avg Δ-gap ↓", "Train loss, last 10%"]
    columns.append(_column(rows, cell_default_lcs, False, 2))
    columns.append(_column(rows, cell_avg_delta_gap, False, 2))
    columns.append(_column(rows, cell_final_loss, None, 3))
    body = [[label] + [col[label] for col in columns] for label in order]
    return _markdown(header, body)


def _iga_label(labels: Sequence[str]) -> str | None:
    """The IGA row among method rows: at the shipped defaults if there is one."""
    return next((label for label in row_order(list(labels)) if is_iga_row(label)), None)


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
    rows.update(_group(ablation_cells))
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
        columns.append(_column(rows, acc, True, 1))
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
            columns.append(_column(rows, lambda c, b=bench: cell_cue_follow(c, b), False, 1))
    header += ["LCS (×1e-2) ↓", "Avg Δ vs IGA", "Train loss, last 10%"]
    columns.append(_column(rows, cell_default_lcs, False, 2))
    columns.append({lab: (f"{sum(d) / len(d):+.2f}" if (d := deltas.get(lab)) else DASH) for lab in rows})
    columns.append(_column(rows, cell_final_loss, None, 3))
    body = [[label] + [col[label] for col in columns] for label in rows]
    return _markdown(header, body)


def efficiency_table(cells: Sequence[Cell]) -> str:
    """Paper Table 4: training time per epoch, peak memory, trainable parameters, average OOD
    accuracy and accuracy per compute-hour (accuracy / wall-clock hours per epoch)."""
    rows = _group(cells)
    benches = benchmarks_of(cells)

    def acc_per_hour(c: Cell) -> float | None:
        acc, hours = cell_avg_headline(c, benches), c.train_hours_per_epoch
        return accuracy_per_compute_hour(acc, hours * 3600) if acc is not None and hours else None

    def params_m(c: Cell) -> float | None:
        p = c.info.get("trainable_params")
        return p / 1e6 if isinstance(p, (int, float)) else None

    columns = [
        _column(rows, cell_median_step_ms, None, 1),
        _column(rows, lambda c: c.train_hours_per_epoch, None, 3),
        _column(rows, lambda c: c.info.get("peak_mem_gb"), None, 1),
        _column(rows, params_m, None, 2),
        _column(rows, lambda c: cell_avg_headline(c, benches), True, 1),
        _column(rows, acc_per_hour, True, 2),
    ]
    header = ["Method", "Median step (ms)", "Train time/epoch (h)", "Peak mem (GB)", "Trainable params (M)", "Avg OOD acc (%)", "Acc/CHr"]
    return _markdown(header, [[lab] + [col[lab] for col in columns] for lab in row_order(list(rows))])


def lcs_layer_table(cells: Sequence[Cell]) -> str | None:
    """Paper Table 6: LCS (x1e-2) at each layer computed; the IGA / ERM ratio when both exist."""
    rows = _group(cells)
    layers = sorted({layer for c in cells for layer in cell_lcs(c)})
    if not layers:
        return None
    order = row_order(list(rows))
    columns = [_column(rows, lambda c, l=layer: cell_lcs(c).get(l), False, 3) for layer in layers]
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
    return _markdown(["Method"] + names, body)


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
    rows = {lab: group for lab, group in _group(cells).items()
            if any(cell_metric_mean(c, "hook.mask_mean") is not None for c in group)}
    if not rows:
        return None
    columns = []
    for key, _, scale, tail in MASK_COLUMNS:
        columns.append(_column(rows, lambda c, k=key, f=scale, t=tail: (
            None if (v := cell_metric_mean(c, k, t)) is None else f * v), None, 3 if scale == 1.0 else 1))
    body = [[lab] + [col[lab] for col in columns] for lab in sorted(rows)]
    return _markdown(["Row"] + [h for _, h, _, _ in MASK_COLUMNS], body)


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
    main = _group([c for c in cells if not c.ablation])
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
    lines.append(_markdown([f"{iga_label} against ERM-SFT", iga_label, "ERM-SFT", "difference", "std. error",
                            f"{iga_label} is"], body))
    ablations = _group([c for c in cells if c.ablation])
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
        lines += ["", _markdown(header, body)]
    return "\n".join(lines)


def build_report(cells: Sequence[Cell], figures: dict[str, str] | None = None, title: str = "IGA results",
                 discussion: str | None = None) -> str:
    main_cells = [c for c in cells if not c.ablation]
    ablation_cells = [c for c in cells if c.ablation]
    seeds = sorted({c.seed for c in cells})
    parts = [
        f"# {title}",
        "",
        f"{len(cells)} runs: {len(_group(main_cells))} methods, {len(_group(ablation_cells))} ablations, "
        f"seeds {', '.join(map(str, seeds))}. Entries are mean ± sample std over seeds (std shown "
        "when there is more than one seed); best in bold. Accuracies in %, LCS in units of 1e-2.",
        "",
        "## Main results (paper Table 2)",
        "",
        main_table(main_cells) if main_cells else "No runs without an ablation.",
        "",
    ]
    parts += ["## Ablations (paper Table 3)", ""]
    parts += [ablation_table(main_cells, ablation_cells) if ablation_cells else "No ablation runs.", ""]
    parts += ["## Efficiency (paper Table 4)", "", efficiency_table(main_cells) if main_cells else DASH, ""]
    lcs_table = lcs_layer_table(cells)
    parts += ["## LCS by layer (paper Table 6)", "", lcs_table or "No evaluation computed LCS.", ""]
    masks = mask_table(cells)
    if masks:
        parts += ["## Mask statistics over training", "", masks, ""]
    claims = claims_section(cells)
    if claims:
        parts += ["## The paper's claims, checked on these runs", "", claims, ""]
    if discussion:
        parts += [discussion.strip(), ""]
    if figures:
        parts += ["## Figures", ""]
        parts += [f"![{title}]({path})" for title, path in figures.items()]
        parts.append("")
    return "\n".join(parts)


def write_report(root: str | Path, out: str | Path | None = None, figures: bool = True, title: str = "IGA results",
                 discussion: str | Path | None = None) -> Path:
    """Write the report of the results folder ``root``; ``discussion`` is a Markdown file
    appended as written (interpretation; every number stays in the generated tables)."""
    root = Path(root)
    cells = load_results(root)
    out = Path(out) if out else root / "report.md"
    check_output_file(out)
    # read before the figures are drawn: a bad discussion file leaves nothing written
    text = read_text(discussion, "discussion file") if discussion is not None else None
    made: dict[str, str] = {}
    if figures:
        for caption, path in make_figures(cells, out.parent / "figures").items():
            made[caption] = str(Path(path).relative_to(out.parent)) if Path(path).is_relative_to(out.parent) else str(path)
    atomic_write_text(out, build_report(cells, made, title=title, discussion=text))
    return out
