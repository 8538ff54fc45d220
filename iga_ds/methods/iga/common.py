"""What the reference and the batched path of IGA share: the options and the input checks."""
from __future__ import annotations

import torch

NORMALIZATIONS = ("none", "mean", "snr")
# snr: V / (Gbar^2 + eps), eps relative to the module's mean Gbar^2 so it means the same at any gradient scale
SNR_EPS = 1e-6
# how the masked mean returns to the factors: the pseudo-inverse of the reconstruction (ERM at
# tau = 0), or the paper's rank-r truncated SVD
PROJECTIONS = ("tangent", "svd")
# with the SVD: how the rank-r matrix becomes factor gradients, the paper's split or the chain rule
FACTOR_MAPS = ("split", "chain_rule")

# the one set of defaults, read by options.IGAOptions (which the registered methods, batched_iga
# and masked_projection take whole) and by iga_update's keywords.
# tau: chosen by the rule of configs/experiments/shift_smollm2.yaml (in-distribution accuracy)
DEFAULT_TAU = 1.0
DEFAULT_NORMALIZE = "snr"
DEFAULT_PROJECTION = "tangent"
DEFAULT_FACTORS = "chain_rule"
# the pseudo-inverse's ridge, relative to the factors' mean squared singular value: it bounds
# the gain on directions that pass through a small factor (B starts at zero)
DEFAULT_DAMPING = 0.1
# the truncation's SVD (projection svd): HMT's randomized SVD with the paper's sketch settings
DEFAULT_SVD = "randomized"
DEFAULT_OVERSAMPLE = 10
DEFAULT_POWER_ITERS = 2
# the batched path's precision: bf16 for a bf16 run, else ieee (method.IGA.precision_for)
DEFAULT_PRECISION = "auto"

# where IGA's variance comes from (iga_ds.methods.iga.variance)
VARIANCES = ("batch", "ema", "debiased")
DEFAULT_VARIANCE = "batch"
# ema's decay when none is given: about the last ten steps
DEFAULT_VARIANCE_DECAY = 0.9


def check_variance_options(variance: str, variance_decay: float | None) -> float | None:
    """The decay ``ema`` uses (None for the others): ``variance_decay`` acts with ``ema`` only."""
    if variance not in VARIANCES:
        raise ValueError(f"variance must be one of {VARIANCES}, got {variance!r}")
    if variance != "ema":
        if variance_decay is not None:
            raise ValueError(f"variance_decay={variance_decay!r}: acts only with variance 'ema', and variance is "
                             f"{variance!r}")
        return None
    decay = DEFAULT_VARIANCE_DECAY if variance_decay is None else float(variance_decay)
    if not 0 <= decay < 1:
        raise ValueError(f"variance_decay must be in [0, 1), got {variance_decay!r}")
    return decay


# options that act only under another option's value: (the options, that option, its values
# where they act). One of them at another value than its default, where that option has another
# value, is an error, not a setting silently ignored. Read by check_projection_options and by
# the registered methods (options.IGAOptions).
ACTS_ONLY_WITH = (
    (("rank", "svd", "oversample", "power_iters", "factors"), "projection", ("svd",)),
    (("damping",), "projection", ("tangent",)),
    (("oversample", "power_iters"), "svd", ("randomized", "single_pass")),  # the exact SVD draws no sketch
    (("variance_decay",), "variance", ("ema",)),
    # the batched path's precision: no batched path under these, and the departures' variances
    # run its PyTorch tile pass in float32
    (("precision",), "implementation", ("auto", "batched")),
    (("precision",), "variance", ("batch",)),
    (("precision",), "svd", ("randomized", "single_pass")),
)
# the defaults those rules compare with
ACTING_DEFAULTS = {"rank": None, "svd": DEFAULT_SVD, "oversample": DEFAULT_OVERSAMPLE,
                   "power_iters": DEFAULT_POWER_ITERS, "factors": DEFAULT_FACTORS, "damping": DEFAULT_DAMPING,
                   "variance_decay": None, "precision": DEFAULT_PRECISION}


def check_acting(settings: dict, given: dict, under: tuple[str, ...] | None = None) -> None:
    """Options in ``given`` that act only under another option's value (:data:`ACTS_ONLY_WITH`)
    keep their defaults where ``settings`` gives that option another value; ``under``: check
    only the rules on these options."""
    for options, other, values in ACTS_ONLY_WITH:
        if under is not None and other not in under:
            continue
        changed = [f"{k}={given[k]!r}" for k in options if k in given and given[k] != ACTING_DEFAULTS[k]]
        if changed and settings[other] not in values:
            raise ValueError(f"{', '.join(changed)}: acts only with {other} {' or '.join(map(repr, values))}, "
                             f"and {other} is {settings[other]!r}")


def check_projection_options(projection: str, **given) -> None:
    """``given`` options that act only under another projection than ``projection`` must keep
    their defaults."""
    check_acting({"projection": projection}, given, under=("projection",))


def check_choice(value: str, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_tau(tau: float) -> None:
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")


def check_options(*, normalize: str, projection: str, factors: str, tau: float, damping: float) -> None:
    check_choice(normalize, NORMALIZATIONS, "normalize")
    check_choice(projection, PROJECTIONS, "projection")
    check_choice(factors, FACTOR_MAPS, "factors")
    check_tau(tau)
    if not damping >= 0:
        raise ValueError(f"damping must be >= 0, got {damping}")


def check_module(A: torch.Tensor, B: torch.Tensor, gA: torch.Tensor, gB: torch.Tensor, rank: int | None,
                 name: str = "") -> int:
    """Shapes of one module's factors and per-domain gradients (PEFT layout); returns the
    truncation rank (the LoRA rank when ``rank`` is None)."""
    where = f"{name}: " if name else ""
    if gA.ndim != 3 or gB.ndim != 3 or gA.shape[0] != gB.shape[0]:
        raise ValueError(f"{where}gA must be N x r x in and gB N x out x r, "
                         f"got {tuple(gA.shape)} and {tuple(gB.shape)}")
    r = A.shape[0]
    if tuple(gA.shape[1:]) != tuple(A.shape) or tuple(gB.shape[1:]) != tuple(B.shape) or B.shape[1] != r:
        raise ValueError(f"{where}shapes disagree: A {tuple(A.shape)}, B {tuple(B.shape)}, "
                         f"gA {tuple(gA.shape)}, gB {tuple(gB.shape)}")
    k = r if rank is None else int(rank)
    if not 1 <= k <= r:
        raise ValueError(f"{where}rank must be in [1, {r}] (the LoRA rank), got {rank}")
    return k
