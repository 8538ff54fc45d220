"""The one contract every method follows.

A method turns per-domain LoRA gradients into the gradient the optimizer sees. It is pure
tensor code: no process groups, no DeepSpeed. The engine hook (``iga_ds.engine``) collects the
per-domain gradients, hands each method the modules it owns, and writes the result back.

Three scopes, because methods differ in what they need to see at once:

- ``"module"``: the update of a module depends on that module alone (IGA, AND-mask, ...),
  so modules can be spread over data-parallel ranks.
- ``"global"``: the update needs every module's gradients at once (PCGrad, MGDA take inner
  products of whole gradient vectors).
- ``"loss"``: the method changes the objective (ERM, IRM, V-REx) and the optimizer takes the
  plain gradient of that objective; no per-domain gradients are captured.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Sequence

import torch

Scope = Literal["module", "global", "loss"]


@dataclass(frozen=True)
class Statistic:
    """A figure a method reports. A module-scope method reports it per module, and ``combine``
    says how the whole model's figure is formed from the modules': ``mean`` weighted by each
    module's out x in elements, ``sum`` or ``min``; ``model`` marks a figure of the whole model
    already (global methods), logged as ``method/<name>``."""

    name: str
    combine: Literal["mean", "sum", "min", "model"]
    doc: str = ""


@dataclass
class ModuleGrads:
    """Per-domain mean gradients of one LoRA module, PEFT layout.

    A: r x in (lora_A.weight), B: out x r (lora_B.weight), gA: N x r x in, gB: N x out x r,
    scaling: s in dW = s * B @ A. ``index`` is the module's position in the model's list of
    LoRA modules; it keys the module's random sketch so results do not depend on which rank
    computes them. ``compute_dtype``: the dtype of the forward and backward that produced the
    gradients (the engine hook passes the LoRA weights' own dtype, bfloat16 in a DeepSpeed
    bf16 run, while A and B arrive in float32); None: A's dtype. A method may match its own
    precision to it (IGA's ``precision="auto"``).
    """

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


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor on ``device``, without waiting for the device.

    A plain ``.to("cuda")`` copies from pageable memory, and PyTorch then synchronizes the
    stream: the host waits for every kernel queued so far. From pinned memory the copy is
    queued like a kernel (the pinned block is not reused before it ran)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class ModuleUpdate:
    """The gradients the optimizer will see for one module, with per-module statistics."""

    gA: torch.Tensor
    gB: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)


class GradientMethod:
    """Base class: subclasses set ``name``, ``scope`` and ``paper``, declare the per-module
    ``statistics`` they report, and override one hook."""

    name: ClassVar[str] = ""
    scope: ClassVar[Scope] = "module"
    paper: ClassVar[str] = ""
    # what the method reports: module-scope methods per module (any subset; the hook carries
    # them from owner ranks in fixed slots), global methods for the whole model
    statistics: ClassVar[tuple[Statistic, ...]] = ()

    def __init__(self, seed: int = 0):
        self.seed = seed

    # -- gradient-level methods ------------------------------------------------------------
    def combine(self, modules: Sequence[ModuleGrads], step: int) -> list[ModuleUpdate]:
        """Per-domain gradients in, one update per module out (same order)."""
        if self.scope == "loss":
            raise TypeError(f"method {self.name!r} acts on the loss; it has no gradient combination")
        return [self.combine_module(m, step) for m in modules]

    def combine_module(self, module: ModuleGrads, step: int) -> ModuleUpdate:
        raise NotImplementedError

    # -- loss-level methods ----------------------------------------------------------------
    def objective(
        self,
        sequence_losses: torch.Tensor,
        domain_ids: torch.Tensor,
        num_domains: int,
        dummy_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scalar passed to backward for one micro-batch: mean of per-sequence losses.

        The engine hook relies on this normalization to turn captured sums into per-domain
        means; loss-level methods add their penalty to it.
        """
        return sequence_losses.mean()

    def needs_dummy_scale(self) -> bool:
        """True when ``objective`` needs logits multiplied by a scalar it can differentiate."""
        return False

    @property
    def needs_domain_gradients(self) -> bool:
        return self.scope != "loss"

    def describe(self) -> str:
        return f"{self.name}: {self.paper}"
