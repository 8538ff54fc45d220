"""``iga-ds experiment``: a grid of methods x seeds x ablations, each cell trained then evaluated.

The grid file (YAML, read with ``yaml.safe_load``) names a base run config, the data, the
evaluations, the seeds, the methods (paper Table 2 rows) and the ablations (Table 3 rows).
Every (variant, seed) pair is a *cell* with a stable folder name, ``<variant>-s<seed>``. A
cell trains LoRA with ``iga_ds.train.trainer.Trainer`` into ``DIR/<cell>/`` and evaluates the
adapter into ``DIR/<cell>/eval/<name>.json``; ``DIR/<cell>/cell.json`` is written last and
atomically, so it marks the cell finished. That is the layout ``iga-ds report`` reads
(``iga_ds.experiments.results``).

Resuming: rerun the same command. Finished cells (with ``cell.json``) are skipped; a cell
without it was killed part way and is wiped and run again from the start. Cells run one
after another: in this process on the first GPU when there is one, else on the CPU; or, with
a launcher command (``deepspeed --num_gpus 8``, ``torchrun --nproc_per_node 4``, ``srun``),
each cell's training runs on all the devices that command gives it.
The grid file itself (keys, checks, cells, each cell's run config) is
:mod:`iga_ds.experiments.grid`; docs/EXPERIMENTS.md documents its keys.
"""
from __future__ import annotations

import dataclasses
import fcntl
import fnmatch
import gc
import hashlib
import json
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import yaml

from iga_ds.config.run import ADAPTER_CONFIG, BUILTIN_TINY, RUN_CONFIG, TinyBaseConfig, config_from_dict
from iga_ds.data.benchmarks import load_benchmark, resolve_options
from iga_ds.data.groups import complete_groups
from iga_ds.data.splits import random_pairing, split_by_instance, synthetic_eval_splits
from iga_ds.data.synth import synthesize
from iga_ds.errors import ConfigError, UserError
from iga_ds.evaluation.consistency import lcs_block
from iga_ds.evaluation.generation import eval_prompt_format, load_model
from iga_ds.evaluation.records import isomer_eval_items
from iga_ds.evaluation.runner import evaluate

# load_grid belongs to this module's interface too: reading a grid, then running it
from iga_ds.experiments.grid import (  # noqa: F401
    MARKER, POOLED_DOMAIN, Cell, Grid, Variant, base_domains, cell_run_dict, deep_merge, load_grid,
)
from iga_ds.experiments.provenance import source_state
from iga_ds.experiments.report import write_report
from iga_ds.files import atomic_write_json, atomic_write_text, read_jsonl, write_jsonl
from iga_ds.methods import resolved_parameters
from iga_ds.metrics.accuracy import format_percent
from iga_ds.train.batching import read_records
from iga_ds.train.pretrain import default_tiny_base
from iga_ds.train.trainer import Trainer


def ungroup(records: Sequence[dict[str, Any]], domains: Sequence[str]) -> list[dict[str, Any]]:
    """Each instance its own group in one pseudo-domain (CoT-Distill: targets without groups)."""
    out = []
    for r in records:
        if r["domain"] not in domains:
            continue
        meta = dict(r.get("meta") or {})
        meta["orig_group_id"], meta["orig_domain"] = r["group_id"], r["domain"]
        out.append({**r, "group_id": f"{r['group_id']}::{r['domain']}", "domain": POOLED_DOMAIN, "meta": meta})
    return out


@dataclass
class PreparedData:
    """Files shared by every cell: training records, ID and OOD evaluation records."""

    train: str
    id_test: str | None
    ood_test: str | None
    neutral_train: str | None = None  # the same training groups with a neutral cue (no shortcut)


