"""Reading a results folder: one sub-folder per experiment cell.

Layout (one cell = one method x seed x ablation run)::

    DIR/<cell>/cell.json       {"method": "iga", "seed": 0, "ablation": null, "label": "IGA",
                                "wall_time_s": 5400, "epochs": 1, "peak_mem_gb": 41.2,
                                "trainable_params": 16777216, "num_devices": 8}
    DIR/<cell>/eval.json       one ``iga-ds eval`` output, and/or
    DIR/<cell>/eval/<name>.json  several (one per benchmark)
    DIR/<cell>/metrics.jsonl   the training log (optional): one JSON object per step with
                               ``step``, ``time_s`` and mask statistics such as ``mask_mean``
    DIR/<cell>/update_norms.json  how far training moved each LoRA module (optional):
                               {"steps": 600, "modules": {"<module>": {"path": 0.12,
                                "displacement": 0.045}, ...}}

Only ``method`` and ``seed`` are required in cell.json. Cells with the same label (default:
the method's display name, or the ablation's) are seeds of one table row. A method row whose
parameters are not the package's shipped defaults (as ``DIR/<cell>/cell_spec.json``, which
``iga-ds experiment`` writes, records them) says which they are: ``IGA (normalize: mean)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from iga_ds.config.run import RUN_CONFIG
from iga_ds.errors import ConfigError, DataError
from iga_ds.files import iter_jsonl, read_json, read_yaml_file
from iga_ds.methods import method_parameters, runs_by_default
from iga_ds.metrics.cue import signals_wrong_answer
from iga_ds.metrics.mask import metric_series

# paper names of the methods (Table 2 order); unknown names are shown as given
METHOD_LABELS = {
    "erm": "ERM-SFT",
    "lora_sft": "LoRA-SFT",
    "cot_distill": "CoT-Distill",
    "irm": "IRM",
    "vrex": "V-REx",
    "pcgrad": "PCGrad",
    "and_mask": "AND-mask",
    "sand_mask": "SAND-Mask",
    "pareto": "Pareto-GS",
    "iga": "IGA",
}
# Table 3 variants; the grid names its ablations with these keys
ABLATION_LABELS = {
    "iga_no_projection": "w/o subspace projection (chain rule)",
    "iga_lora_space": "mask in LoRA space only",
    "iga_binary": "binary mask (AND-style)",
    "tau_0.1": "tau = 0.1",
    "tau_2.0": "tau = 2.0",
    "random_pairing": "w/o isomer sets (random pairing)",
    "single_domain": "w/o isomer sets (single domain)",
    "instance_split": "w/o seed-level split (leakage)",
    "n2": "N = 2 domains",
    "mean_no_mask": "all domains, plain mean (no mask)",
}


@dataclass
class Cell:
    name: str
    method: str
    seed: int
    ablation: str | None
    label: str
    info: dict[str, Any]
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    # per LoRA module {"path": .., "displacement": ..}, from update_norms.json (None: no file)
    update_norms: dict[str, dict[str, float]] | None = None
    # per evaluation, its scored items in brief (group, split, domain, correctness, cue rewrites,
    # wrong-cue following): the paired intervals resample these by isomer group
    items: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    variant: dict[str, Any] | None = None  # cell_spec.json's variant (how the row was trained)
    gradient_clipping: float | None = None  # the clip the run trained with (config.resolved.yaml)

    @property
    def train_hours_per_epoch(self) -> float | None:
        wall = self.info.get("wall_time_s")
        if not isinstance(wall, (int, float)) or wall <= 0:
            return None
        epochs = self.info.get("epochs") or 1
        return float(wall) / float(epochs) / 3600.0


def _label(method: str, ablation: str | None, given: Any, settings: str = "") -> str:
    if isinstance(given, str) and given.strip():
        return given.strip()
    if ablation:
        return ABLATION_LABELS.get(ablation, ablation)
    name = METHOD_LABELS.get(method, method)
    return f"{name} ({settings})" if settings else name


def is_iga_row(label: str) -> bool:
    """Whether a method row's label is IGA's: ``IGA`` at the shipped defaults, else ``IGA (...)``."""
    return label == METHOD_LABELS["iga"] or label.startswith(METHOD_LABELS["iga"] + " (")


def non_default_settings(method: str, params: Any) -> str:
    """``key: value, ...`` of the parameters in ``params`` that differ from the shipped defaults
    of the gradient method ``method`` (empty for a method this installation does not know)."""
    try:
        method_parameters(method)
    except ConfigError:
        return ""
    if not isinstance(params, dict):
        return ""
    return ", ".join(f"{key}: {value}" for key, value in sorted(params.items())
                     if not runs_by_default(method, key, value))


def cell_method_params(info: dict[str, Any], variant: dict[str, Any] | None) -> dict[str, Any] | None:
    """A cell's method parameters: every one as the run recorded it (``method_params`` of
    ``cell.json``), else those its grid row gave (``cell_spec.json``; the rest were the defaults
    of the package that ran it)."""
    recorded = info.get("method_params")
    if isinstance(recorded, dict):
        return recorded
    return variant.get("params") if isinstance(variant, dict) else None


def _cell_settings(folder: Path, info: dict[str, Any]) -> str:
    """The non-default parameters of a cell's gradient method."""
    spec_path = folder / "cell_spec.json"
    variant = read_json(spec_path, objects=True).get("variant") if spec_path.is_file() else None
    variant = variant if isinstance(variant, dict) else None
    method = info.get("train_method") or (variant or {}).get("method")
    params = cell_method_params(info, variant)
    return non_default_settings(str(method), params) if method and params is not None else ""


