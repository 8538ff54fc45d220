"""PNG figures for the report: OOD accuracy per method, LCS per layer, mask statistics over
training, OOD accuracy against training time, wrong-cue following per domain; a single run's
loss curve; the demo's figure (ID and OOD accuracy per method, and the training loss).
matplotlib with the Agg backend (no display), imported when a figure is drawn."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Sequence

from iga_ds.experiments.results import (
    Cell, benchmarks_of, cell_avg_headline, cell_cue_follow_by_domain, cell_lcs, cue_domains, headline_accuracy,
    labels_in_order, row_order,
)
from iga_ds.metrics.accuracy import mean_std
from iga_ds.metrics.mask import describe_mask_key, mask_keys, metric_series


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    tmp.replace(path)  # atomic: a reader never sees half a PNG
    return str(path)


def _save_with_legend_right(fig, legend_axes, title: str, path: Path) -> str:
    """Title, layout, one legend (``legend_axes``' entries) right of the axes, then save and close."""
    plt = _pyplot()
    handles, names = legend_axes.get_legend_handles_labels()
    fig.suptitle(title)
    fig.tight_layout()
    # outside the axes, right of them: the saved figure's tight bounding box takes it in
    fig.legend(handles, names, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    out = _save(fig, path)
    plt.close(fig)
    return out


def ood_accuracy_figure(cells: Sequence[Cell], path: Path) -> str | None:
    main = [c for c in cells if not c.ablation]
    benches = benchmarks_of(main)
    if not benches:
        return None
    by_label: dict[str, list[Cell]] = defaultdict(list)
    for c in main:
        by_label[c.label].append(c)
    labels = row_order(list(by_label))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(benches) * max(1, len(labels)) / 3), 3.5))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        means, stds = [], []
        for bench in benches:
            vals = [headline_accuracy(c.evals[bench]) for c in by_label[label] if bench in c.evals]
            vals = [v for v in vals if v is not None]
            m, s = mean_std(vals) if vals else (float("nan"), 0.0)
            means.append(m)
            stds.append(s)
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(benches))]
        ax.bar(xs, means, width, yerr=stds, capsize=2, label=label)
    ax.set_xticks(range(len(benches)), benches)
    ax.set_ylabel("OOD accuracy (%)")
    ax.set_title("OOD accuracy per method (mean ± std over seeds)")
    ax.legend(fontsize=7, ncol=2)
    out = _save(fig, path)
    plt.close(fig)
    return out


def lcs_layer_figure(cells: Sequence[Cell], path: Path) -> str | None:
    by_label: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in cells:
        for layer, value in cell_lcs(c).items():
            by_label[c.label][layer].append(value)
    if not by_label:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, layers in sorted(by_label.items()):
        xs = sorted(layers)
        ax.plot(xs, [mean_std(layers[x])[0] for x in xs], marker="o", label=label)
    ax.set_xlabel("layer (hidden_states index)")
    ax.set_ylabel("LCS (×1e-2)")
    ax.set_title("LCS per layer (lower is more domain-invariant)")
    ax.legend(fontsize=7)
    out = _save(fig, path)
    plt.close(fig)
    return out


def _seed_mean_series(cells: Sequence[Cell], key: str, window: int) -> tuple[list[float], list[float]]:
    """Per step, the mean of ``key`` over the cells (seeds) that logged it, then a trailing
    moving average over ``window`` steps: one readable line per table row."""
    by_step: dict[float, list[float]] = {}
    for c in cells:
        for x, y in zip(*metric_series(c.metrics, key)):
            by_step.setdefault(x, []).append(y)
    xs = sorted(by_step)
    ys = [sum(by_step[x]) / len(by_step[x]) for x in xs]
    smooth = []
    for i in range(len(ys)):
        part = ys[max(0, i - window + 1): i + 1]
        smooth.append(sum(part) / len(part))
    return xs, smooth


