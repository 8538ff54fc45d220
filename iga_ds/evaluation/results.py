"""Reading a results folder: one sub-folder per experiment cell.

Layout (one cell = one method x seed x ablation run)::

    DIR/<cell>/cell.json       {"method": "iga", "seed": 0, "ablation": null, "label": "IGA",
                                "wall_time_s": 5400, "epochs": 1, "peak_mem_gb": 41.2,
                                "trainable_params": 16777216, "num_devices": 8}
    DIR/<cell>/eval.json       one ``iga-ds eval`` output, and/or
    DIR/<cell>/eval/<name>.json  several (one per benchmark)
    DIR/<cell>/metrics.jsonl   the training log (optional): one JSON object per step with
                               ``step``, ``time_s`` and mask statistics such as ``mask_mean``

Only ``method`` and ``seed`` are required in cell.json. Cells with the same label (default:
the method's display name, or the ablation's) are seeds of one table row.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iga_ds.errors import DataError
from iga_ds.metrics.mask import read_metrics_jsonl

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

    @property
    def train_hours_per_epoch(self) -> float | None:
        wall = self.info.get("wall_time_s")
        if not isinstance(wall, (int, float)) or wall <= 0:
            return None
        epochs = self.info.get("epochs") or 1
        return float(wall) / float(epochs) / 3600.0


def _label(method: str, ablation: str | None, given: Any) -> str:
    if isinstance(given, str) and given.strip():
        return given.strip()
    if ablation:
        return ABLATION_LABELS.get(ablation, ablation)
    return METHOD_LABELS.get(method, method)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _read_cell(folder: Path) -> Cell:
    path = folder / "cell.json"
    info = _read_json_object(path)
    method, seed, ablation = info.get("method"), info.get("seed"), info.get("ablation")
    if not isinstance(method, str) or not method:
        raise DataError(f"{path}: field 'method': expected a method name, got {method!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DataError(f"{path}: field 'seed': expected an integer, got {seed!r}")
    if ablation is not None and not isinstance(ablation, str):
        raise DataError(f"{path}: field 'ablation': expected a name or null, got {ablation!r}")
    ablation = ablation or None
    cell = Cell(folder.name, method, seed, ablation, _label(method, ablation, info.get("label")), info)
    eval_files = [folder / "eval.json"] if (folder / "eval.json").is_file() else []
    eval_files += sorted((folder / "eval").glob("*.json")) if (folder / "eval").is_dir() else []
    for eval_path in eval_files:
        result = _read_json_object(eval_path)
        name = str(result.get("benchmark") or eval_path.stem)
        if name in cell.evals:
            raise DataError(f"{eval_path}: a second evaluation named {name!r} in cell {folder.name}")
        result.pop("items", None)  # per-item rows are not needed for tables
        cell.evals[name] = result
    if (folder / "metrics.jsonl").is_file():
        cell.metrics = read_metrics_jsonl(folder / "metrics.jsonl")
    return cell


def load_results(root: str | Path) -> list[Cell]:
    """Every cell under ``root`` (folders holding a cell.json), sorted by name."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such results folder")
    cells = [_read_cell(p) for p in sorted(root.iterdir()) if (p / "cell.json").is_file()]
    if not cells:
        raise DataError(f"{root}: no <cell>/cell.json found; see docs/EVALUATION.md for the results layout")
    return cells


def row_order(labels: list[str]) -> list[str]:
    """Paper order (baselines, then IGA), unknown labels alphabetically before IGA."""
    paper = list(METHOD_LABELS.values())
    known = [lab for lab in paper if lab in labels and lab != "IGA"]
    other = sorted(lab for lab in labels if lab not in paper)
    return known + other + (["IGA"] if "IGA" in labels else [])