def prepare_data(grid: Grid, out: Path, log: Callable[[str], None] = print) -> PreparedData:
    """Synthesize the data once into ``out/data`` (reused on rerun), or point at the given files."""
    data = grid.data
    if "synthetic" not in data:
        return PreparedData(data["train"], data.get("id_test"), data.get("ood_test"))
    s = data["synthetic"]
    folder = out / "data"
    done = folder / "prepared.json"
    marker = {**s, "layout": 2}  # layout 2 added the neutral twin: older folders are redone
    if not (done.is_file() and json.loads(done.read_text(encoding="utf-8")) == marker):
        strength = s.get("shortcut_by_domain", s["shortcut"])
        log(f"data: synthesizing {s['groups']} isomer groups (shortcut {strength} in training) into {folder}")
        kwargs = {k: s[k] for k in ("domains", "patterns", "min_depth", "max_depth", "answer_only") if k in s}
        cue = {k: s[k] for k in ("shortcut_by_domain", "test_cue") if k in s}  # not for the neutral twin
        synthesize(folder, groups=s["groups"], seed=s["seed"], shortcut=s["shortcut"], **kwargs, **cue)
        synthetic_eval_splits(folder, s["id_groups"], s["ood_groups"])
        # the shortcut-free twin of the training groups: same DAGs, cue slot independent of
        # the answer; rows with `cue: neutral` train on it (how far the task is learnable
        # without the shortcut)
        twin = folder / "neutral"
        synthesize(twin, groups=s["groups"], seed=s["seed"], shortcut=0.0, neutral_cue=True, **kwargs)
        fit_ids = {r["group_id"] for r in read_jsonl(folder / "fit.jsonl")}
        write_jsonl(folder / "fit_neutral.jsonl", [r for r in read_jsonl(twin / "train.jsonl") if r["group_id"] in fit_ids])
        atomic_write_json(done, marker)  # last: the folder is complete
    return PreparedData(str(folder / "fit.jsonl"), str(folder / "id_test.jsonl"), str(folder / "ood_test.jsonl"),
                        str(folder / "fit_neutral.jsonl"))


