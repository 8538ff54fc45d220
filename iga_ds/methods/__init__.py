"""Gradient-combination methods, one file each, registered by name.

``get_method("iga", tau=0.5)`` builds one; ``available_methods()`` lists the names.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from iga_ds.errors import ConfigError
from iga_ds.methods.base import GradientMethod, ModuleGrads, ModuleUpdate, module_generator

_REGISTRY: dict[str, type[GradientMethod]] = {}

# Importing these modules registers their classes.
_METHOD_MODULES = (
    "erm",
    "iga",
    "ablations",
    "and_mask",
    "sand_mask",
    "pcgrad",
    "pareto",
    "irm",
    "vrex",
)


def register(cls: type[GradientMethod]) -> type[GradientMethod]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    for mod in _METHOD_MODULES:
        importlib.import_module(f"iga_ds.methods.{mod}")


def available_methods() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def method_class(name: str) -> type[GradientMethod]:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown method {name!r}; expected one of: {', '.join(sorted(_REGISTRY))}"
        ) from None


def method_parameters(name: str) -> dict[str, inspect.Parameter]:
    """The keyword parameters a method accepts (for config validation)."""
    sig = inspect.signature(method_class(name).__init__)
    return {k: p for k, p in sig.parameters.items() if k != "self"}


def get_method(name: str, **params: Any) -> GradientMethod:
    cls = method_class(name)
    allowed = method_parameters(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ConfigError(
            f"method {name!r} has no parameter {unknown[0]!r}; expected some of: {', '.join(sorted(allowed)) or '(none)'}"
        )
    return cls(**params)


__all__ = [
    "GradientMethod",
    "ModuleGrads",
    "ModuleUpdate",
    "available_methods",
    "get_method",
    "method_class",
    "method_parameters",
    "module_generator",
    "register",
]
