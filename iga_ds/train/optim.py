"""Optimizer and learning-rate schedule of the paper's implementation details.

AdamW (Loshchilov and Hutter, 2019, "Decoupled Weight Decay Regularization") with linear
warmup and cosine decay (Loshchilov and Hutter, 2017, "SGDR").
"""
from __future__ import annotations

import math
from typing import Callable

import torch


class GroupStepAdamW(torch.optim.AdamW):
    """torch AdamW that also records the step count in each param group.

    DeepSpeed's elastic ZeRO checkpoint (the one that resumes at another world size) stores
    and restores the step from ``param_groups[0]["step"]``, where DeepSpeed's own Adam keeps
    it; torch's AdamW keeps it per parameter only, so the elastic save would drop it.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            group.setdefault("step", 0)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            state = self.state.get(group["params"][0], {})
            if "step" in state:
                group["step"] = int(state["step"])
        return loss


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