def prepare_grid(grid: Grid, out: str | Path, progress: bool = True,
                 log: Callable[[str], None] = print) -> PreparedData:
    """The work the cells share, done once: the data, and every built-in tiny base a cell trains
    on (pretrained and cached). Parallel runners call this first, so that no cell pretrains a
    base while the others race it for the same cache folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prepared = prepare_data(grid, out, log)
    shapes: dict[str, dict[str, Any]] = {}
    for cell in (Cell(v, grid.seeds[0]) for v in grid.variants):  # the seed does not change the base
        cfg = config_from_dict(cell_run_dict(grid, cell, out / cell.name, prepared.train, out))
        if cfg.model.name_or_path == BUILTIN_TINY:
            shapes.setdefault(json.dumps(cfg.model.tiny or {}, sort_keys=True), cfg.model.tiny or {})
    for tiny in shapes.values():
        folder = default_tiny_base(TinyBaseConfig(**tiny) if tiny else None, progress=progress, log=log)
        log(f"tiny base ready: {folder}")
    return prepared


def cell_data(grid: Grid, cell: Cell, prepared: PreparedData, cell_dir: Path) -> tuple[str, list[dict], list[dict]]:
    """(training file, ID records, OOD records) of a cell after its data transforms."""
    v = cell.variant
    id_records = read_jsonl(prepared.id_test) if prepared.id_test else []
    ood_records = read_jsonl(prepared.ood_test) if prepared.ood_test else []
    source = prepared.train
    if v.cue == "neutral":
        if prepared.neutral_train is None:
            raise ConfigError(f"{v.key}.cue: 'neutral' needs synthetic data (data.synthetic)")
        source = prepared.neutral_train
    if v.split == "seed" and v.pairing == "isomer" and v.grouping == "groups":
        return source, id_records, ood_records
    train = read_jsonl(source)
    if v.split == "instance":
        # the leakage ablation: one pool of all instances split by instance, as a careless
        # protocol would; its test part replaces the evaluation sets (same sizes at most)
        ood_keys = {(r["group_id"], r["domain"]) for r in ood_records}
        is_ood = lambda r: (r["group_id"], r["domain"]) in ood_keys  # noqa: E731
        fit, test = split_by_instance(train + id_records + ood_records, grid.data["instance_test_frac"], cell.seed)
        n_id = len(id_records) or len(test)
        train = fit
        id_records = [r for r in test if not is_ood(r)][:n_id]
        ood_records = [r for r in test if is_ood(r)][: len(ood_records)]
    if v.pairing == "random":
        train = random_pairing(train, cell.seed)
    if v.grouping == "none":
        train = ungroup(train, list(v.domains or base_domains(grid)))
    path = cell_dir / "train.jsonl"
    write_jsonl(path, train)
    return str(path), id_records, ood_records


def _evaluate_cell(grid: Grid, cell_dir: Path, base_dir: str, adapter: Path, id_records, ood_records,
                   lcs_records, progress: bool) -> dict[str, dict[str, Any]]:
    """Every evaluation of a cell into ``cell_dir/eval/<name>.json``; returns the summaries."""
    e = grid.eval
    model, tokenizer = load_model(base_dir, adapter, dtype=e.dtype, device=e.device)
    fmt = eval_prompt_format(tokenizer, adapter)  # as the cell trained
    generation = {"greedy": True, "max_new_tokens": e.max_new_tokens, "stop_after_answer": e.stop_after_answer,
                  **fmt.settings(), "limit": e.limit}
    model_info = {"base": str(base_dir), "adapter": str(adapter)}
    jobs: list[tuple[str, list, dict[str, Any]]] = []
    if id_records or ood_records:
        name = grid.data["name"]
        jobs.append((name, isomer_eval_items(id_records, ood_records, name), {"benchmark": name}))
    for b in grid.benchmarks:
        options = resolve_options(b["benchmark"], dict(b["options"]))
        items = load_benchmark(b["benchmark"], b["dir"], **options)[: b["limit"] or None]
        jobs.append((b["name"], items, {"benchmark": b["name"], "benchmark_dir": b["dir"], "benchmark_options": options}))
    results = {}
    for name, items, source in jobs:
        items = items[: e.limit] if e.limit else items
        extra = {}
        if name == grid.data["name"] and e.lcs and lcs_records:
            try:
                block = lcs_block(model, tokenizer, lcs_records, e.lcs_layers and list(e.lcs_layers),
                                  e.lcs_max_groups, e.batch_size, progress, fmt)
            except ValueError as exc:
                raise ConfigError(f"{grid.path}: eval.lcs_layers: {exc}") from None
            if block:
                extra["lcs"] = block
        results[name] = evaluate(
            items, model, tokenizer, cell_dir / "eval" / f"{name}.json",
            {"model": model_info, **source, "generation": generation}, fmt.prompt,
            max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, stop_after_answer=e.stop_after_answer,
            progress=progress, restart=True, extra=extra, add_special_tokens=fmt.add_special_tokens,
        )
    del model
    return results


def _spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak_memory(cuda: bool) -> bool:
    """Start a fresh peak-memory count: the GPU allocator's, or on the CPU the process's peak
    resident set (Linux: writing 5 to /proc/self/clear_refs resets VmHWM). False if impossible."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory_gb(cuda: bool) -> float | None:
    """GiB: peak GPU memory allocated by torch, or on the CPU the peak resident set (VmHWM)."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def launch_script() -> Path:
    """The repository's entry script for the DeepSpeed launcher, torchrun, srun or mpirun."""
    script = Path(__file__).resolve().parents[2] / "launch" / "train.py"
    if not script.is_file():
        raise UserError(f"--launcher needs launch/train.py of the iga-ds repository ({script} not found)")
    return script


@dataclass
class TrainOutcome:
    completed: bool
    step: int
    wall_seconds: float
    adapter_dir: Path


def _train_in_process(cfg: Any, progress: bool) -> TrainOutcome:
    trainer = Trainer(cfg, quiet=not progress)
    result = trainer.run()
    trainer.engine = None  # drop the engine (and its optimizer state) before evaluation
    del trainer
    return TrainOutcome(result.status == "completed", result.step, result.wall_seconds,
                        result.adapter_dir or Path(cfg.output_dir) / "adapter")


