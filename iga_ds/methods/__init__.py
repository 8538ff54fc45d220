"""Gradient-combination methods, one file each (IGA: one package), registered by name.

``get_method("iga", tau=0.5)`` builds one; ``available_methods()`` lists the names;
``register(cls)`` adds a method of your own (a :class:`GradientMethod` subclass).
"""
from __future__ import annotations

import inspect
from typing import Any

from iga_ds.errors import ConfigError
from iga_ds.methods.and_mask import ANDMask
from iga_ds.methods.base import GradientMethod, ModuleGrads, ModuleUpdate, Statistic
from iga_ds.methods.erm import ERM, CapturedERM
from iga_ds.methods.iga import IGA, IGASVD, IGABinaryMask, IGALoRASpace, IGANoProjection, MeanNoMask
from iga_ds.methods.iga.options import OPTION_DEFAULTS
from iga_ds.methods.iga.sketch import sketch_key
from iga_ds.methods.iga.tiles import StableModules, TiledResults
from iga_ds.methods.irm import IRM
from iga_ds.methods.pareto import ParetoGS
from iga_ds.methods.pcgrad import PCGrad
from iga_ds.methods.sand_mask import SANDMask
from iga_ds.methods.vrex import VREx

BUILTIN_METHODS: tuple[type[GradientMethod], ...] = (
    ERM, CapturedERM, IGA, IGASVD, IGABinaryMask, IGANoProjection, MeanNoMask, IGALoRASpace, ANDMask, SANDMask, PCGrad, ParetoGS, IRM,
    VREx,
)
_REGISTRY: dict[str, type[GradientMethod]] = {}


def register(cls: type[GradientMethod]) -> type[GradientMethod]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


for _builtin in BUILTIN_METHODS:
    register(_builtin)


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


def method_class(name: str) -> type[GradientMethod]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown method {name!r}; expected one of: {', '.join(sorted(_REGISTRY))}"
        ) from None


def method_parameters(name: str) -> dict[str, inspect.Parameter]:
    """The keyword parameters a method accepts, every one it uses and no other (for config
    validation and docs/CONFIG.md): its ``__init__``'s signature."""
    sig = inspect.signature(method_class(name).__init__)
    return {k: p for k, p in sig.parameters.items() if k != "self"}


def resolved_parameters(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Every keyword parameter of method ``name``: ``params`` over its defaults (what a run
    records, so that its settings still read right after a default changes)."""
    defaults = {k: p.default for k, p in method_parameters(name).items() if p.default is not inspect.Parameter.empty}
    return {**defaults, **params}


def runs_by_default(name: str, key: str, value: Any) -> bool:
    """Whether ``key: value``, as a run of method ``name`` recorded it, is what the method does
    unasked: its parameter's default, or, for IGA's family, the value of an option it fixes or
    no longer takes (a record from before ``iga_svd`` held ``projection`` and the truncation's options)."""
    params = method_parameters(name)
    if key in params:
        return params[key].default == value
    fixes = getattr(method_class(name), "fixes", None)
    if fixes is None or key not in OPTION_DEFAULTS:
        return False
    return fixes.get(key, OPTION_DEFAULTS[key]) == value


def get_method(name: str, **params: Any) -> GradientMethod:
    cls = method_class(name)
    allowed = method_parameters(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        # a family of methods sharing options (IGA's) says why one of its options does not act here
        explain = getattr(cls, "refusal", None)
        why = explain(unknown[0], params[unknown[0]]) if explain is not None else None
        if why is not None:
            raise ValueError(why)
        raise ConfigError(
            f"method {name!r} has no parameter {unknown[0]!r}; expected some of: {', '.join(sorted(allowed)) or '(none)'}"
        )
    return cls(**params)


__all__ = [
    "BUILTIN_METHODS",
    "GradientMethod",
    "ModuleGrads",
    "ModuleUpdate",
    "StableModules",
    "TiledResults",
    "Statistic",
    "available_methods",
    "get_method",
    "method_class",
    "method_parameters",
    "register",
    "runs_by_default",
    "sketch_key",
]
