"""The pieces every results table is built from: a mean and std over seeds, a column of them
over rows (best in bold), and the Markdown table."""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable, Sequence

from iga_ds.experiments.results import Cell
from iga_ds.metrics.accuracy import mean_std

DASH = "–"


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


def group_rows(cells: Sequence[Cell]) -> dict[str, list[Cell]]:
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


def column(
    rows: dict[str, list[Cell]], value: Callable[[Cell], float | None], higher_is_better: bool | None, digits: int
) -> dict[str, str]:
    stats = {label: Stat([value(c) for c in cells]) for label, cells in rows.items()}
    best = _best(stats, higher_is_better) if higher_is_better is not None else set()
    return {label: stats[label].text(digits, bold=label in best) for label in rows}


def markdown(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def markdown_rows(table: str) -> list[list[str]]:
    """The rows of a Markdown table (as :func:`markdown` writes it), header first, without the
    alignment row; ``\\|`` is a bar inside an entry, ``**`` (bold) is dropped."""
    rows = []
    for line in table.strip().splitlines():
        cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])  # between the outer bars
        cells = [c.strip().replace("\\|", "|").replace("**", "") for c in cells]
        if all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
            continue  # the alignment row
        rows.append(cells)
    return rows


def plain_table(table: str) -> str:
    """A Markdown table as aligned columns for a terminal: the first left, the rest right."""
    rows = markdown_rows(table)
    if not rows:
        return ""
    widths = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(max(map(len, rows)))]
    lines = ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip()
             for r in rows]
    lines.insert(1, "-" * max(map(len, lines)))
    return "\n".join(lines)