def _train_with_launcher(launcher: str, run: dict[str, Any], cell_dir: Path) -> TrainOutcome:
    """One cell's training as ``<launcher> launch/train.py --config run.yaml`` (e.g. all GPUs
    of the machine through ``deepspeed --num_gpus 8``); this process waits for it."""
    run_yaml = cell_dir / "run.yaml"
    atomic_write_text(run_yaml, yaml.safe_dump(run, sort_keys=False))
    cmd = shlex.split(launcher) + [str(launch_script()), "--config", str(run_yaml)]
    start = time.perf_counter()
    code = subprocess.call(cmd)
    wall = time.perf_counter() - start
    if code != 0:
        raise UserError(f"cell {cell_dir.name}: training exited with status {code}: {shlex.join(cmd)}", exit_code=1)
    metrics = read_jsonl(cell_dir / "metrics.jsonl") if (cell_dir / "metrics.jsonl").is_file() else []
    adapter = cell_dir / "adapter"
    step = int(metrics[-1]["step"]) if metrics else 0
    return TrainOutcome((adapter / ADAPTER_CONFIG).is_file(), step, wall, adapter)


def run_cell(grid: Grid, cell: Cell, out: Path, prepared: PreparedData, progress: bool = True,
             launcher: str | None = None, validation_only: bool = False) -> dict[str, Any]:
    """Train, evaluate, then write ``cell.json`` (last, atomically); returns cell.json's content.
    ``validation_only`` (a selection candidate): in-distribution data only, no OOD set, no
    benchmark, no LCS."""
    cell_dir = out / cell.name
    cell_dir.mkdir(parents=True)
    spec = grid.cell_spec(cell)
    source = source_state()  # the code as the cell starts
    atomic_write_json(cell_dir / "cell_spec.json", spec)
    train_file, id_records, ood_records = cell_data(grid, cell, prepared, cell_dir)
    if validation_only:
        ood_records, grid = [], dataclasses.replace(grid, benchmarks=[])
    run = cell_run_dict(grid, cell, cell_dir, train_file, out)
    cfg = config_from_dict(run)
    cuda = torch.cuda.is_available()
    measured = launcher is None and reset_peak_memory(cuda)  # a launched run's memory is not ours to see
    trained = _train_with_launcher(launcher, run, cell_dir) if launcher else _train_in_process(cfg, progress)
    if not trained.completed:
        raise UserError(f"cell {cell.name}: training stopped at step {trained.step} (a stop request) before "
                        "the end; rerun the same command to run this cell again", exit_code=1)
    peak = peak_memory_gb(cuda) if measured else None
    _free_memory()
    resolved = yaml.safe_load((cell_dir / RUN_CONFIG).read_text(encoding="utf-8"))["resolved"]
    domains = resolved["iga"]["domains"]
    n_groups = len(complete_groups(read_records(train_file), domains, train_file))
    epochs = trained.step * cfg.data.groups_per_step / n_groups if n_groups else None
    # LCS on the real isomer groups of the evaluation data, whatever the cell trained on
    lcs_records = read_jsonl(prepared.id_test) if prepared.id_test and not validation_only else []
    lcs_records += read_jsonl(prepared.ood_test) if prepared.ood_test and not validation_only else []
    evals = _evaluate_cell(grid, cell_dir, resolved["base_model_dir"], trained.adapter_dir, id_records,
                           ood_records, lcs_records, progress)
    if not grid.keep_checkpoints:
        shutil.rmtree(cell_dir / "checkpoints", ignore_errors=True)
    info = {
        **cell.info(),
        "wall_time_s": trained.wall_seconds,
        "epochs": epochs,
        "steps": trained.step,
        "peak_mem_gb": peak,
        "trainable_params": resolved["trainable_parameters"],
        "num_devices": resolved["world_size"],
        "domains": domains,
        "method_params": resolved_parameters(resolved["iga"]["method"], resolved["iga"]["params"]),
        "spec_hash": _spec_hash(spec),
        "source": source,
        "evaluations": {name: {k: r.get(k) for k in ("accuracy", "id_accuracy", "ood_accuracy", "delta_gap",
                                                      "ood_cue_follow")}
                        for name, r in evals.items()},
    }
    _free_memory()
    atomic_write_json(cell_dir / MARKER, info)  # last: marks the cell finished
    return info


