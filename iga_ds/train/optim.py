"""Optimizer and learning-rate schedule of the paper's implementation details.

AdamW (Loshchilov and Hutter, 2019, "Decoupled Weight Decay Regularization") with linear
warmup and cosine decay (Loshchilov and Hutter, 2017, "SGDR"); SGD with momentum as the
departure that shows what Adam's per-element scaling does to a method's gradient. Both are
torch's, recording their step where DeepSpeed's elastic checkpoint reads it: that convention of
DeepSpeed's lives in ``engine.internals`` with the rest.
"""
from __future__ import annotations

import math
from typing import Callable

from iga_ds.engine.internals import GroupStepAdamW, GroupStepSGD

__all__ = ["GroupStepAdamW", "GroupStepSGD", "build_optimizer", "lr_lambda"]


def build_optimizer(params, schedule):
    """The run YAML's optimizer (``schedule.optimizer``) over ``params``."""
    if schedule.optimizer == "sgd":
        return GroupStepSGD(params, lr=schedule.lr, momentum=schedule.momentum, weight_decay=schedule.weight_decay)
    return GroupStepAdamW(params, lr=schedule.lr, betas=tuple(schedule.betas), eps=schedule.eps,
                          weight_decay=schedule.weight_decay)


def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier of the base lr at optimizer step ``step`` (0-based): linear warmup over
    ``ceil(warmup_ratio * total_steps)`` steps, then cosine decay to ``min_lr_ratio``."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f
