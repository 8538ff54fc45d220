"""``iga-ds experiment``: a grid of methods x seeds x ablations, each cell trained then evaluated.

The grid file (YAML, read with ``yaml.safe_load``) names a base run config, the data, the
evaluations, the seeds, the methods (paper Table 2 rows) and the ablations (Table 3 rows).
Every (variant, seed) pair is a *cell* with a stable folder name, ``<variant>-s<seed>``. A
cell trains LoRA with ``iga_ds.train.trainer.Trainer`` into ``DIR/<cell>/`` and evaluates the
adapter into ``DIR/<cell>/eval/<name>.json``; ``DIR/<cell>/cell.json`` is written last and
atomically, so it marks the cell finished. That is the layout ``iga-ds report`` reads
(``iga_ds.evaluation.results``).

Resuming: rerun the same command. Finished cells (with ``cell.json``) are skipped; a cell
without it was killed part way and is wiped and run again from the start. Cells run one
after another: in this process on the first GPU when there is one, else on the CPU; or, with
a launcher command (``deepspeed --num_gpus 8``, ``torchrun --nproc_per_node 4``, ``srun``),
each cell's training runs on all the devices that command gives it.
See docs/EVALUATION.md for the grid keys.
"""
from __future__ import annotations

import copy
import fnmatch
import gc
import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from iga_ds.errors import ConfigError, UserError
from iga_ds.utils_io import atomic_write_json, atomic_write_text

MARKER = "cell.json"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=]*$")
POOLED_DOMAIN = "pooled"  # the one pseudo-domain of ungrouped training (CoT-Distill)

GRID_KEYS = ("train_config", "train", "data", "benchmarks", "eval", "seeds", "methods", "ablations",
             "keep_checkpoints")
VARIANT_KEYS = ("method", "params", "domains", "pairing", "split", "grouping", "label", "train", "cue")
SYNTH_KEYS = ("groups", "seed", "shortcut", "domains", "id_groups", "ood_groups", "patterns", "min_depth",
              "max_depth", "answer_only")
DATA_KEYS = ("name", "synthetic", "train", "id_test", "ood_test", "instance_test_frac")
BENCH_KEYS = ("name", "benchmark", "dir", "options", "limit")


@dataclass(frozen=True)
class EvalSettings:
    max_new_tokens: int = 512
    batch_size: int = 8
    dtype: str = "auto"
    device: str = "auto"
    limit: int | None = None  # items per evaluation (quick checks)
    lcs: bool = True
    lcs_layers: tuple[int, ...] | None = None  # None: penultimate
    lcs_max_groups: int = 500
    stop_after_answer: bool = True


@dataclass(frozen=True)
class Variant:
    """One row of a table: a method (``kind='method'``) or an ablation of one."""

    key: str
    kind: str
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    domains: tuple[str, ...] | None = None
    pairing: str = "isomer"  # isomer | random
    split: str = "seed"  # seed | instance
    grouping: str = "groups"  # groups | none
    label: str | None = None
    train: dict[str, Any] = field(default_factory=dict)
    cue: str = "planted"  # planted | neutral (synthetic data: train on the shortcut-free twin)

    def spec(self) -> dict[str, Any]:
        spec = {"key": self.key, "kind": self.kind, "method": self.method, "params": self.params,
                "domains": list(self.domains) if self.domains else None, "pairing": self.pairing,
                "split": self.split, "grouping": self.grouping, "label": self.label, "train": self.train}
        if self.cue != "planted":  # absent by default: cells of older grids keep their hash
            spec["cue"] = self.cue
        return spec


@dataclass(frozen=True)
class Cell:
    variant: Variant
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant.key}-s{self.seed}"

    def info(self) -> dict[str, Any]:
        """The cell.json fields the report reads (method, seed, ablation, label)."""
        v = self.variant
        info: dict[str, Any] = {
            "method": v.key if v.kind == "method" else v.method,
            "seed": self.seed,
            "ablation": v.key if v.kind == "ablation" else None,
            "train_method": v.method,
        }
        if v.label:
            info["label"] = v.label
        return info