# the numbers the tables read: a number or null each, else an error naming the file and field
CELL_NUMBERS = ("wall_time_s", "epochs", "peak_mem_gb", "trainable_params", "num_devices")
EVAL_NUMBERS = ("accuracy", "id_accuracy", "ood_accuracy", "delta_gap", "ood_cue_follow")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_numbers(obj: dict[str, Any], keys: Sequence[str], where: str) -> None:
    for key in keys:
        value = obj.get(key)
        if value is not None and not _is_number(value):
            raise DataError(f"{where}: field {key!r}: expected a number or null, got {value!r:.60}")


def _check_lcs(result: dict[str, Any], where: str) -> None:
    """An evaluation's ``lcs`` block: null, or ``layers_x1e-2`` mapping layer indices to numbers."""
    lcs = result.get("lcs")
    if lcs is None:
        return
    layers = lcs.get("layers_x1e-2") if isinstance(lcs, dict) else None
    if not isinstance(lcs, dict) or not isinstance(layers or {}, dict):
        raise DataError(f"{where}: field 'lcs': expected an object with 'layers_x1e-2' {{layer: number}}")
    default = lcs.get("default_layer")
    if default is not None and (isinstance(default, bool) or not isinstance(default, int)):
        raise DataError(f"{where}: field 'lcs.default_layer': expected a layer index, got {default!r:.60}")
    for layer, value in (layers or {}).items():
        if not str(layer).lstrip("-").isdigit() or not _is_number(value):
            raise DataError(f"{where}: field 'lcs.layers_x1e-2': expected layer indices mapped to numbers, "
                            f"got {layer!r}: {value!r:.60}")


def _check_source(source: Any, where: str) -> None:
    """``cell.json``'s ``source``: absent, or the commit the cell ran at (a sha or null) and
    whether its tree was clean (true, false or null: not known)."""
    if source is None:
        return
    expected = 'expected {"commit": "<sha>" or null, "clean": true, false or null}'
    if not isinstance(source, dict):
        raise DataError(f"{where}: field 'source': {expected}, got {source!r:.60}")
    commit, clean = source.get("commit"), source.get("clean")
    if commit is not None and (not isinstance(commit, str) or not commit.strip()):
        raise DataError(f"{where}: field 'source.commit': expected a commit sha or null, got {commit!r:.60}")
    if clean is not None and not isinstance(clean, bool):
        raise DataError(f"{where}: field 'source.clean': expected true, false or null, got {clean!r:.60}")


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """The training log; a row's ``step`` must be a number (the figures' x axis)."""
    rows = []
    for lineno, row in iter_jsonl(path):
        if "step" in row and not _is_number(row["step"]):
            raise DataError(f"{path}:{lineno}: field 'step': expected a number, got {row['step']!r:.60}")
        rows.append(row)
    return rows


