"""The contract every method follows: what a new method implements, and what it may assume.

A method turns per-domain LoRA gradients into the gradient the optimizer sees: pure tensor
code, no process groups, no DeepSpeed. Its ``scope`` picks the one hook it overrides:
``"module"``, one module at a time (``combine_module``; IGA, AND-mask), so the engine hook can
spread modules over ranks; ``"global"``, every module at once (``combine``; PCGrad, MGDA);
``"loss"``, a new objective and no gradients (``objective``; ERM, IRM, V-REx). What the hook
uses for speed, which no method needs, is in :mod:`iga_ds.methods.tensors`. The keyword
arguments of ``__init__`` are the method's config parameters. V-REx, as in vrex.py::

    class VREx(GradientMethod):
        name, scope, paper = "vrex", "loss", "Krueger et al., ... ICML 2021"
        def __init__(self, penalty_weight: float = 1.0, seed: int = 0):
            super().__init__(seed)
            self.penalty_weight = float(penalty_weight)
        def objective(self, sequence_losses, domain_ids, num_domains, dummy_scale=None):
            risks = per_domain_means(sequence_losses, domain_ids, num_domains)
            return sequence_losses.mean() + self.penalty_weight * vrex_penalty(risks)
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Sequence

import torch

Scope = Literal["module", "global", "loss"]


@dataclass(frozen=True)
class Statistic:
    """A figure a method reports. Module scope: per module, ``combine`` forming the model's
    figure (``mean`` weighted by each module's out x in elements, ``sum``, ``min``); ``model``:
    the whole model's figure already (global methods), logged as ``method/<name>``."""

    name: str
    combine: Literal["mean", "sum", "min", "model"]
    doc: str = ""


@dataclass
class ModuleGrads:
    """Per-domain mean gradients of one LoRA module, PEFT layout: A: r x in, B: out x r, gA:
    N x r x in, gB: N x out x r, ``scaling`` s in dW = s * B @ A. ``index`` (the module's place
    in the model) keys random sketches, so results do not depend on the rank computing them.
    ``compute_dtype``: the backward's dtype (bfloat16 in bf16 runs; A, B float32), None: A's."""

    name: str
    index: int
    A: torch.Tensor
    B: torch.Tensor
    gA: torch.Tensor
    gB: torch.Tensor
    scaling: float
    compute_dtype: torch.dtype | None = None

    @property
    def trained_in(self) -> torch.dtype:
        """The dtype the gradients were computed in: ``compute_dtype``, else A's."""
        return self.A.dtype if self.compute_dtype is None else self.compute_dtype

    @property
    def num_domains(self) -> int:
        return int(self.gA.shape[0])


@dataclass
class ModuleUpdate:
    """What the optimizer sees for one module: gA shaped as A, gB as B, and ``stats`` keyed by
    declared statistic names (a dict, or a :class:`iga_ds.methods.tensors.PendingStats`)."""

    gA: torch.Tensor
    gB: torch.Tensor
    stats: MutableMapping[str, float] = field(default_factory=dict)


class GradientMethod:
    """Set the four class attributes and override your scope's hook. ``statistics``: module
    scope, any subset per module; global, model figures in the first update's ``stats``."""

    name: ClassVar[str] = ""
    scope: ClassVar[Scope] = "module"
    paper: ClassVar[str] = ""
    statistics: ClassVar[tuple[Statistic, ...]] = ()

    def __init__(self, seed: int = 0):
        self.seed = seed

    def combine(self, modules: Sequence[ModuleGrads], step: int) -> list[ModuleUpdate]:
        """One update per module, in order, at optimizer step ``step``. Global scope: every
        module, on every rank; module scope: the modules this rank owns, by default one
        ``combine_module`` each (override to batch them)."""
        if self.scope == "loss":
            raise TypeError(f"method {self.name!r} acts on the loss; it has no gradient combination")
        return [self.combine_module(m, step) for m in modules]

    def combine_module(self, module: ModuleGrads, step: int) -> ModuleUpdate:
        """Module scope: one module's update, from that module alone."""
        raise NotImplementedError

    def objective(self, sequence_losses: torch.Tensor, domain_ids: torch.Tensor, num_domains: int,
                  dummy_scale: torch.Tensor | None = None) -> torch.Tensor:
        """One micro-batch's scalar for backward: the mean of per-sequence losses (the hook turns
        captured sums into per-domain means by it), plus a loss-scope method's penalty."""
        return sequence_losses.mean()

    def needs_dummy_scale(self) -> bool:
        """True when ``objective`` needs logits multiplied by a scalar it can differentiate."""
        return False

    @property
    def needs_domain_gradients(self) -> bool:
        return self.scope != "loss"

    def describe(self) -> str:
        return f"{self.name}: {self.paper}"
