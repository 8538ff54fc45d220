"""Optimizer and learning-rate schedule of the paper's implementation details.

AdamW (Loshchilov and Hutter, 2019, "Decoupled Weight Decay Regularization") with linear
warmup and cosine decay (Loshchilov and Hutter, 2017, "SGDR"). The AdamW is torch's, recording
its step where DeepSpeed's elastic checkpoint reads it: that convention of DeepSpeed's lives in
``engine.internals`` with the rest.
"""
from __future__ import annotations

import math
from typing import Callable

from iga_ds.engine.internals import GroupStepAdamW

__all__ = ["GroupStepAdamW", "lr_lambda"]


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
