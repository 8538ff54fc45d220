"""What the reference and the batched path of IGA share: the options and the input checks."""
from __future__ import annotations

import torch

NORMALIZATIONS = ("none", "mean", "snr")
# snr: V / (Gbar^2 + eps), eps relative to the module's mean Gbar^2 so it means the same at any gradient scale
SNR_EPS = 1e-6
# how the rank-r matrix becomes factor gradients: the paper's SVD split, or the chain rule through dW = s B A
FACTOR_MAPS = ("split", "chain_rule")


def check_choice(value: str, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_tau(tau: float) -> None:
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")


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