def mask_figure(cells: Sequence[Cell], path: Path, window: int = 25) -> str | None:
    """A grid's mask statistics over training: a panel per statistic, a line per row (the mean
    over its seeds)."""
    keys = mask_keys(row for c in cells for row in c.metrics)
    if not keys:
        return None
    keys = keys[:4]
    rows: dict[str, list[Cell]] = {}
    for c in sorted(cells, key=lambda c: (c.label, c.seed)):
        rows.setdefault(c.label, []).append(c)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys) + 3, 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        _mask_lines(ax, rows, key, window)
        ax.set_xlabel("step")
        ax.set_title(key.removeprefix("hook."))
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle(f"Mask statistics over training (mean over seeds, {window}-step moving average)")
    fig.tight_layout(rect=(0, 0, 0.78, 0.95))
    out = _save(fig, path)
    plt.close(fig)
    return out


def run_mask_figure(cell: Cell, path: Path, window: int = 5) -> str | None:
    """One training run's mask statistics over training: a panel per statistic, each titled
    with what it measures and its y axis labelled; the run's label in the title, no legend."""
    keys = mask_keys(cell.metrics)[:4]
    if not keys:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        _mask_lines(ax, {cell.label: [cell]}, key, window)
        title, ylabel = describe_mask_key(key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
    fig.suptitle(f"Mask statistics over training: {cell.label}, {window}-step moving average")
    fig.tight_layout()
    out = _save(fig, path)
    plt.close(fig)
    return out


def _mask_lines(ax, rows: dict[str, list[Cell]], key: str, window: int) -> None:
    """The statistic ``key`` per step on ``ax``: a line per row, the mean over its cells."""
    for label, group in rows.items():
        xs, ys = _seed_mean_series(group, key, window)
        if xs:
            ax.plot(xs, ys, label=label, linewidth=1.2)


def accuracy_vs_time_figure(cells: Sequence[Cell], path: Path) -> str | None:
    benches = benchmarks_of(cells)
    points = [(c.train_hours_per_epoch, cell_avg_headline(c, benches), c.label) for c in cells if not c.ablation]
    points = [p for p in points if p[0] is not None and p[1] is not None]
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label in row_order(sorted({p[2] for p in points})):
        mine = [p for p in points if p[2] == label]
        ax.scatter([p[0] for p in mine], [p[1] for p in mine], label=label)
    ax.set_xlabel("training time per epoch (h)")
    ax.set_ylabel("average OOD accuracy (%)")
    ax.set_title("OOD accuracy against training time")
    ax.legend(fontsize=7)
    out = _save(fig, path)
    plt.close(fig)
    return out


def cue_domain_figure(cells: Sequence[Cell], path: Path) -> str | None:
    """Per benchmark with wrong-cue OOD items, each row's share of them answered as the cue
    signals, per domain (mean ± std over seeds): the per-domain rule the pooled share hides."""
    benches = [b for b in benchmarks_of(cells) if cue_domains(cells, b)]
    if not benches:
        return None
    rows: dict[str, list[Cell]] = defaultdict(list)
    for c in cells:
        rows[c.label].append(c)
    labels = labels_in_order(cells)
    plt = _pyplot()
    width = 0.8 / len(labels)
    colors = plt.get_cmap("tab20" if len(labels) > 10 else "tab10").colors  # a colour per row
    fig, axes = plt.subplots(1, len(benches), figsize=(6 * len(benches), 3.5), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        domains = cue_domains(cells, bench)
        for i, label in enumerate(labels):
            stats = []
            for domain in domains:
                vals = [v for c in rows[label] if (v := cell_cue_follow_by_domain(c, bench).get(domain)) is not None]
                stats.append(mean_std(vals) if vals else (float("nan"), 0.0))
            xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(domains))]
            ax.bar(xs, [m for m, _ in stats], width, yerr=[s for _, s in stats], capsize=1, label=label,
                   color=colors[i % len(colors)])
        ax.set_xticks(range(len(domains)), domains)
        ax.set_ylim(0, 105)
        ax.set_ylabel("wrong-cue OOD items answered as the cue (%)")
        ax.set_title(bench, fontsize=9)
    return _save_with_legend_right(fig, axes[0][0], "Wrong-cue following per domain (mean ± std over seeds)", path)


def _loss_lines(ax, rows: dict[str, list[Cell]], window: int) -> bool:
    """Training loss per step of each row (mean over its cells, moving average) on ``ax``."""
    drawn = False
    for label, group in rows.items():
        xs, ys = _seed_mean_series(group, "loss", window)
        if xs:
            ax.plot(xs, ys, label=label, linewidth=1.2)
            drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"Training loss ({window}-step moving average)" if window > 1 else "Training loss")
    return drawn


