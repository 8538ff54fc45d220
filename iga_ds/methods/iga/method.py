"""IGA as a registered method: the reference path module by module, or the batched path on GPUs.

Invariant Gradient Alignment (the paper this package implements; not DomainBed's
Inter-environmental Gradient Alignment of Koyama and Yamaguchi, 2020).
"""
from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from iga_ds.methods.base import GradientMethod, ModuleGrads, ModuleUpdate, Statistic
from iga_ds.methods.iga.batched import batched_iga
from iga_ds.methods.iga.options import make_options, option_signature
from iga_ds.methods.iga.options import refusal as option_refusal
from iga_ds.methods.iga.reference import masked_projection, mean_and_variance
from iga_ds.methods.iga.sketch import sketch_key, sketch_keys
from iga_ds.methods.iga.tiles import TiledResults
from iga_ds.methods.iga.variance import MovingAverages, debiased_variance, split_halves

# what IGA and its ablations report per module, and how a whole model's figure is formed
MASK_STATISTICS = (
    Statistic("mask_mean", "mean", "mean of the mask over the module's elements (1: nothing masked)"),
    Statistic("mask_frac_below_half", "mean", "share of elements the mask damps below 1/2"),
    Statistic("mask_min", "min", "smallest mask value"),
    Statistic("gir", "sum", "gradient invariance residual: the sum of the per-element variance V"),
    Statistic("energy_kept", "mean", "share of the masked matrix's squared norm the projection back to the "
              "factors keeps: the update's reconstruction's (tangent), the rank-r truncation's (svd), 1 (chain)"),
)


class MaskedProjectionMethod(GradientMethod):
    """IGA and the ablations that share its options; subclasses pick the mask, the options they
    take (``takes``, from :class:`~iga_ds.methods.iga.options.IGAOptions`) and those they fix.

    ``projection``: how the masked mean returns to the factors. ``tangent`` (default): ERM's
    factor gradients plus the pseudo-inverse of the reconstruction applied to what the mask
    removed (``damping`` its ridge), so that tau = 0 is ERM exactly. ``svd``: the paper's
    rank-r truncation, then ``factors``: ``chain_rule`` maps it through dW = s B A like a
    gradient (which applies the reconstruction a second time), ``split`` is the paper's
    U S^1/2, S^1/2 V^T, which made training diverge (docs/METHOD_NOTES.md).

    ``variance``: where the mask's V comes from (:mod:`iga_ds.methods.iga.variance`): ``batch``,
    the paper's, this step's; ``ema`` (a departure), the per-domain means averaged over steps
    (decay ``variance_decay``, 0.9 when not given; the averages are the method's checkpointed
    state); ``debiased`` (a departure), this step's less the noise two halves of each domain's
    groups estimate (the hook then captures 2N per-(domain, half) means: ``domain_halves``).
    """

    scope = "module"
    statistics = MASK_STATISTICS
    mask_kind: ClassVar[str] = "continuous"
    # the options a subclass takes (its signature), and those it fixes (e.g. the projection it replaces)
    takes: ClassVar[tuple[str, ...]] = ()
    fixes: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs):
        """Give each subclass an ``__init__`` whose signature is the options it takes."""
        super().__init_subclass__(**kwargs)
        if "__init__" in vars(cls):
            return

        def __init__(self, *, seed: int = 0, **options):
            MaskedProjectionMethod.__init__(self, seed=seed, **options)

        __init__.__signature__ = option_signature(cls.takes)
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__doc__ = f"{cls.name}: the options {', '.join(cls.takes) or '(none)'} and seed."
        cls.__init__ = __init__

    def __init__(self, *, seed: int = 0, **options):
        super().__init__(seed)
        self.options = make_options(self.name, self.takes, self.fixes, options)
        # the settings it runs with: the options, and what the method fixes
        for name, value in {**vars(self.options), **self.fixes}.items():
            setattr(self, name, value)
        # debiased: the hook gives gA, gB as 2N means, domain n's halves of the step's groups at n and N + n
        self.domain_halves = self.variance == "debiased"
        self._averages = MovingAverages(self.variance_decay) if self.variance == "ema" else None

    @classmethod
    def refusal(cls, name: str, value: Any) -> str | None:
        """Why this method refuses an option of the family it does not take (None: not one of them)."""
        return option_refusal(cls.name, cls.takes, cls.fixes, name, value)

    def combine_module(self, module: ModuleGrads, step: int) -> ModuleUpdate:
        gen = None
        if self.svd != "exact" and self.projection == "svd":  # sketched: keyed per step and module
            gen = sketch_key(self.seed, step, module.index)
        domain_A, domain_B, spread = self.domain_means_and_spread(module)
        # self.projection: the options' own, or the one the method fixes outside them (iga_no_projection's chain)
        gA, gB, stats = masked_projection(
            module.A, module.B, domain_A, domain_B, scaling=module.scaling, options=self.options, generator=gen,
            mask_kind=self.mask_kind, spread=spread, projection=self.projection,
        )
        return ModuleUpdate(gA, gB, stats)

    def domain_means_and_spread(self, m: ModuleGrads):
        """This step's per-domain mean factor gradients (N x ...), and the (variance, mean) the mask
        is computed from where ``variance`` does not take them from those means (else None)."""
        if self.variance == "ema":  # the averages reconstructed at the current factors
            averaged_A, averaged_B = self._averages.update(m.index, m.gA, m.gB)
            mean, var = mean_and_variance(m.A, m.B, averaged_A, averaged_B, m.scaling)
            return m.gA, m.gB, (var, mean)
        if self.variance == "debiased":
            hA1, hA2, hB1, hB2 = split_halves(m.gA, m.gB)
            mean, var = debiased_variance(m.A, m.B, hA1, hA2, hB1, hB2, m.scaling)
            return (hA1 + hA2) / 2, (hB1 + hB2) / 2, (var, mean)
        return m.gA, m.gB, None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self._averages is None else self._averages.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self._averages is not None:
            self._averages.load_state_dict(state)
        elif state:
            raise ValueError(f"{self.name} with variance {self.variance!r} keeps no state; got {sorted(state)[:3]}")