@dataclass
class Grid:
    path: Path
    run: dict[str, Any]  # the run YAML shared by every cell (base file + ``train``)
    data: dict[str, Any]
    benchmarks: list[dict[str, Any]]
    eval: EvalSettings
    seeds: list[int]
    variants: list[Variant]
    keep_checkpoints: bool = False

    def cells(self) -> list[Cell]:
        """Seed-major order: every variant at the first seed, then the next seed, so a first
        complete table exists early."""
        return [Cell(v, s) for s in self.seeds for v in self.variants]

    def cell_spec(self, cell: Cell) -> dict[str, Any]:
        """Everything that decides a cell's result; its hash guards against reusing a folder."""
        return {"run": self.run, "data": self.data, "benchmarks": self.benchmarks,
                "eval": self.eval.__dict__, "variant": cell.variant.spec(), "seed": cell.seed}


# -- reading the grid file -----------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return value


def _check_keys(mapping: dict[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in mapping:
        if key not in allowed:
            prefix = f"{where}." if where else ""
            raise ConfigError(f"{prefix}{key}: unknown key; expected one of: {', '.join(allowed)}")


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(x, str) and x for x in value):
        raise ConfigError(f"{where}: expected a non-empty list of names, got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: names must be unique, got {value!r}")
    return tuple(value)


def _choice(value: Any, choices: Sequence[str], where: str) -> str:
    if value not in choices:
        raise ConfigError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _variant(key: Any, raw: Any, kind: str, where: str) -> Variant:
    if not isinstance(key, str) or not NAME_PATTERN.match(key):
        raise ConfigError(f"{where}: {key!r} is not a usable cell name (letters, digits, _ . + =)")
    raw = _mapping(raw, where)
    _check_keys(raw, VARIANT_KEYS, where)
    from iga_ds.methods import get_method, method_class

    method = raw.get("method", key if kind == "method" else "iga")
    if not isinstance(method, str):
        raise ConfigError(f"{where}.method: expected a method name, got {method!r}")
    try:
        method_class(method)
    except ConfigError as exc:
        hint = "" if "method" in raw else f" (the method defaults to the entry's name{'' if kind == 'method' else ', iga'})"
        raise ConfigError(f"{where}.method: {exc}{hint}") from None
    params = _mapping(raw.get("params"), f"{where}.params")
    try:
        get_method(method, **params)
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}.params: {exc}") from None
    domains = _str_list(raw["domains"], f"{where}.domains") if raw.get("domains") is not None else None
    grouping = _choice(raw.get("grouping", "groups"), ("groups", "none"), f"{where}.grouping")
    if grouping == "none" and method != "erm":
        raise ConfigError(f"{where}.grouping: 'none' trains single instances, which only method erm can; got {method!r}")
    if domains is not None and len(domains) < 2 and method != "erm":
        raise ConfigError(f"{where}.domains: method {method!r} needs at least 2 domains, got {list(domains)}")
    label = raw.get("label")
    if label is not None and (not isinstance(label, str) or not label.strip()):
        raise ConfigError(f"{where}.label: expected a row label, got {label!r}")
    return Variant(
        key=key, kind=kind, method=method, params=copy.deepcopy(params), domains=domains,
        pairing=_choice(raw.get("pairing", "isomer"), ("isomer", "random"), f"{where}.pairing"),
        split=_choice(raw.get("split", "seed"), ("seed", "instance"), f"{where}.split"),
        grouping=grouping, label=label, train=copy.deepcopy(_mapping(raw.get("train"), f"{where}.train")),
        cue=_choice(raw.get("cue", "planted"), ("planted", "neutral"), f"{where}.cue"),
    )


def _eval_settings(raw: dict[str, Any]) -> EvalSettings:
    defaults = EvalSettings()
    _check_keys(raw, tuple(defaults.__dict__), "eval")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"eval.{key}"
        if key in ("max_new_tokens", "batch_size", "lcs_max_groups"):
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{where}: expected a positive integer, got {value!r}")
        elif key == "limit":
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(f"{where}: expected a positive integer or null, got {value!r}")
        elif key in ("lcs", "stop_after_answer"):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected true or false, got {value!r}")
        elif key == "lcs_layers":
            if value is not None and (not isinstance(value, list) or not value or not all(_is_int(x) for x in value)):
                raise ConfigError(f"{where}: expected a list of layer indices (0 = embeddings, -2 = penultimate), got {value!r}")
            value = tuple(value) if value is not None else None
        elif key == "dtype":
            value = _choice(value, ("auto", "float32", "bfloat16", "float16"), where)
        elif not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        values[key] = value
    return EvalSettings(**values)