def loss_figure(cells: Sequence[Cell], path: Path, window: int = 1) -> str | None:
    """The training loss of each row over the steps (a single run: its loss curve)."""
    rows: dict[str, list[Cell]] = {}
    for c in cells:
        rows.setdefault(c.label, []).append(c)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    if not _loss_lines(ax, rows, window):
        plt.close(fig)
        return None
    ax.legend(fontsize=7)
    out = _save(fig, path)
    plt.close(fig)
    return out


def demo_figure(rows: Sequence[dict], cells: dict[str, Cell], path: Path, window: int = 5) -> str | None:
    """The demo's figure: accuracy in and out of distribution per method (``rows`` of its
    results.json), and each method's training loss (``cells``: its run, by method name)."""
    if not rows:
        return None
    plt = _pyplot()
    fig, (acc, loss) = plt.subplots(1, 2, figsize=(10, 3.6))
    methods = [r["method"] for r in rows]
    width = 0.38
    for k, (key, name) in enumerate((("id_accuracy", "ID"), ("ood_accuracy", "OOD"))):
        values = [r.get(key) if r.get(key) is not None else float("nan") for r in rows]
        acc.bar([i + (k - 0.5) * width for i in range(len(rows))], values, width, label=name)
    acc.set_xticks(range(len(rows)), methods)
    acc.set_ylim(0, 100)
    acc.set_ylabel("accuracy (%)")
    acc.set_title("Accuracy in and out of distribution")
    acc.legend(fontsize=7)
    if _loss_lines(loss, {m: [cells[m]] for m in methods if m in cells}, window):
        loss.legend(fontsize=7)
    fig.tight_layout()
    out = _save(fig, path)
    plt.close(fig)
    return out


def make_figures(cells: Sequence[Cell], folder: str | Path) -> dict[str, str]:
    """Write the figures that the data supports; returns {title: path}."""
    folder = Path(folder)
    made = {
        "OOD accuracy per method": ood_accuracy_figure(cells, folder / "ood_accuracy.png"),
        "LCS per layer": lcs_layer_figure(cells, folder / "lcs_layers.png"),
        "Mask statistics over training": mask_figure(cells, folder / "mask_stats.png"),
        "OOD accuracy against training time": accuracy_vs_time_figure(cells, folder / "ood_vs_time.png"),
        "Wrong-cue following per domain": cue_domain_figure(cells, folder / "cue_by_domain.png"),
    }
    return {title: p for title, p in made.items() if p}


def _kept(entry: dict, after: bool, space: str, label: str, key: str) -> float:
    figures = entry["after_optimizer"][space] if after else entry[space]
    value = figures["methods"][label][key]
    return float("nan") if value is None else value


def diagnose_trajectory_figure(steps: Sequence[dict], path: Path) -> str | None:
    """``iga-ds diagnose --every``: kept task (solid) and kept cue (dashed) of each method against
    the checkpoint's step, as shares of ERM's (1 by definition: the dotted line), for the gradient
    and for the optimizer's update, in the factor and the weight space."""
    labels = [m["label"] for m in steps[0]["methods"] if m["label"] != "erm"] if steps else []  # erm: the reference
    if not labels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True, squeeze=False)
    xs = [entry["step"] for entry in steps]
    for row, space in enumerate(("factor", "weight")):
        for col, after in enumerate((False, True)):
            ax = axes[row][col]
            for i, label in enumerate(labels):
                for key, style in (("task", "-"), ("cue", "--")):
                    ax.plot(xs, [_kept(e, after, space, label, key) for e in steps], style, color=f"C{i % 10}",
                            marker="o", markersize=3, linewidth=1.2, label=f"{label}: {key}")
            ax.axhline(1.0, color="0.6", linestyle=":", linewidth=1)
            ax.set_title(f"{'update after the optimizer' if after else 'gradient'}, {space} space", fontsize=9)
            ax.set_ylabel("kept, share of ERM's")
    for ax in axes[1]:
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)  # steps, not fractions of one
    return _save_with_legend_right(fig, axes[0][0], "Kept task (solid) and cue (dashed) over training", path)
