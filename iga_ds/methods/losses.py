"""Per-domain losses of a micro-batch, for the loss-level methods."""
from __future__ import annotations

import torch


def per_domain_means(sequence_losses: torch.Tensor, domain_ids: torch.Tensor, num_domains: int) -> torch.Tensor:
    """Mean sequence loss of each domain present in the micro-batch (absent domains dropped)."""
    domain_ids = domain_ids.to(sequence_losses.device)
    sums = torch.zeros(num_domains, dtype=sequence_losses.dtype, device=sequence_losses.device)
    sums = sums.index_add(0, domain_ids, sequence_losses)
    counts = torch.bincount(domain_ids, minlength=num_domains)
    present = counts > 0
    return sums[present] / counts[present].to(sums.dtype)
