"""The grid file of ``iga-ds experiment``: its keys, its checks, and the cells it expands to.

A grid (YAML, read with ``iga_ds.files.read_yaml_file``) names a base run config, the data, the
evaluations, the seeds, the methods (paper Table 2 rows) and the ablations (Table 3 rows).
Every (variant, seed) pair is a :class:`Cell` with a stable folder name,
``<variant>-s<seed>``. Errors name the file and the key. Running the cells is
:mod:`iga_ds.experiments.experiment`; the keys are documented in docs/EXPERIMENTS.md.
Relative paths follow the run YAML's one rule (:func:`iga_ds.config.run.resolve_path`): those
written in the grid (``train_config``, ``train``, ``data``, ``benchmarks``, a variant's
``train``) are relative to the grid's folder, those in the base run YAML to the run YAML's.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from iga_ds.config.deepspeed import default_ds_config
from iga_ds.config.run import config_from_dict, resolve_config_paths, resolve_path
from iga_ds.data.benchmarks import resolve_options
from iga_ds.data.domains import DEFAULT_DOMAINS
from iga_ds.data.patterns import PATTERNS
from iga_ds.data.sources import is_hub_dataset_id
from iga_ds.errors import ConfigError
from iga_ds.files import read_yaml_file
from iga_ds.methods import get_method, method_class

MARKER = "cell.json"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=]*$")
POOLED_DOMAIN = "pooled"  # the one pseudo-domain of ungrouped training (CoT-Distill)

GRID_KEYS = ("train_config", "train", "data", "benchmarks", "eval", "seeds", "methods", "ablations",
             "keep_checkpoints", "selection")
VARIANT_KEYS = ("method", "params", "domains", "pairing", "split", "grouping", "label", "train", "cue",
                "selection_lr")
SYNTH_KEYS = ("groups", "seed", "shortcut", "domains", "id_groups", "ood_groups", "patterns", "min_depth",
              "max_depth", "answer_only", "shortcut_by_domain", "test_cue")
SELECTION_KEYS = ("lr", "max_steps", "seeds", "metric")
SELECTION_METRICS = ("id_accuracy",)
TEST_CUES = ("independent", "adversarial")
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
    # the row's own candidate learning rates (an optimizer on another lr scale, e.g. SGD); empty: the grid's
    selection_lr: tuple[float, ...] = ()

    def spec(self) -> dict[str, Any]:
        spec = {"key": self.key, "kind": self.kind, "method": self.method, "params": self.params,
                "domains": list(self.domains) if self.domains else None, "pairing": self.pairing,
                "split": self.split, "grouping": self.grouping, "label": self.label, "train": self.train}
        if self.cue != "planted":  # absent by default: cells of older grids keep their hash
            spec["cue"] = self.cue
        if self.method == "iga_svd":  # once spelled iga with projection svd: its cells keep their hash
            spec.update(method="iga", params={**self.params, "projection": "svd"})
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


@dataclass(frozen=True)
class Selection:
    """The per-row selection stage: every candidate (lr x max_steps) trains on ``seeds`` and is
    scored on in-distribution data only; the best ``metric`` wins, ties to the smaller lr, then
    the fewer steps. ``max_steps`` empty: the grid's own."""

    lr: tuple[float, ...]
    max_steps: tuple[int, ...] = ()
    seeds: tuple[int, ...] = (0,)
    metric: str = "id_accuracy"

    def candidates(self, variant: Variant | None = None) -> list[dict[str, Any]]:
        """Each candidate's schedule keys (``variant``'s own learning rates where it names them),
        in the tie-break order (smaller lr, then fewer steps)."""
        steps = sorted(self.max_steps) or [None]
        rates = (variant.selection_lr if variant is not None else ()) or self.lr
        return [{"lr": lr, **({"max_steps": n} if n is not None else {})} for lr in sorted(rates) for n in steps]


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
    selection: Selection | None = None

    def cells(self) -> list[Cell]:
        """Seed-major order: every variant at the first seed, then the next seed, so a first
        complete table exists early."""
        return [Cell(v, s) for s in self.seeds for v in self.variants]

    def cell_spec(self, cell: Cell) -> dict[str, Any]:
        """Everything that decides a cell's result; its hash guards against reusing a folder.
        Paths are relative to the grid file, so a grid resumes in another checkout of it."""
        spec = {"run": self.run, "data": self.data, "benchmarks": self.benchmarks,
                "eval": self.eval.__dict__, "variant": cell.variant.spec(), "seed": cell.seed}
        return _relative_paths(spec, self.path.resolve().parent)