def _data(raw: dict[str, Any], grid_dir: Path) -> dict[str, Any]:
    _check_keys(raw, DATA_KEYS, "data")
    data: dict[str, Any] = {"name": raw.get("name", "synthetic" if "synthetic" in raw else "isomer")}
    if not isinstance(data["name"], str) or not NAME_PATTERN.match(data["name"]):
        raise ConfigError(f"data.name: expected a short evaluation name, got {data['name']!r}")
    frac = raw.get("instance_test_frac", 0.2)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac < 1:
        raise ConfigError(f"data.instance_test_frac: expected a fraction in (0, 1), got {frac!r}")
    data["instance_test_frac"] = float(frac)
    if "synthetic" in raw:
        if any(k in raw for k in ("train", "id_test", "ood_test")):
            raise ConfigError("data: give either synthetic or train/id_test/ood_test files, not both")
        synth = _mapping(raw["synthetic"], "data.synthetic")
        _check_keys(synth, SYNTH_KEYS, "data.synthetic")
        spec = {"groups": 300, "seed": 1, "shortcut": 0.9, "id_groups": 20, "ood_groups": 20, **synth}
        for key in ("groups", "seed", "id_groups", "ood_groups"):
            if not _is_int(spec[key]) or spec[key] < (0 if key == "seed" else 1):
                raise ConfigError(f"data.synthetic.{key}: expected a positive integer, got {spec[key]!r}")
        if isinstance(spec["shortcut"], bool) or not isinstance(spec["shortcut"], (int, float)) \
                or not 0 <= spec["shortcut"] <= 1:
            raise ConfigError(f"data.synthetic.shortcut: expected a probability in [0, 1], got {spec['shortcut']!r}")
        if "domains" in spec:
            spec["domains"] = list(_str_list(spec["domains"], "data.synthetic.domains"))
        if "patterns" in spec:
            from iga_ds.data.patterns import PATTERNS

            spec["patterns"] = list(_str_list(spec["patterns"], "data.synthetic.patterns"))
            unknown = [p for p in spec["patterns"] if p not in PATTERNS]
            if unknown or not spec["patterns"]:
                raise ConfigError(f"data.synthetic.patterns: expected some of {', '.join(PATTERNS)}, got {spec['patterns']!r}")
        for key in ("min_depth", "max_depth"):
            if key in spec and (not _is_int(spec[key]) or not 1 <= spec[key] <= 4):
                raise ConfigError(f"data.synthetic.{key}: expected an integer in 1..4, got {spec[key]!r}")
        if spec.get("min_depth", 1) > spec.get("max_depth", 4):
            raise ConfigError("data.synthetic: expected min_depth <= max_depth")
        if "answer_only" in spec and not isinstance(spec["answer_only"], bool):
            raise ConfigError(f"data.synthetic.answer_only: expected true or false, got {spec['answer_only']!r}")
        data["synthetic"] = spec
        return data
    if "train" not in raw:
        raise ConfigError("data: expected synthetic (generated here) or train (an isomer JSON Lines file)")
    for key in ("train", "id_test", "ood_test"):
        if key in raw:
            value = raw[key]
            if not isinstance(value, str) or not value:
                raise ConfigError(f"data.{key}: expected the path of an isomer JSON Lines file, got {value!r}")
            path = Path(value).expanduser()
            path = path if path.is_absolute() else grid_dir / path
            if not path.is_file():
                raise ConfigError(f"data.{key}: {path} not found")
            data[key] = str(path.resolve())
    return data


