"""The options of IGA and its ablations, declared once: :class:`IGAOptions`.

Each registered method of the family takes a subset of them (its ``takes``, which its signature
shows) and may fix others (``fixes``); every other option keeps its default, and one given is
refused in one line naming the option and the method. An option that acts only under another
option's value (``ACTS_ONLY_WITH``: the truncation's options under ``projection: svd``) is
refused at any value but its default where that option has another value.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from iga_ds.methods.iga.common import (
    DEFAULT_DAMPING, DEFAULT_FACTORS, DEFAULT_NORMALIZE, DEFAULT_OVERSAMPLE, DEFAULT_POWER_ITERS, DEFAULT_PRECISION,
    DEFAULT_PROJECTION, DEFAULT_SVD, DEFAULT_TAU, DEFAULT_VARIANCE, PROJECTIONS, check_acting, check_choice,
    check_options, check_variance_options,
)
from iga_ds.methods.iga.rsvd import SVD_METHODS

IMPLEMENTATIONS = ("auto", "reference", "batched")
PRECISIONS = ("auto", "ieee", "tf32", "bf16")


@dataclass(frozen=True)
class IGAOptions:
    """Every option of the family with its default (the signatures' too), checked when made.
    ``variance_decay`` holds the decay ``ema`` uses (None for the other variances)."""

    tau: float = DEFAULT_TAU
    normalize: str = DEFAULT_NORMALIZE
    variance: str = DEFAULT_VARIANCE
    variance_decay: float | None = None
    projection: str = DEFAULT_PROJECTION
    damping: float = DEFAULT_DAMPING
    rank: int | None = None
    svd: str = DEFAULT_SVD
    oversample: int = DEFAULT_OVERSAMPLE
    power_iters: int = DEFAULT_POWER_ITERS
    factors: str = DEFAULT_FACTORS
    implementation: str = "auto"
    precision: str = DEFAULT_PRECISION

    def __post_init__(self):
        given = dataclasses.asdict(self)
        decay = check_variance_options(self.variance, self.variance_decay)
        check_options(normalize=self.normalize, projection=self.projection, factors=self.factors, tau=self.tau,
                      damping=self.damping)
        check_choice(self.svd, SVD_METHODS, "svd")
        check_choice(self.implementation, IMPLEMENTATIONS, "implementation")
        check_choice(self.precision, PRECISIONS, "precision")
        check_acting(given, given)
        if self.implementation == "batched" and self.svd == "exact":
            raise ValueError("implementation 'batched' needs a sketched svd, 'randomized' or 'single_pass' "
                             "(the exact SVD has no batched form)")
        if self.implementation == "batched" and self.variance == "debiased" and self.normalize == "mean":
            raise ValueError("implementation 'batched' has no form of variance 'debiased' with normalize 'mean' "
                             "(use implementation 'auto' or 'reference')")
        for name, kind in (("tau", float), ("damping", float), ("oversample", int), ("power_iters", int)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        object.__setattr__(self, "variance_decay", decay)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(IGAOptions))
OPTION_DEFAULTS = {f.name: f.default for f in dataclasses.fields(IGAOptions)}


def option_signature(takes: tuple[str, ...]) -> inspect.Signature:
    """``__init__(self, *, <takes with their defaults>, seed=0)``: what the registry, docs/CONFIG.md
    and ``help()`` read as the method's parameters."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
                             + [inspect.Parameter(name, keyword, default=OPTION_DEFAULTS[name]) for name in takes]
                             + [inspect.Parameter("seed", keyword, default=0)])


def refusal(method: str, takes: tuple[str, ...], fixes: dict[str, Any], name: str, value: Any) -> str | None:
    """Why ``method`` refuses option ``name`` of the family (None: not one of the family's):
    it fixes it, or it fixes the option ``name`` acts under, or it does not take it."""
    if name not in OPTION_NAMES or name in takes:
        return None
    if name in fixes:
        return f"{method} fixes its {name}: {method} takes {name} {fixes[name]!r} only, got {value!r}"
    try:
        check_acting({**OPTION_DEFAULTS, **fixes}, {name: value}, under=tuple(fixes))
    except ValueError as exc:
        return f"{method}: {exc}"
    return f"{name}={value!r}: {method} does not take {name}; it takes: {', '.join((*takes, 'seed'))}"


def make_options(method: str, takes: tuple[str, ...], fixes: dict[str, Any], given: dict[str, Any]) -> IGAOptions:
    """The options ``method`` runs with: ``given`` (each one it takes, else refused) over the
    defaults, checked."""
    for name, value in given.items():
        why = refusal(method, takes, fixes, name, value)
        if why is not None:
            raise ValueError(why)
        if name not in takes:
            raise TypeError(f"{method} has no option {name!r}; it takes: {', '.join((*takes, 'seed'))}")
    # the fixed values go in too, but one outside the options' own (iga_no_projection's 'chain')
    within = {k: v for k, v in fixes.items() if not (k == "projection" and v not in PROJECTIONS)}
    try:
        return IGAOptions(**given, **within)
    except ValueError as exc:
        raise ValueError(f"{method}: {exc}") from None