def _relative_paths(value: Any, base: Path) -> Any:
    """``value`` with every absolute path in it made relative to ``base``."""
    if isinstance(value, dict):
        return {k: _relative_paths(v, base) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_relative_paths(v, base) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return os.path.relpath(value, base)
    return value


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
        selection_lr=_number_list(raw["selection_lr"], f"{where}.selection_lr", False) if "selection_lr" in raw
        else (),
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
        _check_cue_keys(spec)
        data["synthetic"] = spec
        return data
    if "train" not in raw:
        raise ConfigError("data: expected synthetic (generated here) or train (an isomer JSON Lines file)")
    for key in ("train", "id_test", "ood_test"):
        if key in raw:
            value = raw[key]
            if not isinstance(value, str) or not value:
                raise ConfigError(f"data.{key}: expected the path of an isomer JSON Lines file, got {value!r}")
            path = Path(resolve_path(value, grid_dir))
            if not path.is_file():
                raise ConfigError(f"data.{key}: {path} not found")
            data[key] = str(path.resolve())
    return data


def _check_cue_keys(spec: dict[str, Any]) -> None:
    """``shortcut_by_domain`` (per-domain training cue agreement, replacing ``shortcut``) and
    ``test_cue`` (how the test split's cue relates to the answer)."""
    if "test_cue" in spec:
        _choice(spec["test_cue"], TEST_CUES, "data.synthetic.test_cue")
    if "shortcut_by_domain" not in spec:
        return
    where = "data.synthetic.shortcut_by_domain"
    by_domain = spec["shortcut_by_domain"]
    if not isinstance(by_domain, dict) or not by_domain:
        raise ConfigError(f"{where}: expected a mapping of domain to probability, got {by_domain!r}")
    domains = spec.get("domains") or list(DEFAULT_DOMAINS)
    for domain, p in by_domain.items():
        if domain not in domains:
            raise ConfigError(f"{where}.{domain}: not a domain of the data (expected some of {', '.join(domains)})")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ConfigError(f"{where}.{domain}: expected a probability in [0, 1], got {p!r}")
    missing = [d for d in domains if d not in by_domain]
    if missing:
        raise ConfigError(f"{where}: no probability for {', '.join(missing)}")
    spec["shortcut_by_domain"] = {d: float(by_domain[d]) for d in domains}


def _number_list(value: Any, where: str, integer: bool) -> tuple:
    ok = isinstance(value, list) and value and all(
        (_is_int(x) if integer else isinstance(x, (int, float)) and not isinstance(x, bool)) and x > 0 for x in value)
    if not ok or len(set(value)) != len(value):
        kind = "positive integers" if integer else "positive numbers"
        raise ConfigError(f"{where}: expected a non-empty list of distinct {kind}, got {value!r}")
    return tuple(int(x) if integer else float(x) for x in value)


def _selection(raw: Any) -> Selection | None:
    if raw is None:
        return None
    raw = _mapping(raw, "selection")
    _check_keys(raw, SELECTION_KEYS, "selection")
    if "lr" not in raw:
        raise ConfigError("selection.lr: expected the candidate learning rates, e.g. [5.0e-4, 1.0e-3, 2.0e-3]")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(_is_int(x) and x >= 0 for x in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ConfigError(f"selection.seeds: expected a list of distinct non-negative integers, got {seeds!r}")
    steps = _number_list(raw["max_steps"], "selection.max_steps", True) if "max_steps" in raw else ()
    return Selection(_number_list(raw["lr"], "selection.lr", False), steps, tuple(seeds),
                     _choice(raw.get("metric", "id_accuracy"), SELECTION_METRICS, "selection.metric"))


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
        # a benchmark may also come from the hub (org/name[:split]), which is no path
        folder = resolve_path(entry["dir"], grid_dir, keep_missing=True, is_name=is_hub_dataset_id)
        options = _mapping(entry.get("options"), f"{where}.options")
        try:  # a bad option fails here, not at the first evaluation after training
            resolve_options(entry["benchmark"], options)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        out.append({"name": name, "benchmark": entry["benchmark"], "dir": str(folder),
                    "options": copy.deepcopy(options), "limit": limit})
    names = [b["name"] for b in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"benchmarks: evaluation names must be unique, got {names}")
    return out


def load_grid(path: str | Path) -> Grid:
    """Read and check a grid file; every error names the file and the key."""
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
        base_path = Path(resolve_path(base, grid_dir))
        if not base_path.is_file():
            raise ConfigError(f"train_config: {base_path} not found")
        run = _mapping(_read_train_config(base_path), "train_config")
        resolve_config_paths(run, base_path.parent)  # the run YAML's paths: beside it
    train = copy.deepcopy(_mapping(raw.get("train"), "train"))
    resolve_config_paths(train, grid_dir)  # the grid's own: beside the grid
    run = deep_merge(run, train)
    for key in ("output_dir", "seed", "method", "resume"):
        run.pop(key, None)  # set per cell
    run.get("data", {}).pop("train", None)

    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(_is_int(s) and s >= 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: expected a list of distinct non-negative integers, got {seeds!r}")
    variants = [_variant(k, v, "method", f"methods.{k}") for k, v in _mapping(raw.get("methods"), "methods").items()]
    variants += [_variant(k, v, "ablation", f"ablations.{k}")
                 for k, v in _mapping(raw.get("ablations"), "ablations").items()]
    if not variants:
        raise ConfigError("methods: expected at least one method (or ablation)")
    for v in variants:  # a variant's run settings are written in the grid: their paths are beside it
        resolve_config_paths(v.train, grid_dir)
    keys = [v.key for v in variants]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ConfigError(f"ablations.{dup}: the name is also a method; cell names must be unique")
    keep = raw.get("keep_checkpoints", False)
    if not isinstance(keep, bool):
        raise ConfigError(f"keep_checkpoints: expected true or false, got {keep!r}")
    grid = Grid(path, run, _data(_mapping(raw.get("data"), "data"), grid_dir),
                _benchmarks(raw.get("benchmarks"), grid_dir), _eval_settings(_mapping(raw.get("eval"), "eval")),
                list(seeds), variants, keep, _selection(raw.get("selection")))
    for v in variants:  # every cell's run config is checked before anything runs
        where = f"{'methods' if v.kind == 'method' else 'ablations'}.{v.key}"
        if v.selection_lr and grid.selection is None:
            raise ConfigError(f"{where}.selection_lr: names candidates, but the grid has no selection stage")
        try:
            config_from_dict(cell_run_dict(grid, Cell(v, seeds[0]), Path("cell"), "data.jsonl"))
        except ConfigError as exc:
            raise ConfigError(f"{where}: run config: {exc}") from None
    return grid


def _read_train_config(path: Path) -> Any:
    """The run YAML a grid names; not UTF-8 or bad YAML is an error naming that file and line
    (``load_grid`` puts the grid file in front)."""
    try:
        return read_yaml_file(path, "run YAML") or {}
    except ConfigError as exc:
        raise ConfigError(f"train_config: {exc}") from None


# -- one cell ----------------------------------------------------------------------------------


def base_domains(grid: Grid) -> list[str]:
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
        n = len(data.get("domains") or base_domains(grid))
        data["domains"] = [POOLED_DOMAIN]
        data["groups_per_step"] = n * data.get("groups_per_step", 8)
        data["groups_per_micro_batch"] = n * data.get("groups_per_micro_batch", 2)
    data["train"] = train_file
    run["output_dir"] = str(cell_dir)
    run["method"] = {"name": v.method, "params": copy.deepcopy(v.params)}
    run["seed"] = cell.seed
    run["resume"] = "never"  # a cell is finished or wiped, never continued
    if "deepspeed" not in run:
        run["deepspeed"] = default_ds_config()
    return run
