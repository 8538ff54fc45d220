"""A diverged run never ends as done: too many skipped steps in a row, or a non-finite adapter,
stop it in one line.

The engine hook skips an optimizer step whose loss or combined gradient is NaN or infinite
(``iga.skip_nonfinite``) and says so in the step's record (``hook.skipped``); DeepSpeed's own
check of the gradient skips the others (its engine counts both; under fp16 its loss scaler's
skips while it finds the scale are left out). One such step is
noise; ``iga.max_skipped_steps`` of them in a row is a run that has diverged (every later step
sees the same weights and skips too), so the run stops naming the first non-finite quantity.
The LoRA weights are checked finite before a checkpoint or the final adapter is written, so
that neither is ever saved non-finite.
"""
from __future__ import annotations

import math
from typing import Any

from iga_ds.errors import UserError


class DivergedRun(UserError):
    """The run diverged: its loss, gradient or weights are no longer finite."""


class SkippedSteps:
    """Counts the skipped steps in a row; :meth:`observe` stops the run at ``limit`` (0: never)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0
        self.first: tuple[int, str] | None = None  # (step, what was non-finite) of the row's first

    def observe(self, record: dict[str, Any], skipped: bool = False) -> None:
        """After each step: ``record`` is its metrics line, ``skipped`` whether the engine skipped it."""
        if not (skipped or record.get("hook.skipped")):
            self.in_a_row, self.first = 0, None
            return
        self.in_a_row += 1
        if self.first is None:
            self.first = (int(record["step"]), first_non_finite_quantity(record))
        if self.limit and self.in_a_row >= self.limit:
            step, what = self.first
            raise DivergedRun(f"step {record['step']}: {self.in_a_row} optimizer steps in a row skipped for a "
                              f"non-finite loss or gradient, the first at step {step} ({what}); the run has "
                              "diverged: lower schedule.lr or look at the data (iga.max_skipped_steps sets the "
                              "limit)")


def first_non_finite_quantity(record: dict[str, Any]) -> str:
    """Which of a step's logged quantities was not finite, in words (``the loss (nan)``)."""
    names = ["loss"] + sorted(k for k in record if k.startswith("loss.")) + ["grad_norm"]
    for name in names:
        value = record.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            return f"{'the loss' if name == 'loss' else name} was {value}"
    return "the gradient was not finite"


def non_finite_parameters(module) -> list[str]:
    """The names of ``module``'s trainable parameters that hold a NaN or an infinity."""
    import torch

    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        return []
    norms = torch.stack(torch._foreach_norm([p.detach() for _, p in named])).cpu()
    return [name for (name, _), norm in zip(named, norms.tolist()) if not math.isfinite(norm)]


def check_finite_weights(module, what: str) -> None:
    """Refuse, in one line, to write ``what`` (the adapter, a checkpoint) from non-finite LoRA weights."""
    bad = non_finite_parameters(module)
    if bad:
        total = sum(1 for p in module.parameters() if p.requires_grad)
        raise DivergedRun(f"{what}: {len(bad)} of {total} LoRA tensors hold NaN or infinite values (the first: "
                          f"{bad[0]}); not written: the run has diverged (lower schedule.lr)")
