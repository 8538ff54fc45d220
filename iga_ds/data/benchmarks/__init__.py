"""Loaders for the paper's public benchmarks, reading the user's local copies.

None of these datasets is bundled (see each module for where to obtain it and its licence):
``logiqa2`` (LogiQA 2.0), ``reclor`` (ReClor), ``math`` (MATH), ``arb`` (ARB).
``load_benchmark(name, root, **options)`` returns a list of ``EvalItem`` with the configured
ID/OOD split; ``root`` is a folder in the published layout or one dataset of the records of one
published file (a Parquet or Arrow file, a ``save_to_disk`` folder, a hub id; see ``base``).
``benchmark_defaults(name)`` shows the default options.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from iga_ds.data.benchmarks import arb, logiqa, math_dataset, reclor
from iga_ds.data.benchmarks.base import BenchmarkSource, EvalItem
from iga_ds.errors import ConfigError

_LOADERS: dict[str, ModuleType] = {m.NAME: m for m in (logiqa, reclor, math_dataset, arb)}
BENCHMARKS = tuple(sorted(_LOADERS))


def _loader(name: str) -> ModuleType:
    try:
        return _LOADERS[name]
    except KeyError:
        raise ConfigError(f"unknown benchmark {name!r}; expected one of: {', '.join(BENCHMARKS)}") from None


def benchmark_defaults(name: str) -> dict[str, Any]:
    return dict(_loader(name).DEFAULTS)


def benchmark_source(name: str) -> BenchmarkSource:
    return _loader(name).SOURCE


def resolve_options(name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loader's defaults overridden by ``options``, checked and normalized.

    A list option given as one string (``"geometry"`` or ``"geometry,precalculus"``) is a list;
    a value of the wrong type is a ConfigError naming the option.
    """
    module = _loader(name)
    options = dict(options or {})
    unknown = sorted(set(options) - set(module.DEFAULTS))
    if unknown:
        raise ConfigError(
            f"benchmark {name!r} has no option {unknown[0]!r}; expected some of: {', '.join(sorted(module.DEFAULTS))}"
        )
    resolved = dict(module.DEFAULTS)
    for key, value in options.items():
        resolved[key] = _checked_option(f"benchmark {name!r} option {key}", value, module.DEFAULTS[key])
    return {k: list(v) if isinstance(v, tuple) else v for k, v in resolved.items()}


def _checked_option(where: str, value: Any, default: Any) -> Any:
    """``value`` as the kind of its default: a list (of names; of names or numbers where the
    default is null), true or false, an integer or a string."""
    if default is None and value is None:
        return None
    if default is None or isinstance(default, (tuple, list)):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif default is None and isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        kinds = (str,) if default is not None else (str, int)
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, kinds) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{where}: expected a comma-separated list, got {value!r}")
        return list(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
    elif isinstance(default, str) and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def load_benchmark(name: str, root: str | Path, **options: Any) -> list[EvalItem]:
    """Items of benchmark ``name`` from ``root`` (a published-layout folder or one dataset);
    options override the defaults."""
    return _loader(name).load(root, **resolve_options(name, options))


__all__ = ["BENCHMARKS", "BenchmarkSource", "EvalItem", "benchmark_defaults", "benchmark_source", "load_benchmark", "resolve_options"]