class IGA(MaskedProjectionMethod):
    """Invariant Gradient Alignment: exp(-tau V') mask on reconstructed gradients, projected back to the factors.

    The shipped update: the mask's options, the tangent projection's ``damping``, and two
    engineering switches. ``implementation``: ``reference`` runs
    :func:`~iga_ds.methods.iga.reference.masked_projection` module by module; ``batched`` runs
    :func:`~iga_ds.methods.iga.batched.batched_iga` (same result up to rounding, no N full-rank
    matrices, modules of equal shape batched); ``auto`` takes ``batched`` on CUDA, except for
    ``variance: debiased`` with ``normalize: mean``, which has no batched form. ``precision``
    (batched path, ``variance: batch``; the departures compute in float32): ``auto`` is ``bf16``
    for gradients from a bfloat16 forward and backward (:attr:`ModuleGrads.trained_in`), else
    ``ieee`` (float32 throughout); ``bf16`` stores and multiplies the masked matrices in bfloat16
    with float32 accumulation, ``tf32`` uses TF32 tensor cores (docs/PERFORMANCE.md has the
    precision rule). The paper's rank-r truncation is the method ``iga_svd``.
    """

    name = "iga"
    paper = "Invariant Gradient Alignment (IGA) for logical isomers (this package's paper)"
    takes = ("tau", "normalize", "variance", "variance_decay", "damping", "implementation", "precision")
    fixes = {"projection": "tangent"}
    summary = "the tangent projection, the shipped update"  # named where the other is asked for its options

    @classmethod
    def refusal(cls, name: str, value: Any) -> str | None:
        why = super().refusal(name, value)
        other = IGASVD if cls is IGA else IGA if cls is IGASVD else None
        if why is not None and other is not None and name in other.takes + tuple(other.fixes):
            why += f" (the method {other.name} is {other.summary})"
        return why

    def _batched(self, modules: Sequence[ModuleGrads]) -> bool:
        if self.implementation == "auto":
            no_batched_form = self.variance == "debiased" and self.normalize == "mean"
            return (self.svd != "exact" and not no_batched_form and bool(modules)
                    and modules[0].gA.device.type == "cuda")
        return self.implementation == "batched"

    def precision_for(self, modules: Sequence[ModuleGrads]) -> str:
        """The batched path's precision for these modules: ``precision``, with ``auto`` resolved
        from the dtype their gradients were computed in."""
        if self.precision != "auto":
            return self.precision
        if self.variance != "batch":  # the departures' PyTorch tile pass: bf16 rounding would buy no speed there
            return "ieee"
        return "bf16" if modules and modules[0].trained_in == torch.bfloat16 else "ieee"

    def combine(self, modules, step):
        if not self._batched(modules):
            return super().combine(modules, step)
        # the tangent projection draws no sketch: keys only where the projection reads them
        gens = (sketch_keys(self.seed, step, [m.index for m in modules]) if self.projection == "svd"
                else [None] * len(modules))
        # ema: this step's averages, bias-corrected, one pair per module (the reference path's update)
        averages = ([self._averages.update(m.index, m.gA, m.gB) for m in modules] if self.variance == "ema"
                    else None)
        out = batched_iga(modules, self.options, generators=gens, averages=averages,
                          triton_precision=self.precision_for(modules))
        return TiledResults([ModuleUpdate(gA, gB, stats) for gA, gB, stats in out], out.bases)


class IGASVD(IGA):
    """IGA with the paper's projection: the masked mean's rank-r truncation, mapped to the factors.

    ``rank`` (default: the LoRA rank) and ``svd``: ``randomized`` (default; HMT with
    ``power_iters`` power iterations and ``oversample`` extra columns), ``exact`` (full SVD,
    reference path only) or ``single_pass`` (Tropp et al. 2017: no power iterations; on the
    batched path the masked matrices are never stored). ``factors``: ``chain_rule`` maps the
    truncation through dW = s B A like a gradient; ``split`` is the paper's U S^1/2, S^1/2 V^T,
    which made training diverge (docs/METHOD_NOTES.md).
    """

    name = "iga_svd"
    paper = "IGA with the paper's randomized-SVD projection (this package's paper)"
    takes = ("tau", "normalize", "variance", "variance_decay", "rank", "svd", "oversample", "power_iters",
             "factors", "implementation", "precision")
    fixes = {"projection": "svd"}
    summary = "the paper's rank-r SVD truncation"

