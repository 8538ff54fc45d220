"""The report's update-size table: how far each run moved its adapter, as ratios to the ERM-SFT
run of the same seed.

A method that moves the adapter less than ERM-SFT can look more invariant only because it
learned less; these ratios put the OOD differences of the other tables in that light. They come
from each cell's ``update_norms.json`` (per LoRA module: ``displacement``, the norm of the final
weight change, and ``path``, the summed norms of its per-step changes) and from the step norms
that a training log may record as ``update_norm``.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

from iga_ds.experiments.results import METHOD_LABELS, Cell, row_order
from iga_ds.experiments.tables import column, group_rows, markdown
from iga_ds.metrics.mask import metric_series

# column order of the module types usually adapted; other types follow alphabetically
MODULE_TYPE_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class UpdateRatios:
    """One run's update size over its seed's ERM-SFT run (1.0: as far as ERM-SFT)."""

    displacement: float | None = None  # whole adapter: sqrt(sum of squared module displacements)
    median: float | None = None  # median over modules of the per-module displacement ratio
    smallest: float | None = None
    largest: float | None = None
    path: float | None = None  # summed module paths
    logged_path: float | None = None  # summed step norms of the training log
    by_type: dict[str, float] = field(default_factory=dict)  # median per-module ratio per module type


def module_type(name: str) -> str:
    """``...self_attn.q_proj`` -> ``q_proj``: the part of a module's name that says what it is."""
    return name.rsplit(".", 1)[-1]


def erm_reference(cells: Sequence[Cell], baseline: str | None = None) -> dict[int, Cell]:
    """Per seed, the run of the main table's row ``baseline`` (default: the row labelled ERM-SFT;
    not an ablation)."""
    label = baseline or METHOD_LABELS["erm"]
    refs: dict[int, Cell] = {}
    for cell in cells:
        if not cell.ablation and cell.label == label:
            refs.setdefault(cell.seed, cell)
    return refs


def _ratio(mine: float, ref: float) -> float | None:
    return mine / ref if ref > 0 else None


def _logged_path(cell: Cell) -> float | None:
    steps = metric_series(cell.metrics, "update_norm")[1]
    return sum(steps) if steps else None


def update_ratios(cell: Cell, erm: Cell | None) -> UpdateRatios:
    """``cell`` against ``erm`` over the modules both record; a ratio without its numbers is None."""
    out = UpdateRatios()
    if erm is None:
        return out
    mine, ref = _logged_path(cell), _logged_path(erm)
    if mine is not None and ref is not None:
        out.logged_path = _ratio(mine, ref)
    if not cell.update_norms or not erm.update_norms:
        return out
    common = [m for m in cell.update_norms if m in erm.update_norms]
    if not common:
        return out
    a, b = cell.update_norms, erm.update_norms
    out.displacement = _ratio(math.sqrt(sum(a[m]["displacement"] ** 2 for m in common)),
                              math.sqrt(sum(b[m]["displacement"] ** 2 for m in common)))
    out.path = _ratio(sum(a[m]["path"] for m in common), sum(b[m]["path"] for m in common))
    per_module = {m: r for m in common if (r := _ratio(a[m]["displacement"], b[m]["displacement"])) is not None}
    if per_module:
        out.median = statistics.median(per_module.values())
        out.smallest, out.largest = min(per_module.values()), max(per_module.values())
        for kind in {module_type(m) for m in per_module}:
            out.by_type[kind] = statistics.median(r for m, r in per_module.items() if module_type(m) == kind)
    return out


def module_types(ratios: Sequence[UpdateRatios]) -> list[str]:
    kinds = {kind for r in ratios for kind in r.by_type}
    return [k for k in MODULE_TYPE_ORDER if k in kinds] + sorted(kinds - set(MODULE_TYPE_ORDER))


UPDATE_SIZE_COLUMNS = (  # (UpdateRatios field, header)
    ("displacement", "Displacement, whole adapter"),
    ("median", "Per-module displacement, median"),
    ("smallest", "smallest"),
    ("largest", "largest"),
    ("path", "Path, whole adapter"),
)
UPDATE_SIZE_NOTE = (
    "A method that moves the adapter less than ERM-SFT can look more invariant only because it learned "
    "less: compare OOD differences with this table in view. Entries are ratios to the ERM-SFT run of the "
    "same seed (1.00: as far as it) over the LoRA modules both record: displacement is the norm of a "
    "module's final weight change, path the sum of its per-step change norms, and a module type's column "
    "the median displacement ratio of its modules."
)


def update_size_table(cells: Sequence[Cell], baseline: str | None = None) -> str | None:
    """How far each row moved the adapter against ``baseline``, the ERM-SFT row (per seed, then mean
    ± std over seeds), for rows in the main-table order then the ablations'; None when no cell
    recorded update norms."""
    if not any(c.update_norms for c in cells):
        return None
    refs = erm_reference(cells, baseline)
    ratios = {id(c): update_ratios(c, refs.get(c.seed)) for c in cells}
    main = group_rows([c for c in cells if not c.ablation])
    rows = {label: main[label] for label in row_order(list(main))}
    rows.update(group_rows([c for c in cells if c.ablation]))
    fields = list(UPDATE_SIZE_COLUMNS)
    if any(r.logged_path is not None for r in ratios.values()):
        fields.append(("logged_path", "Path, logged step norms"))
    columns = [column(rows, lambda c, k=key: getattr(ratios[id(c)], k), None, 2) for key, _ in fields]
    kinds = module_types(list(ratios.values()))
    columns += [column(rows, lambda c, k=kind: ratios[id(c)].by_type.get(k), None, 2) for kind in kinds]
    header = ["Row"] + [h for _, h in fields] + [f"{kind}, median" for kind in kinds]
    return markdown(header, [[label] + [col[label] for col in columns] for label in rows])