# -- the grid ----------------------------------------------------------------------------------


def cell_work(grid: Grid, cell: Cell) -> float:
    """The sequences a cell trains on (a step's, times the steps): what its time scales with."""
    run = cell_run_dict(grid, cell, Path("."), "")
    data = run.get("data") or {}
    per_step = data.get("groups_per_step", 8) * len(data.get("domains") or base_domains(grid))
    return float(per_step * ((run.get("schedule") or {}).get("max_steps") or 1))


def _finished_seconds(folder: Path) -> float | None:
    try:
        wall = json.loads((folder / MARKER).read_text(encoding="utf-8")).get("wall_time_s")
    except (OSError, json.JSONDecodeError):
        return None
    return float(wall) if isinstance(wall, (int, float)) and wall > 0 else None


def cell_estimates(grid: Grid, out: Path, candidates: Sequence[Cell],
                   cells: Sequence[Cell]) -> tuple[dict[str, float | None], dict[str, float]]:
    """Each cell's expected seconds (``selection/<cell>`` for candidates): its work times the
    seconds per unit of work of its row's finished cells (candidates and cells alike), else of
    the grid's (median); None while nothing has finished. Also each cell's work."""
    entries = [(f"{SELECTION_DIR}/{c.name}", c, c.variant.key.rsplit("_lr", 1)[0], out / SELECTION_DIR / c.name)
               for c in candidates]
    entries += [(c.name, c, c.variant.key, out / c.name) for c in cells]
    per_row = {}  # a row's cells share their work: one run dict per row, not per seed
    for _, cell, _, _ in entries:
        if cell.variant.key not in per_row:
            per_row[cell.variant.key] = cell_work(grid, cell)
    work = {name: per_row[cell.variant.key] for name, cell, _, _ in entries}
    rates: dict[str, list[float]] = {}
    for name, _, row, folder in entries:
        seconds = _finished_seconds(folder)
        if seconds is not None:
            rates.setdefault(row, []).append(seconds / work[name])
    every = sorted(r for row in rates.values() for r in row)
    grid_rate = every[len(every) // 2] if every else None
    estimates: dict[str, float | None] = {}
    for name, _, row, _ in entries:
        rate = sum(rates[row]) / len(rates[row]) if row in rates else grid_rate
        estimates[name] = None if rate is None else rate * work[name]
    return estimates, work


def launch_order(names: Sequence[str], estimates: dict[str, float | None], work: dict[str, float]) -> list[str]:
    """Selection candidates first (their choices release rows), then the longest expected cell
    first, so that the parallel processes finish together; by work alone while no time is known."""
    known = any(v is not None for v in estimates.values())
    def key(item):
        index, name = item
        cost = (estimates[name] or 0.0) if known else work[name]
        return (not name.startswith(SELECTION_DIR + "/"), -cost, index)
    return [name for _, name in sorted(enumerate(names), key=key)]


def _first_change(recorded: Path, spec: dict[str, Any]) -> str:
    """' (KEY: was A, now B)' for the first setting that differs from the cell's recorded spec,
    '' when it cannot be told (no readable record)."""
    try:
        before = json.loads(recorded.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return ""
    now = json.loads(json.dumps(spec, default=str))  # as the hash sees it

    def walk(a: Any, b: Any, path: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                found = walk(a.get(key), b.get(key), f"{path}.{key}" if path else key)
                if found:
                    return found
            return None
        return None if a == b else f" ({path}: was {a!r}, now {b!r})"

    return walk(before, now, "") or ""


def cell_status(grid: Grid, cell: Cell, out: Path) -> str:
    """"done", "partial" (killed: no marker), "todo", or "waiting" (a row whose selection stage has
    not chosen yet); a done cell made from another spec is an error."""
    if grid.selection is not None:
        try:
            grid = selected_grid(grid, out, [cell.variant.key])
        except UserError:  # no choice yet
            return "partial" if (out / cell.name).exists() else "waiting"
        cell = Cell(next(v for v in grid.variants if v.key == cell.variant.key), cell.seed)
    cell_dir = out / cell.name
    marker = cell_dir / MARKER
    if marker.is_file():
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            return "partial"
        spec = grid.cell_spec(cell)
        if info.get("spec_hash") != _spec_hash(spec):
            raise UserError(f"{marker}: this cell was finished with other settings than {grid.path} gives now"
                            f"{_first_change(cell_dir / 'cell_spec.json', spec)}; use another --out folder, "
                            "or delete the cell folder to run it again")
        return "done"
    return "partial" if cell_dir.exists() else "todo"


def _summary_line(info: dict[str, Any]) -> str:
    parts = []
    for name, r in info.get("evaluations", {}).items():
        if r.get("ood_accuracy") is not None:
            parts.append(f"{name} ID {format_percent(r.get('id_accuracy'))} OOD {format_percent(r['ood_accuracy'])}"
                         + (f" (follows a wrong cue {format_percent(r['ood_cue_follow'])})" if r.get("ood_cue_follow") is not None else ""))
        else:
            parts.append(f"{name} {format_percent(r.get('accuracy'))}")
    return "; ".join(parts)


def run_grid(grid: Grid, out: str | Path, only: Sequence[str] = (), progress: bool = True,
             report: bool = True, launcher: str | None = None,
             log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every cell not yet finished, one after another; write the report at the end.

    ``launcher`` (e.g. ``"deepspeed --num_gpus 8"``) runs each cell's training as a separate
    job on several devices; without it training runs in this process on one device."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [c for c in grid.cells() if not only or any(fnmatch.fnmatchcase(c.name, p) for p in only)]
    candidates = selection_cells(grid, only, {c.variant.key for c in cells})
    if not cells and not candidates:
        raise UserError(f"--only {' '.join(only)}: no cell of {grid.path} matches")
    if launcher:
        launch_script()  # fail before any work when the entry script is missing
    atomic_write_text(out / "grid.yaml", grid.path.read_text(encoding="utf-8"))
    prepared = prepare_data(grid, out, log)
    if grid.selection is not None:
        run_selection(grid, out, candidates, prepared, progress, launcher, log)
        grid = selected_grid(grid, out, sorted({c.variant.key for c in cells}))
        cells = [Cell(next(v for v in grid.variants if v.key == c.variant.key), c.seed) for c in cells]
    infos = []
    width = len(str(len(cells)))
    for i, cell in enumerate(cells, 1):
        head = f"[{i:>{width}}/{len(cells)}] {cell.name}"
        status = cell_status(grid, cell, out)
        if status == "done":
            info = json.loads((out / cell.name / MARKER).read_text(encoding="utf-8"))
            log(f"{head}: finished earlier, skipped ({_summary_line(info)})")
            infos.append(info)
            continue
        if status == "partial":
            log(f"{head}: no {MARKER} (killed part way): wiping the folder and running it again")
            shutil.rmtree(out / cell.name)
        log(f"{head}: training {cell.variant.method} (seed {cell.seed}), then evaluating")
        t0 = time.perf_counter()
        info = run_cell(grid, cell, out, prepared, progress, launcher)
        log(f"{head}: done in {time.perf_counter() - t0:.0f}s; {_summary_line(info)}")
        infos.append(info)
    if report and cells:
        log(f"wrote {write_report(out)}")
    return infos


# -- the selection stage -------------------------------------------------------------------------

SELECTION_DIR = "selection"
SELECTION_FILE = "selection.json"


def _candidate_key(key: str, candidate: dict[str, Any]) -> str:
    steps = f"_steps{candidate['max_steps']}" if "max_steps" in candidate else ""
    return f"{key}_lr{candidate['lr']:g}{steps}"


def candidate_variant(variant: Variant, candidate: dict[str, Any]) -> Variant:
    """``variant`` trained with one candidate's schedule (lr, and max_steps where given)."""
    return dataclasses.replace(variant, key=_candidate_key(variant.key, candidate),
                               train=deep_merge(variant.train, {"schedule": dict(candidate)}))


def selection_cells(grid: Grid, only: Sequence[str], needed: set[str]) -> list[Cell]:
    """The selection candidates to run: those of the rows in ``needed``, and those matching an
    ``--only`` pattern on ``selection/<cell>``."""
    if grid.selection is None:
        return []
    out = []
    for v in grid.variants:
        for candidate in grid.selection.candidates(v):
            for seed in grid.selection.seeds:
                cell = Cell(candidate_variant(v, candidate), seed)
                named = any(fnmatch.fnmatchcase(f"{SELECTION_DIR}/{cell.name}", p) for p in only)
                if v.key in needed or named:
                    out.append(cell)
    return out


def run_selection(grid: Grid, out: Path, cells: Sequence[Cell], prepared: PreparedData, progress: bool,
                  launcher: str | None, log: Callable[[str], None]) -> None:
    """Train and score (in-distribution only) every candidate not yet finished, then write the
    choices of the rows whose candidates are all finished into ``out/selection.json``."""
    folder = out / SELECTION_DIR
    for i, cell in enumerate(cells, 1):
        head = f"[selection {i}/{len(cells)}] {cell.name}"
        status = cell_status(dataclasses.replace(grid, selection=None), cell, folder)
        if status == "done":
            continue
        if status == "partial":
            shutil.rmtree(folder / cell.name)
        log(f"{head}: training, then scoring on in-distribution data only")
        info = run_cell(grid, cell, folder, prepared, progress, launcher, validation_only=True)
        log(f"{head}: done; {_summary_line(info)}")
    # candidates run side by side (launch/grid_parallel.sh) each write the choices; under the lock
    # the last writer has seen every candidate finished before it
    with open(out / f"{SELECTION_FILE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        atomic_write_json(out / SELECTION_FILE, choose(grid, folder))


def _candidate_score(grid: Grid, folder: Path, variant: Variant, candidate: dict[str, Any]) -> float | None:
    """The candidate's metric, averaged over the selection seeds; None until every seed finished."""
    values = []
    for seed in grid.selection.seeds:
        marker = folder / Cell(candidate_variant(variant, candidate), seed).name / MARKER
        if not marker.is_file():
            return None
        evals = json.loads(marker.read_text(encoding="utf-8")).get("evaluations", {})
        value = evals.get(grid.data["name"], {}).get(grid.selection.metric)
        if value is None:
            return None
        values.append(float(value))
    return sum(values) / len(values)


def choose(grid: Grid, folder: Path) -> dict[str, Any]:
    """selection.json: every candidate's score per row and, for rows with all candidates scored,
    the choice: the highest score, ties to the smaller lr, then the fewer steps."""
    sel = grid.selection
    rows: dict[str, Any] = {}
    for v in grid.variants:
        tried = [{**c, sel.metric: _candidate_score(grid, folder, v, c)} for c in sel.candidates(v)]
        entry: dict[str, Any] = {"candidates": tried}
        if all(t[sel.metric] is not None for t in tried):
            best = max(range(len(tried)), key=lambda i: (tried[i][sel.metric], -i))  # first of equals: smaller
            entry["chosen"] = sel.candidates(v)[best]
        rows[v.key] = entry
    return {"metric": sel.metric, "seeds": list(sel.seeds), "rule": "highest metric; ties to the smaller lr, "
            "then the fewer steps", "rows": rows}


def selected_grid(grid: Grid, out: Path, keys: Sequence[str]) -> Grid:
    """``grid`` with each row in ``keys`` trained at its chosen schedule (``out/selection.json``);
    a row without a choice yet is an error."""
    path = out / SELECTION_FILE
    rows = json.loads(path.read_text(encoding="utf-8")).get("rows", {}) if path.is_file() else {}
    variants = []
    for v in grid.variants:
        chosen = (rows.get(v.key) or {}).get("chosen")
        if v.key in keys and chosen is None:
            raise UserError(f"{grid.path}: row {v.key} has no selected schedule yet ({path}); run its selection "
                            f"candidates first (--only '{SELECTION_DIR}/{v.key}_*')")
        variants.append(dataclasses.replace(v, train=deep_merge(v.train, {"schedule": chosen})) if chosen else v)
    return dataclasses.replace(grid, variants=variants)