UPDATE_NORMS_FILE = "update_norms.json"
UPDATE_NORM_FIELDS = ("path", "displacement")


def _read_update_norms(path: Path) -> dict[str, dict[str, float]] | None:
    """Per LoRA module, the norm of its final weight change (``displacement``) and the summed
    norms of its per-step changes (``path``): how far a row moved the adapter. None without the file."""
    if not path.is_file():
        return None
    modules = read_json(path, objects=True).get("modules")
    if not isinstance(modules, dict):
        raise DataError(f"{path}: field 'modules': expected an object {{module: {{\"path\": number, "
                        f"\"displacement\": number}}}}, got {modules!r:.60}")
    norms = {}
    for name, entry in modules.items():
        if not isinstance(entry, dict):
            raise DataError(f"{path}: field 'modules.{name}': expected an object with 'path' and "
                            f"'displacement', got {entry!r:.60}")
        for key in UPDATE_NORM_FIELDS:
            value = entry.get(key)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise DataError(f"{path}: field 'modules.{name}.{key}': expected a number >= 0, got {value!r:.60}")
        norms[name] = {key: float(entry[key]) for key in UPDATE_NORM_FIELDS}
    return norms


def _read_cell(folder: Path) -> Cell:
    path = folder / "cell.json"
    info = read_json(path, objects=True)
    method, seed, ablation = info.get("method"), info.get("seed"), info.get("ablation")
    if not isinstance(method, str) or not method:
        raise DataError(f"{path}: field 'method': expected a method name, got {method!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DataError(f"{path}: field 'seed': expected an integer, got {seed!r}")
    if ablation is not None and not isinstance(ablation, str):
        raise DataError(f"{path}: field 'ablation': expected a name or null, got {ablation!r}")
    _check_numbers(info, CELL_NUMBERS, str(path))
    _check_source(info.get("source"), str(path))
    ablation = ablation or None
    settings = "" if ablation or info.get("label") else _cell_settings(folder, info)
    cell = Cell(folder.name, method, seed, ablation, _label(method, ablation, info.get("label"), settings), info)
    _read_outputs(folder, cell)
    cell.variant = _read_variant(folder)
    return cell


def eval_files(folder: Path) -> list[Path]:
    """A run's or a cell's evaluations: ``eval.json`` and ``eval/*.json``."""
    found = [folder / "eval.json"] if (folder / "eval.json").is_file() else []
    return found + (sorted((folder / "eval").glob("*.json")) if (folder / "eval").is_dir() else [])


def _read_outputs(folder: Path, cell: Cell) -> None:
    """What training and evaluation left in ``folder``: evaluations, the training log, the update
    sizes and the gradient clip, into ``cell``."""
    for eval_path in eval_files(folder):
        result = read_json(eval_path, objects=True)
        _check_numbers(result, EVAL_NUMBERS, str(eval_path))
        _check_lcs(result, str(eval_path))
        name = str(result.get("benchmark") or eval_path.stem)
        if name in cell.evals:
            raise DataError(f"{eval_path}: a second evaluation named {name!r} in cell {folder.name}")
        cell.items[name] = brief_items(result.pop("items", None) or [])
        cell.evals[name] = result
    if (folder / "metrics.jsonl").is_file():
        cell.metrics = _read_metrics(folder / "metrics.jsonl")
    cell.update_norms = _read_update_norms(folder / UPDATE_NORMS_FILE)  # beside metrics.jsonl
    cell.gradient_clipping = _read_clip(folder / RUN_CONFIG)


def item_group(row: dict[str, Any]) -> str:
    """An item's isomer group: its ``group_id``, else read from an isomer item id
    (``[ood/]<group>/<domain>``, as runs made before the field was written have it), else the id."""
    if row.get("group_id") is not None:
        return str(row["group_id"])
    item_id = str(row.get("id", ""))
    item_id = item_id[4:] if item_id.startswith("ood/") else item_id
    return item_id.rsplit("/", 1)[0] if "/" in item_id else item_id


def brief_items(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """The scored item rows of an eval.json, reduced to what paired statistics and the per-domain
    tables read; an item whose planted cue signals a wrong answer says whether it was answered
    as the cue signals (``follows_wrong_cue``)."""
    out = []
    for row in rows:
        if not isinstance(row, dict) or row.get("correct") is None:
            continue
        brief = {"group": item_group(row), "split": row.get("split"), "domain": row.get("domain"),
                 "correct": bool(row["correct"])}
        if row.get("counterfactual"):
            brief.update(counterfactual=row["counterfactual"], of=row.get("of"), group_id=brief["group"],
                         prediction=row.get("prediction"))
        elif signals_wrong_answer(row):
            brief["follows_wrong_cue"] = row.get("prediction") == row["cue_answer"]
        out.append(brief)
    return out


def _read_variant(folder: Path) -> dict[str, Any] | None:
    path = folder / "cell_spec.json"
    if not path.is_file():
        return None
    variant = read_json(path, objects=True).get("variant")
    return variant if isinstance(variant, dict) else None


def _read_clip(path: Path) -> float | None:
    """The gradient clip of a run (``schedule.gradient_clipping``); None without the file or a clip."""
    if not path.is_file():
        return None
    raw = read_yaml_file(path, "resolved run config") or {}
    clip = (raw.get("schedule") or {}).get("gradient_clipping") if isinstance(raw, dict) else None
    return float(clip) if _is_number(clip) and clip > 0 else None


# -- a single training run, the demo's folder, and which of the three a folder is ------------------

DEMO_RESULTS = "results.json"  # what `iga-ds demo` writes last
DEMO_FIGURE = "figure.png"  # the demo's figure, beside its results
GRID, DEMO, RUN = "an experiment grid", "a demo folder", "a training run"  # as the report names them


def folder_kind(root: str | Path) -> str:
    """Which results folder ``root`` is: GRID (``<cell>/cell.json``), DEMO (the demo's
    ``results.json``) or RUN (a training output folder, ``config.resolved.yaml``); else one line
    naming the folder and what was expected."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such results folder")
    if any((p / "cell.json").is_file() for p in root.iterdir()):
        return GRID
    if (root / DEMO_RESULTS).is_file():
        return DEMO
    if (root / RUN_CONFIG).is_file():
        return RUN
    raise DataError(f"{root}: not a folder iga-ds reports on; expected an experiment grid (<cell>/cell.json, "
                    f"from `iga-ds experiment`), a demo folder ({DEMO_RESULTS}, from `iga-ds demo`) or a training "
                    f"run ({RUN_CONFIG}, from `iga-ds train`)")


@dataclass
class Run:
    """A training output folder: its resolved config and what it left, as a ``Cell``."""

    folder: Path
    config: dict[str, Any]
    cell: Cell


def load_run(folder: str | Path) -> Run:
    """A training run's folder: ``config.resolved.yaml``, ``metrics.jsonl`` and any evaluation
    beside them (``eval.json``, ``eval/*.json``)."""
    folder = Path(folder)
    config = read_yaml_file(folder / RUN_CONFIG, "resolved run config")
    if not isinstance(config, dict):
        raise DataError(f"{folder / RUN_CONFIG}: expected a mapping (a training run's resolved config)")
    method = str((config.get("method") or {}).get("name") or "erm")
    seed = config.get("seed") if isinstance(config.get("seed"), int) else 0
    resolved = config.get("resolved") or {}
    info = {"method": method, "seed": seed, "trainable_params": resolved.get("trainable_parameters"),
            "num_devices": resolved.get("world_size")}
    settings = non_default_settings(method, (config.get("method") or {}).get("params"))
    cell = Cell(folder.name, method, seed, None, _label(method, None, None, settings), info)
    _read_outputs(folder, cell)
    return Run(folder, config, cell)


@dataclass
class Demo:
    """The demo's folder: ``results.json`` (settings, one row per method) and each method's run."""

    folder: Path
    results: dict[str, Any]
    runs: dict[str, Run]  # by method name, where its run folder is there


def load_demo(root: str | Path) -> Demo:
    root = Path(root)
    results = read_json(root / DEMO_RESULTS, objects=True)
    rows = results.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("method"), str) for r in rows):
        raise DataError(f"{root / DEMO_RESULTS}: field 'rows': expected a list of objects with a 'method' "
                        "(as `iga-ds demo` writes it)")
    for row in rows:
        _check_numbers(row, ("id_accuracy", "ood_accuracy", "delta_gap", "final_loss", "train_seconds",
                             "eval_seconds"), str(root / DEMO_RESULTS))
    runs = {r["method"]: load_run(root / r["method"]) for r in rows if (root / r["method"] / RUN_CONFIG).is_file()}
    return Demo(root, results, runs)


def load_results(root: str | Path) -> list[Cell]:
    """Every cell under ``root`` (folders holding a cell.json), sorted by name."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such results folder")
    cells = [_read_cell(p) for p in sorted(root.iterdir()) if (p / "cell.json").is_file()]
    if not cells:
        raise DataError(f"{root}: no <cell>/cell.json found; see docs/EXPERIMENTS.md for the results layout")
    return cells


def row_order(labels: list[str]) -> list[str]:
    """Paper order (baselines, then IGA: at the shipped defaults first, then IGA rows at other
    settings), unknown labels alphabetically before IGA."""
    paper = list(METHOD_LABELS.values())
    iga = sorted(lab for lab in labels if is_iga_row(lab))
    known = [lab for lab in paper if lab in labels and not is_iga_row(lab)]
    other = sorted(lab for lab in labels if lab not in paper and not is_iga_row(lab))
    return known + other + iga


def labels_in_order(cells: Sequence[Cell]) -> list[str]:
    """Every row's label: the method rows in paper order (:func:`row_order`), then the ablations sorted."""
    main = row_order(sorted({c.label for c in cells if not c.ablation}))
    return main + sorted({c.label for c in cells if c.ablation} - set(main))


# -- what a table reads from one cell ------------------------------------------------------------

PAPER_BENCHMARK_ORDER = ("arb", "logiqa2", "reclor", "math")


def headline_accuracy(result: dict) -> float | None:
    """OOD accuracy when the evaluation has an OOD split, else overall accuracy."""
    ood = result.get("ood_accuracy")
    return ood if ood is not None else result.get("accuracy")


def cell_lcs(cell: Cell) -> dict[int, float]:
    """LCS (x1e-2) per layer from the first evaluation of the cell that computed it."""
    for result in cell.evals.values():
        lcs = result.get("lcs")
        if lcs and lcs.get("layers_x1e-2"):
            return {int(k): float(v) for k, v in lcs["layers_x1e-2"].items()}
    return {}


def cell_default_lcs(cell: Cell) -> float | None:
    values = cell_lcs(cell)
    if not values:
        return None
    for result in cell.evals.values():
        default = (result.get("lcs") or {}).get("default_layer")
        if default in values:
            return values[default]
    return values[max(values)]  # the deepest layer computed


def cell_avg_delta_gap(cell: Cell) -> float | None:
    gaps = [r["delta_gap"] for r in cell.evals.values() if r.get("delta_gap") is not None]
    return sum(gaps) / len(gaps) if gaps else None


def cell_median_step_ms(cell: Cell) -> float | None:
    """Median optimizer-step wall time of the training log, in ms."""
    times = sorted(metric_series(cell.metrics, "step_time_s")[1])
    return 1000.0 * times[len(times) // 2] if times else None


def cell_metric_mean(cell: Cell, key: str, tail: float = 1.0) -> float | None:
    """Mean of a numeric training-log entry over the last ``tail`` fraction of its steps."""
    vals = metric_series(cell.metrics, key)[1]
    if not vals:
        return None
    vals = vals[len(vals) - max(1, int(round(tail * len(vals)))):]
    return sum(vals) / len(vals)


def cell_final_loss(cell: Cell) -> float | None:
    """Mean training loss over the last 10% of logged steps: how far a row fit its training data
    (a row that resists a shortcut by fitting less shows here)."""
    return cell_metric_mean(cell, "loss", 0.1)


def cell_cue_follow(cell: Cell, bench: str) -> float | None:
    """Share (%) of the evaluation's wrong-cue OOD items answered as the cue signals."""
    return cell.evals.get(bench, {}).get("ood_cue_follow")


def wrong_cue_items(cell: Cell, bench: str) -> list[dict[str, Any]]:
    """The cell's OOD items of ``bench`` whose planted cue signals a wrong answer (the items of
    ``ood_cue_follow``; the counterfactual rewrites left out)."""
    return [r for r in cell.items.get(bench, [])
            if r["split"] == "ood" and not r.get("counterfactual") and "follows_wrong_cue" in r]


def cell_cue_follow_by_domain(cell: Cell, bench: str) -> dict[str, float]:
    """Per domain, the share (%) of the wrong-cue OOD items answered as the cue signals: the
    pooled ``ood_cue_follow`` split by domain (a per-domain rule shows here, not in the pool)."""
    by_domain: dict[str, list[bool]] = {}
    for row in wrong_cue_items(cell, bench):
        if row.get("domain") is not None:
            by_domain.setdefault(str(row["domain"]), []).append(row["follows_wrong_cue"])
    return {domain: 100.0 * sum(flags) / len(flags) for domain, flags in sorted(by_domain.items())}


def cue_domains(cells: Sequence[Cell], bench: str) -> list[str]:
    """The domains with wrong-cue OOD items in any cell's evaluation of ``bench``, sorted."""
    return sorted({d for c in cells for d in cell_cue_follow_by_domain(c, bench)})


def cell_source(cell: Cell) -> tuple[str | None, bool | None]:
    """The commit a cell ran at and whether its tree was clean (``cell.json``'s ``source``);
    (None, None) for a cell that records neither."""
    source = cell.info.get("source") or {}
    return source.get("commit"), source.get("clean")


def cell_clipped_share(cell: Cell) -> float | None:
    """Share (%) of the logged optimizer steps whose gradient norm (before clipping) exceeded the
    run's clip; None without a clip or a logged ``grad_norm``. Logs written every k steps give
    the share over those steps."""
    norms = metric_series(cell.metrics, "grad_norm")[1]
    if cell.gradient_clipping is None or not norms:
        return None
    return 100.0 * sum(n > cell.gradient_clipping for n in norms) / len(norms)


def cell_avg_headline(cell: Cell, benchmarks: Sequence[str]) -> float | None:
    values = [headline_accuracy(cell.evals[b]) for b in benchmarks if b in cell.evals]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def benchmarks_of(cells: Sequence[Cell]) -> list[str]:
    names = {b for c in cells for b in c.evals}
    return [b for b in PAPER_BENCHMARK_ORDER if b in names] + sorted(names - set(PAPER_BENCHMARK_ORDER))


def loss_summary(metrics: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """A training log's loss curve in a few numbers: steps logged, the first, lowest and last
    loss, the mean over the last 10% of steps (overall and per domain, ``loss.<domain>``), the
    median step time and throughput. None without a logged loss."""
    steps, losses = metric_series(metrics, "loss")
    if not losses:
        return None
    tail = max(1, int(round(0.1 * len(losses))))
    low = min(range(len(losses)), key=losses.__getitem__)
    domains = sorted({k.split(".", 1)[1] for row in metrics for k in row if k.startswith("loss.")})
    per_domain = {}
    for domain in domains:
        values = metric_series(metrics, f"loss.{domain}")[1]
        per_domain[domain] = sum(values[-tail:]) / len(values[-tail:]) if values else None
    times = sorted(metric_series(metrics, "step_time_s")[1])
    rates = sorted(metric_series(metrics, "tokens_per_s")[1])
    return {"steps": len(losses), "first_step": steps[0], "last_step": steps[-1], "first": losses[0],
            "min": losses[low], "min_step": steps[low], "last": losses[-1], "tail_steps": tail,
            "tail_mean": sum(losses[-tail:]) / tail, "per_domain": per_domain,
            "median_step_ms": 1000.0 * times[len(times) // 2] if times else None,
            "median_tokens_per_s": rates[len(rates) // 2] if rates else None}