def _benchmarks(raw: Any, grid_dir: Path) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"benchmarks: expected a list of benchmark entries, got {raw!r}")
    out = []
    for i, entry in enumerate(raw):
        where = f"benchmarks[{i}]"
        entry = _mapping(entry, where)
        _check_keys(entry, BENCH_KEYS, where)
        for key in ("benchmark", "dir"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ConfigError(f"{where}.{key}: expected a string, got {entry.get(key)!r}")
        name = entry.get("name", entry["benchmark"])
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ConfigError(f"{where}.name: expected a short evaluation name, got {name!r}")
        limit = entry.get("limit")
        if limit is not None and (not _is_int(limit) or limit < 1):
            raise ConfigError(f"{where}.limit: expected a positive integer or null, got {limit!r}")
        folder = Path(entry["dir"]).expanduser()
        folder = folder if folder.is_absolute() else grid_dir / folder
        out.append({"name": name, "benchmark": entry["benchmark"], "dir": str(folder),
                    "options": copy.deepcopy(_mapping(entry.get("options"), f"{where}.options")), "limit": limit})
    names = [b["name"] for b in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"benchmarks: evaluation names must be unique, got {names}")
    return out


def load_grid(path: str | Path) -> Grid:
    """Read and check a grid file; every error names the file and the key."""
    from iga_ds.utils_io import read_yaml_file

    path = Path(path)
    raw = read_yaml_file(path, "grid file") or {}
    try:
        return _parse_grid(raw, path)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _parse_grid(raw: Any, path: Path) -> Grid:
    if not isinstance(raw, dict):
        raise ConfigError("expected a mapping at the top level")
    _check_keys(raw, GRID_KEYS, "")
    grid_dir = path.parent
    run: dict[str, Any] = {}
    if raw.get("train_config") is not None:
        base = raw["train_config"]
        if not isinstance(base, str):
            raise ConfigError(f"train_config: expected the path of a run YAML, got {base!r}")
        base_path = grid_dir / base if not Path(base).is_absolute() else Path(base)
        if not base_path.is_file():
            raise ConfigError(f"train_config: {base_path} not found")
        run = _mapping(yaml.safe_load(base_path.read_text(encoding="utf-8")), "train_config")
        grid_dir_of_run = base_path.parent
    else:
        grid_dir_of_run = grid_dir
    run = deep_merge(run, _mapping(raw.get("train"), "train"))
    for key in ("output_dir", "seed", "method", "resume"):
        run.pop(key, None)  # set per cell
    run.get("data", {}).pop("train", None)
    _resolve_run_paths(run, grid_dir_of_run)

    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(_is_int(s) and s >= 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: expected a list of distinct non-negative integers, got {seeds!r}")
    variants = [_variant(k, v, "method", f"methods.{k}") for k, v in _mapping(raw.get("methods"), "methods").items()]
    variants += [_variant(k, v, "ablation", f"ablations.{k}")
                 for k, v in _mapping(raw.get("ablations"), "ablations").items()]
    if not variants:
        raise ConfigError("methods: expected at least one method (or ablation)")
    keys = [v.key for v in variants]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ConfigError(f"ablations.{dup}: the name is also a method; cell names must be unique")
    keep = raw.get("keep_checkpoints", False)
    if not isinstance(keep, bool):
        raise ConfigError(f"keep_checkpoints: expected true or false, got {keep!r}")
    grid = Grid(path, run, _data(_mapping(raw.get("data"), "data"), grid_dir),
                _benchmarks(raw.get("benchmarks"), grid_dir), _eval_settings(_mapping(raw.get("eval"), "eval")),
                list(seeds), variants, keep)
    for v in variants:  # every cell's run config is checked before anything runs
        where = f"{'methods' if v.kind == 'method' else 'ablations'}.{v.key}"
        try:
            from iga_ds.train.config import config_from_dict

            config_from_dict(cell_run_dict(grid, Cell(v, seeds[0]), Path("cell"), "data.jsonl"))
        except ConfigError as exc:
            raise ConfigError(f"{where}: run config: {exc}") from None
    return grid


def _resolve_run_paths(run: dict[str, Any], base: Path) -> None:
    """Relative paths of the run YAML: the working directory first, then the YAML's folder."""
    from iga_ds.train.config import resolve_relative

    if isinstance(run.get("deepspeed"), str):
        run["deepspeed"] = resolve_relative(run["deepspeed"], base)
    model = run.get("model")
    if isinstance(model, dict) and isinstance(model.get("name_or_path"), str):
        model["name_or_path"] = resolve_relative(model["name_or_path"], base)
    if isinstance(run.get("tokenizer"), str):
        run["tokenizer"] = resolve_relative(run["tokenizer"], base)


# -- one cell ----------------------------------------------------------------------------------


def _base_domains(grid: Grid) -> list[str]:
    from iga_ds.data.domains import DEFAULT_DOMAINS

    given = (grid.run.get("data") or {}).get("domains")
    if given:
        return list(given)
    synth = grid.data.get("synthetic") or {}
    return list(synth.get("domains") or DEFAULT_DOMAINS)


def cell_run_dict(grid: Grid, cell: Cell, cell_dir: Path, train_file: str, out: Path | None = None) -> dict[str, Any]:
    """The run YAML of one cell: shared settings, the variant's overrides, then what the grid owns."""
    v = cell.variant
    run = deep_merge(grid.run, v.train)
    data = run.setdefault("data", {})
    if v.domains is not None:
        data["domains"] = list(v.domains)
    if v.grouping == "none":
        # single instances in one pseudo-domain; as many sequences per step as N-domain groups
        n = len(data.get("domains") or _base_domains(grid))
        data["domains"] = [POOLED_DOMAIN]
        data["groups_per_step"] = n * data.get("groups_per_step", 8)
        data["groups_per_micro_batch"] = n * data.get("groups_per_micro_batch", 2)
    data["train"] = train_file
    run["output_dir"] = str(cell_dir)
    run["method"] = {"name": v.method, "params": copy.deepcopy(v.params)}
    run["seed"] = cell.seed
    run["resume"] = "never"  # a cell is finished or wiped, never continued
    if "deepspeed" not in run:
        run["deepspeed"] = default_ds_config(out) if out is not None else "ds_configs/zero2_fp32.json"
    return run


def default_ds_config(out: Path) -> str:
    """The shipped CPU/GPU-neutral ZeRO-2 fp32 config (written under ``out`` when not installed
    from the repository); the method always comes from the cell."""
    from iga_ds.train.demo import _demo_ds_config

    return _demo_ds_config(out)


def _read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def _write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


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
    from iga_ds.data.synth import synthesize
    from iga_ds.train.demo import _first_groups, _split_holdout

    s = data["synthetic"]
    folder = out / "data"
    done = folder / "prepared.json"
    marker = {**s, "layout": 2}  # layout 2 added the neutral twin: older folders are redone
    if not (done.is_file() and json.loads(done.read_text(encoding="utf-8")) == marker):
        log(f"data: synthesizing {s['groups']} isomer groups (shortcut {s['shortcut']} in training) into {folder}")
        kwargs = {k: s[k] for k in ("domains", "patterns", "min_depth", "max_depth", "answer_only") if k in s}
        synthesize(folder, groups=s["groups"], seed=s["seed"], shortcut=s["shortcut"], **kwargs)
        _split_holdout(folder / "train.jsonl", s["id_groups"], folder / "fit.jsonl", folder / "id_pool.jsonl")
        _write_jsonl(folder / "id_test.jsonl", _first_groups(folder / "id_pool.jsonl", s["id_groups"]))
        _write_jsonl(folder / "ood_test.jsonl", _first_groups(folder / "test.jsonl", s["ood_groups"]))
        # the shortcut-free twin of the training groups: same DAGs, cue slot independent of
        # the answer; rows with `cue: neutral` train on it (how far the task is learnable
        # without the shortcut)
        twin = folder / "neutral"
        synthesize(twin, groups=s["groups"], seed=s["seed"], shortcut=0.0, neutral_cue=True, **kwargs)
        fit_ids = {r["group_id"] for r in _read_jsonl(folder / "fit.jsonl")}
        _write_jsonl(folder / "fit_neutral.jsonl",
                     [r for r in _read_jsonl(twin / "train.jsonl") if r["group_id"] in fit_ids])
        atomic_write_json(done, marker)  # last: the folder is complete
    return PreparedData(str(folder / "fit.jsonl"), str(folder / "id_test.jsonl"), str(folder / "ood_test.jsonl"),
                        str(folder / "fit_neutral.jsonl"))


def prepare_grid(grid: Grid, out: str | Path, progress: bool = True,
                 log: Callable[[str], None] = print) -> PreparedData:
    """The work the cells share, done once: the data, and every built-in tiny base a cell trains
    on (pretrained and cached). Parallel runners call this first, so that no cell pretrains a
    base while the others race it for the same cache folder."""
    from iga_ds.train.config import BUILTIN_TINY, config_from_dict
    from iga_ds.train.model import TinyBaseConfig
    from iga_ds.train.pretrain import default_tiny_base

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prepared = prepare_data(grid, out, log)
    shapes: dict[str, dict[str, Any]] = {}
    for cell in grid.cells():
        cfg = config_from_dict(cell_run_dict(grid, cell, out / cell.name, prepared.train, out))
        if cfg.model.name_or_path == BUILTIN_TINY:
            shapes.setdefault(json.dumps(cfg.model.tiny or {}, sort_keys=True), cfg.model.tiny or {})
    for tiny in shapes.values():
        folder = default_tiny_base(TinyBaseConfig(**tiny) if tiny else None, progress=progress, log=log)
        log(f"tiny base ready: {folder}")
    return prepared


def cell_data(grid: Grid, cell: Cell, prepared: PreparedData, cell_dir: Path) -> tuple[str, list[dict], list[dict]]:
    """(training file, ID records, OOD records) of a cell after its data transforms."""
    from iga_ds.data.splits import random_pairing, split_by_instance

    v = cell.variant
    id_records = _read_jsonl(prepared.id_test) if prepared.id_test else []
    ood_records = _read_jsonl(prepared.ood_test) if prepared.ood_test else []
    source = prepared.train
    if v.cue == "neutral":
        if prepared.neutral_train is None:
            raise ConfigError(f"{v.key}.cue: 'neutral' needs synthetic data (data.synthetic)")
        source = prepared.neutral_train
    if v.split == "seed" and v.pairing == "isomer" and v.grouping == "groups":
        return source, id_records, ood_records
    train = _read_jsonl(source)
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
        train = ungroup(train, list(v.domains or _base_domains(grid)))
    path = cell_dir / "train.jsonl"
    _write_jsonl(path, train)
    return str(path), id_records, ood_records


def isomer_eval_items(id_records: Sequence[dict], ood_records: Sequence[dict], name: str) -> list:
    import dataclasses

    from iga_ds.evaluation.records import isomer_items

    return isomer_items(id_records, name=name) + [
        dataclasses.replace(item, split="ood", id=f"ood/{item.id}") for item in isomer_items(ood_records, name=name)
    ]


def _evaluate_cell(grid: Grid, cell_dir: Path, base_dir: str, adapter: Path, id_records, ood_records,
                   lcs_records, progress: bool) -> dict[str, dict[str, Any]]:
    """Every evaluation of a cell into ``cell_dir/eval/<name>.json``; returns the summaries."""
    from iga_ds.evaluation.cli import lcs_block
    from iga_ds.evaluation.generation import load_model
    from iga_ds.evaluation.prompts import PROMPT_TEMPLATE, format_prompt
    from iga_ds.evaluation.runner import evaluate

    e = grid.eval
    model, tokenizer = load_model(base_dir, adapter, dtype=e.dtype, device=e.device)
    generation = {"greedy": True, "max_new_tokens": e.max_new_tokens, "stop_after_answer": e.stop_after_answer,
                  "prompt_template": PROMPT_TEMPLATE, "limit": e.limit}
    model_info = {"base": str(base_dir), "adapter": str(adapter)}
    jobs: list[tuple[str, list, dict[str, Any]]] = []
    if id_records or ood_records:
        name = grid.data["name"]
        jobs.append((name, isomer_eval_items(id_records, ood_records, name), {"benchmark": name}))
    for b in grid.benchmarks:
        from iga_ds.data.benchmarks import load_benchmark, resolve_options

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
                                  e.lcs_max_groups, e.batch_size, progress)
            except ValueError as exc:
                raise ConfigError(f"{grid.path}: eval.lcs_layers: {exc}") from None
            if block:
                extra["lcs"] = block
        results[name] = evaluate(
            items, model, tokenizer, cell_dir / "eval" / f"{name}.json",
            {"model": model_info, **source, "generation": generation}, format_prompt,
            max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, stop_after_answer=e.stop_after_answer,
            progress=progress, restart=True, extra=extra,
        )
    del model
    return results


def _spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def reset_peak_memory(cuda: bool) -> bool:
    """Start a fresh peak-memory count: the GPU allocator's, or on the CPU the process's peak
    resident set (Linux: writing 5 to /proc/self/clear_refs resets VmHWM). False if impossible."""
    if cuda:
        import torch

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
        import torch

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
    from iga_ds.train.trainer import Trainer

    trainer = Trainer(cfg, quiet=not progress)
    result = trainer.run()
    trainer.engine = None  # drop the engine (and its optimizer state) before evaluation
    del trainer
    return TrainOutcome(result.status == "completed", result.step, result.wall_seconds,
                        result.adapter_dir or Path(cfg.output_dir) / "adapter")


def _train_with_launcher(launcher: str, run: dict[str, Any], cell_dir: Path) -> TrainOutcome:
    """One cell's training as ``<launcher> launch/train.py --config run.yaml`` (e.g. all GPUs
    of the machine through ``deepspeed --num_gpus 8``); this process waits for it."""
    import shlex
    import subprocess

    run_yaml = cell_dir / "run.yaml"
    atomic_write_text(run_yaml, yaml.safe_dump(run, sort_keys=False))
    cmd = shlex.split(launcher) + [str(launch_script()), "--config", str(run_yaml)]
    start = time.perf_counter()
    code = subprocess.call(cmd)
    wall = time.perf_counter() - start
    if code != 0:
        raise UserError(f"cell {cell_dir.name}: training exited with status {code}: {shlex.join(cmd)}", exit_code=1)
    from iga_ds.metrics.mask import read_metrics_jsonl

    metrics = read_metrics_jsonl(cell_dir / "metrics.jsonl") if (cell_dir / "metrics.jsonl").is_file() else []
    adapter = cell_dir / "adapter"
    step = int(metrics[-1]["step"]) if metrics else 0
    return TrainOutcome((adapter / "adapter_config.json").is_file(), step, wall, adapter)


def run_cell(grid: Grid, cell: Cell, out: Path, prepared: PreparedData, progress: bool = True,
             launcher: str | None = None) -> dict[str, Any]:
    """Train, evaluate, then write ``cell.json`` (last, atomically); returns cell.json's content."""
    import torch

    from iga_ds.train.batching import complete_groups, read_records
    from iga_ds.train.config import config_from_dict

    cell_dir = out / cell.name
    cell_dir.mkdir(parents=True)
    spec = grid.cell_spec(cell)
    atomic_write_json(cell_dir / "cell_spec.json", spec)
    train_file, id_records, ood_records = cell_data(grid, cell, prepared, cell_dir)
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
    resolved = yaml.safe_load((cell_dir / "config.resolved.yaml").read_text(encoding="utf-8"))["resolved"]
    domains = resolved["iga"]["domains"]
    n_groups = len(complete_groups(read_records(train_file), domains, train_file))
    epochs = trained.step * cfg.data.groups_per_step / n_groups if n_groups else None
    # LCS on the real isomer groups of the evaluation data, whatever the cell trained on
    lcs_records = _read_jsonl(prepared.id_test) if prepared.id_test else []
    lcs_records += _read_jsonl(prepared.ood_test) if prepared.ood_test else []
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
        "spec_hash": _spec_hash(spec),
        "evaluations": {name: {k: r.get(k) for k in ("accuracy", "id_accuracy", "ood_accuracy", "delta_gap",
                                                      "ood_cue_follow")}
                        for name, r in evals.items()},
    }
    _free_memory()
    atomic_write_json(cell_dir / MARKER, info)  # last: marks the cell finished
    return info


