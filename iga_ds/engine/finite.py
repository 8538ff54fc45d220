"""Whether a step's tensors are finite, as device flags that the boundary folds into one and
reads once: no wait for the device per tensor, nor per module.
"""
from __future__ import annotations

import torch

from iga_ds.methods.iga.tiles import TiledResults


def finite_flag(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """A device flag, true when every element of every tensor is finite, without waiting for
    the device: one multi-tensor norm."""
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=device)
    # the total 2-norm is finite exactly when every element is (short of float32 overflow of
    # the sum of squares, at values above about 1e19)
    return torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all()


def results_finite(results, device) -> torch.Tensor:
    """:func:`finite_flag` of a method's results. A batched method's come as
    :class:`~iga_ds.methods.iga.tiles.TiledResults`, checked through the few buffers they
    tile, without a look at each module."""
    tensors = results.bases if isinstance(results, TiledResults) else [t for u in results for t in (u.gA, u.gB)]
    return finite_flag(tensors, device)
