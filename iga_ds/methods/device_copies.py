"""Copies to the device that do not stall it, and many tensors viewed as one without a copy:
what the LoRA capture, the engine hook and the batched IGA path share for speed.
"""
from __future__ import annotations

from typing import Sequence

import torch


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor on ``device``, without waiting for the device.

    A plain ``.to("cuda")`` copies from pageable memory, and PyTorch then synchronizes the
    stream: the host waits for every kernel queued so far. From pinned memory the copy is
    queued like a kernel (the pinned block is not reused before it ran)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def stacked_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensors stacked along a new first dimension, in the first one's shape, as a view of
    the storage they share, without a copy, when they are contiguous, of one dtype and element
    count, and equally spaced in it, in order; None otherwise (and for fewer than two). Each
    item of the view holds its tensor's elements in order (the shapes themselves may differ)."""
    if len(tensors) < 2:
        return None
    first, last = tensors[0], tensors[-1]
    numel, dtype = first.numel(), first.dtype
    if not all(t.is_contiguous() and t.numel() == numel and t.dtype is dtype for t in tensors):
        return None
    ptrs = [t.data_ptr() for t in tensors]
    step = ptrs[1] - ptrs[0]
    size = first.element_size()
    storage = first.untyped_storage()
    if (step >= numel * size and step % size == 0
            and all(b - a == step for a, b in zip(ptrs, ptrs[1:]))
            and last.untyped_storage().data_ptr() == storage.data_ptr()
            and ptrs[-1] + last.numel() * size <= storage.data_ptr() + storage.nbytes()):
        return first.as_strided((len(tensors), *first.shape), (step // size, *first.stride()))
    return None


def stats_to_host(updates: list) -> list:
    """The updates' tensor statistics as floats, in one device-to-host copy: a copy per figure would wait for
    the device once per module."""
    slots = [(u.stats, k) for u in updates for k, v in u.stats.items() if isinstance(v, torch.Tensor)]
    if slots:
        # float64 holds every float32 and bfloat16 value exactly: the figures equal float(tensor)
        values = torch.stack([stats[k].detach().reshape(()).to(torch.float64) for stats, k in slots]).tolist()
        for (stats, k), value in zip(slots, values):
            stats[k] = value
    return updates
