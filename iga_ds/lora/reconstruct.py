"""Full-rank view of LoRA factor gradients.

PEFT layout: lora_A.weight is r x in, lora_B.weight is out x r, dW = s * B @ A. A step
(dA, dB) changes dW, to first order, by s * (dB @ A + B @ dA); that is the reconstruction
G[n] of a domain's factor gradients. (The paper's g^B A^T + B^T g^A does not type-check.)
"""
from __future__ import annotations

import torch


def reconstruct(A: torch.Tensor, B: torch.Tensor, gA: torch.Tensor, gB: torch.Tensor, scaling: float) -> torch.Tensor:
    """G = s * (gB @ A + B @ gA); broadcasts over a leading domain dimension of gA, gB."""
    return scaling * (gB @ A + B @ gA)


def mean_and_variance(
    A: torch.Tensor, B: torch.Tensor, gA: torch.Tensor, gB: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over domains of G[n] and the per-element population variance (1/N).

    Reconstruction is linear, so the mean is the reconstruction of the mean factor
    gradients. The variance accumulates one domain at a time: at most three out x in
    matrices are alive, whatever N.
    """
    gA_mean = gA.mean(dim=0)
    gB_mean = gB.mean(dim=0)
    mean = reconstruct(A, B, gA_mean, gB_mean, scaling)
    var = torch.zeros_like(mean)
    for n in range(gA.shape[0]):
        dev = reconstruct(A, B, gA[n] - gA_mean, gB[n] - gB_mean, scaling)
        var.addcmul_(dev, dev)
    var.div_(gA.shape[0])
    return mean, var