# -- the grid ----------------------------------------------------------------------------------


def cell_status(grid: Grid, cell: Cell, out: Path) -> str:
    """"done", "partial" (killed: no marker) or "todo"; a done cell made from another spec is an error."""
    cell_dir = out / cell.name
    marker = cell_dir / MARKER
    if marker.is_file():
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            return "partial"
        if info.get("spec_hash") != _spec_hash(grid.cell_spec(cell)):
            raise UserError(f"{marker}: this cell was finished with other settings than {grid.path} gives now; "
                            "use another --out folder, or delete the cell folder to run it again")
        return "done"
    return "partial" if cell_dir.exists() else "todo"


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}%"


def _summary_line(info: dict[str, Any]) -> str:
    parts = []
    for name, r in info.get("evaluations", {}).items():
        if r.get("ood_accuracy") is not None:
            parts.append(f"{name} ID {_fmt(r.get('id_accuracy'))} OOD {_fmt(r['ood_accuracy'])}"
                         + (f" (follows a wrong cue {_fmt(r['ood_cue_follow'])})" if r.get("ood_cue_follow") is not None else ""))
        else:
            parts.append(f"{name} {_fmt(r.get('accuracy'))}")
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
    if not cells:
        raise UserError(f"--only {' '.join(only)}: no cell of {grid.path} matches")
    if launcher:
        launch_script()  # fail before any work when the entry script is missing
    atomic_write_text(out / "grid.yaml", grid.path.read_text(encoding="utf-8"))
    prepared = prepare_data(grid, out, log)
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
    if report:
        from iga_ds.evaluation.report import write_report

        log(f"wrote {write_report(out)}")
    return infos
