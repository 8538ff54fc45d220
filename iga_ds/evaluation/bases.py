"""Which base model ``iga-ds eval`` decodes with: every base training takes, and the one a run
recorded.

- ``--run RUN_DIR`` (or ``--adapter RUN_DIR/adapter``, or a checkpoint's
  ``RUN_DIR/checkpoints/TAG/adapter``) without ``--base``: the base the run trained,
  ``resolved.base_model_dir`` of its ``config.resolved.yaml`` (what ``iga-ds experiment``
  evaluates a cell with): the built-in tiny base's cached folder, a local folder, a hub id or
  ``packaged:NAME``, exactly as training resolved it;
- an adapter outside a run: the base its ``adapter_config.json`` names;
- ``--base builtin:tiny`` (shape and pretraining settings as ``model.tiny``, from ``--tiny``):
  the run's base when the adapter's run trained that base, else the cached tiny base built with
  these settings (``$IGA_DS_CACHE/tiny-base``, whose ``pretrain.json`` records them). Evaluation
  sits beside training in the layers and does not pretrain one itself: a training run on
  ``builtin:tiny`` (or ``iga-ds pretrain-tiny`` for the default settings) builds it;
- any other ``--base`` (a folder, a hub id, a .gguf file, ``packaged:NAME``): as given, through
  the same resolver training uses (:mod:`iga_ds.models`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from iga_ds.config.base import validate_section
from iga_ds.config.run import ADAPTER_CONFIG, BUILTIN_TINY, RUN_CONFIG, TinyBaseConfig, locate_adapter, run_of_adapter
from iga_ds.errors import UserError
from iga_ds.files import read_json, read_yaml_file
from iga_ds.models import cache_root

TINY_FOLDER = "tiny-base"  # under the cache root, as training writes it


@dataclass(frozen=True)
class EvalBase:
    """What to load: ``base`` (a folder, hub id, .gguf file or ``packaged:NAME``), the adapter,
    and where the base came from (``spec``: as named by the user or the run; ``run``: the
    training run read, if any; ``tiny``: the built-in base's settings)."""

    base: str
    adapter: Path | None = None
    spec: str | None = None
    run: Path | None = None
    tiny: dict[str, Any] | None = None

    def settings(self) -> dict[str, Any]:
        """Where the base came from, for eval.json (only what applies)."""
        out: dict[str, Any] = {}
        if self.spec is not None and self.spec != self.base:
            out["base_spec"] = self.spec
        if self.tiny is not None:
            out["tiny"] = self.tiny
        if self.run is not None:
            out["run"] = str(self.run.resolve())
        return out


def tiny_settings(options: list[tuple[str, Any]] | dict[str, Any] | None, where: str = "--tiny") -> dict[str, Any]:
    """Every setting of the built-in base (defaults filled in), checked as ``model.tiny`` is."""
    cfg = validate_section(TinyBaseConfig, dict(options or {}), where)
    return json.loads(json.dumps(cfg.to_dict()))  # as pretrain.json records them


def read_run_config(run: Path) -> dict[str, Any]:
    """A run's ``config.resolved.yaml`` as a mapping."""
    cfg = read_yaml_file(run / RUN_CONFIG, "run config")
    if not isinstance(cfg, dict):
        raise UserError(f"{run / RUN_CONFIG}: expected a mapping (a training run's resolved config)")
    return cfg


def run_adapter(run: str) -> tuple[Path, Path | None]:
    """``--run``: (adapter folder, run folder): a run's final adapter, a checkpoint's, or an adapter folder."""
    found = locate_adapter(Path(run).expanduser(), f"--run {run}")
    if found is None:
        raise UserError(f"--run {run}: expected a training run's folder (with {RUN_CONFIG} and adapter/), a "
                        f"checkpoint's folder or a PEFT adapter folder (with {ADAPTER_CONFIG})")
    return found


def _recorded_base(run: Path, cfg: dict[str, Any]) -> str:
    """The base a run trained: ``resolved.base_model_dir``, else ``model.name_or_path``."""
    resolved, model = cfg.get("resolved") or {}, cfg.get("model") or {}
    base = resolved.get("base_model_dir") or model.get("name_or_path")
    if not base or base == BUILTIN_TINY:
        raise UserError(f"{run / RUN_CONFIG}: records no base model folder (resolved.base_model_dir); "
                        "name it with --base")
    if Path(str(base)).is_absolute() and not Path(str(base)).exists():
        raise UserError(f"{run / RUN_CONFIG}: the run's base {base} is no longer there (a cleared cache?); a "
                        "training run with the same model settings builds the built-in base again, or name "
                        "one with --base")
    return str(base)


def _run_tiny(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The built-in base's settings of a run trained on ``builtin:tiny``, else None."""
    model = cfg.get("model") or {}
    if model.get("name_or_path") != BUILTIN_TINY:
        return None
    return tiny_settings(model.get("tiny") or {}, f"{RUN_CONFIG}: model.tiny")


def cached_tiny_bases(settings: dict[str, Any]) -> list[Path]:
    """Complete cached tiny bases built with ``settings``, newest first."""
    root = cache_root() / TINY_FOLDER
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        record = folder / "pretrain.json"
        if folder.name.startswith(".") or not (record.is_file() and (folder / "config.json").is_file()):
            continue
        try:
            recorded = read_json(record, objects=True).get("config")
        except UserError:
            continue  # a damaged record is no match
        if recorded == settings:
            found.append(folder)
    return sorted(found, key=lambda f: (f / "pretrain.json").stat().st_mtime, reverse=True)


def find_tiny_base(settings: dict[str, Any], log: Callable[[str], None] = print) -> str:
    """The cached tiny base built with ``settings`` (the newest where several match)."""
    found = cached_tiny_bases(settings)
    if not found:
        default = settings == tiny_settings({})
        how = ("`iga-ds pretrain-tiny` or a training run on builtin:tiny builds it" if default else
               "a training run on builtin:tiny with these model.tiny settings builds it")
        raise UserError(f"--base builtin:tiny: no tiny base with these settings in {cache_root() / TINY_FOLDER} "
                        f"yet; {how}; or evaluate a run with --run RUN_DIR")
    if len(found) > 1:
        log(f"note: builtin:tiny: {len(found)} cached bases have these settings (other corpora or library "
            f"versions); using the newest, {found[0]} (--base FOLDER names another)")
    return str(found[0])


def resolve_eval_base(base: str | None, adapter: str | None = None, run: str | None = None,
                      tiny: list[tuple[str, Any]] | None = None, log: Callable[[str], None] = print) -> EvalBase:
    """The base and adapter an evaluation loads, from ``--base``, ``--adapter``, ``--run`` and
    ``--tiny`` (see the module's docstring)."""
    if tiny and base != BUILTIN_TINY:
        raise UserError("--tiny: the built-in base's settings, only with --base builtin:tiny")
    adapter_dir, run_dir = run_adapter(run) if run else (None, None)
    if adapter is not None:
        adapter_dir = Path(adapter)
        if not (adapter_dir / ADAPTER_CONFIG).is_file():
            raise UserError(f"--adapter: {adapter} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
        run_dir = run_of_adapter(adapter_dir)
    if base is not None and base != BUILTIN_TINY:
        return EvalBase(base, adapter_dir)  # as given: the models' resolver checks it when it loads
    cfg = read_run_config(run_dir) if run_dir is not None else None
    if base == BUILTIN_TINY:
        return _tiny_base(adapter_dir, run_dir, cfg, tiny, log)
    if cfg is not None:
        return EvalBase(_recorded_base(run_dir, cfg), adapter_dir, (cfg.get("model") or {}).get("name_or_path"),
                        run_dir, _run_tiny(cfg))
    if adapter_dir is not None:
        named = read_json(adapter_dir / ADAPTER_CONFIG, objects=True, error=UserError).get("base_model_name_or_path")
        if named:
            return EvalBase(str(named), adapter_dir)
        raise UserError(f"{adapter_dir / ADAPTER_CONFIG}: names no base model (base_model_name_or_path); "
                        "name it with --base")
    raise UserError("--base: required unless --run (or --adapter) names a training run or an adapter whose "
                    f"{ADAPTER_CONFIG} names its base")


def _tiny_base(adapter: Path | None, run: Path | None, cfg: dict[str, Any] | None,
               tiny: list[tuple[str, Any]] | None, log: Callable[[str], None]) -> EvalBase:
    """``--base builtin:tiny``: the run's own base where the run trained the built-in base with
    these settings (``--tiny``, or none given: the run's), else the cached base built with them."""
    recorded = _run_tiny(cfg) if cfg is not None else None
    settings = tiny_settings(tiny) if tiny else (recorded or tiny_settings({}))
    if recorded is not None and recorded == settings:
        return EvalBase(_recorded_base(run, cfg), adapter, BUILTIN_TINY, run, settings)
    return EvalBase(find_tiny_base(settings, log), adapter, BUILTIN_TINY, None, settings)
