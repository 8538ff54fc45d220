"""The contract every method follows: what a new method implements, and what it may assume.

A method turns per-domain LoRA gradients into the gradient the optimizer sees: pure tensor code, no process
groups, no DeepSpeed. Its ``scope`` picks the one hook it overrides: ``"module"``, one module at a time
(``combine_module``; IGA, AND-mask), so the engine hook can spread modules over ranks; ``"global"``, every
module at once (``combine``; PCGrad, MGDA); ``"loss"``, a new objective and no gradients (``objective``; ERM,
IRM, V-REx). Speed lives with the batched IGA path and the engine; ``__init__``'s keywords are the config's. V-REx::

    class VREx(GradientMethod):
        name, scope, paper = "vrex", "loss", "Krueger et al., ... ICML 2021"
        def __init__(self, penalty_weight: float = 1.0, seed: int = 0):
            super().__init__(seed); self.penalty_weight = float(penalty_weight)
        def objective(self, sequence_losses, domain_ids, num_domains, dummy_scale=None):
            risks = per_domain_means(sequence_losses, domain_ids, num_domains)
            return sequence_losses.mean() + self.penalty_weight * vrex_penalty(risks)
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Sequence

import torch

from iga_ds.methods.device_copies import stats_to_host  # tensor statistics: one copy for all

Scope = Literal["module", "global", "loss"]


@dataclass(frozen=True)
class Statistic:
    """A figure a method reports. Module scope: per module, ``combine`` forming the model's figure (``mean``
    weighted by out x in, ``sum``, ``min``); ``model``: the model's figure already (global), as ``method/<name>``."""

    name: str
    combine: Literal["mean", "sum", "min", "model"]
    doc: str = ""


@dataclass
class ModuleGrads:
    """Per-domain mean gradients of one LoRA module, PEFT layout: A: r x in, B: out x r, gA: N x r x in, gB:
    N x out x r, ``scaling`` s in dW = s * B @ A. ``index`` (its place in the model) keys sketches and state, so
    results do not depend on the rank computing them. ``compute_dtype``: the backward's (bf16 runs), None: A's."""

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
    """The optimizer's input for one module: gA shaped as A, gB as B, ``stats`` by name (floats or 0-dim tensors)."""

    gA: torch.Tensor
    gB: torch.Tensor
    stats: MutableMapping[str, float | torch.Tensor] = field(default_factory=dict)


class GradientMethod:
    """Set the four class attributes and override your scope's hook. ``statistics``: module scope, any subset
    per module; global, model figures in the first update's ``stats``."""

    name: ClassVar[str] = ""
    scope: ClassVar[Scope] = "module"
    paper: ClassVar[str] = ""
    statistics: ClassVar[tuple[Statistic, ...]] = ()
    domain_halves: bool = False  # True: gA, gB are 2N x ..., domain n's halves of the step's groups at n and N + n

    def __init__(self, seed: int = 0):
        self.seed = seed

    def combine(self, modules: Sequence[ModuleGrads], step: int) -> list[ModuleUpdate]:
        """One update per module, in order, at optimizer step ``step``. Global scope: every module, on every
        rank; module scope: the modules this rank owns, by default one ``combine_module`` each (or batched)."""
        if self.scope == "loss":
            raise TypeError(f"method {self.name!r} acts on the loss; it has no gradient combination")
        return stats_to_host([self.combine_module(m, step) for m in modules])

    def combine_module(self, module: ModuleGrads, step: int) -> ModuleUpdate:
        """Module scope: one module's update, from that module alone."""
        raise NotImplementedError

    def objective(self, sequence_losses: torch.Tensor, domain_ids: torch.Tensor, num_domains: int,
                  dummy_scale: torch.Tensor | None = None) -> torch.Tensor:
        """One micro-batch's scalar for backward: the mean of per-sequence losses (the hook turns captured sums
        into per-domain means by it), plus a loss-scope method's penalty."""
        return sequence_losses.mean()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What the method carries from step to step, for checkpoints; module scope: keys ``"<index>.<name>"``."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take back a :meth:`state_dict` (module scope: the entries of the modules this rank combines)."""

    def needs_dummy_scale(self) -> bool:
        """True when ``objective`` needs logits multiplied by a scalar it can differentiate."""
        return False

    @property
    def needs_domain_gradients(self) -> bool:
        return self.scope != "loss"

    def describe(self) -> str:
        return f"{self.name}: {self.paper}"
