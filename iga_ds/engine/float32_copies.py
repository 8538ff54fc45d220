"""float32 versions of the LoRA factors for the method, refreshed each step without a cast
per tensor (:class:`Float32Copies`), and the one view of tensors that lie back to back which
lets one copy refresh them all (:func:`flat_span`).
"""
from __future__ import annotations

from typing import Sequence

import torch


def flat_span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view of all the tensors, in order, when they lie back to back in one storage
    (contiguous, of one dtype, each starting where the one before ends; their sizes may
    differ), as ZeRO lays out a group's parameters; None otherwise. Where
    :func:`iga_ds.methods.device_copies.stacked_view` needs equal sizes equally spaced, this
    needs no gaps."""
    if not tensors:
        return None
    first = tensors[0].detach()
    size, storage = first.element_size(), first.untyped_storage().data_ptr()
    ptrs = [t.data_ptr() for t in tensors]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.untyped_storage().data_ptr() == storage
               for t in tensors):
        return None
    if not all(a + t.numel() * size == b for t, a, b in zip(tensors, ptrs, ptrs[1:])):
        return None
    return first.as_strided((sum(t.numel() for t in tensors),), (1,))


class Float32Copies:
    """float32 versions of a fixed list of tensors (the LoRA factors), as they are at each
    :meth:`refresh`: the tensors themselves (detached) when all are float32, else copies in one
    flat buffer allocated once and refreshed by one multi-tensor copy. Casting 256 bf16
    factors one by one, or concatenating them, cost a millisecond of host time a step while
    the device waited."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = list(tensors)
        self.copies = None
        self._flat: torch.Tensor | None = None
        self._span: tuple[list[int], torch.Tensor | None] | None = None  # (addresses, flat_span)
        if any(t.dtype != torch.float32 for t in self.tensors):
            sizes = [t.numel() for t in self.tensors]
            self._flat = torch.empty(sum(sizes), dtype=torch.float32, device=self.tensors[0].device)
            self.copies = [piece.view(t.shape) for piece, t in zip(self._flat.split(sizes), self.tensors)]

    def refresh(self) -> list[torch.Tensor]:
        if self.copies is None:
            return [t.detach() for t in self.tensors]
        with torch.no_grad():
            span = self._source_span()
            if span is not None:
                self._flat.copy_(span)
            else:
                torch._foreach_copy_(self.copies, self.tensors)
        return self.copies

    def _source_span(self) -> torch.Tensor | None:
        """:func:`flat_span` of the tensors (DeepSpeed's ZeRO keeps the trainable parameters
        back to back in one flat buffer): then one copy refreshes them all, with no list of
        tensors for the host to pass. Kept while the tensors' addresses, checked on every call,
        stay the same: a tensor moved to other storage (a checkpoint load may do it) falls back
        to the per-tensor copy."""
        ptrs = [t.data_ptr() for t in self.tensors]
        if self._span is None or self._span[0] != ptrs:
            self._span = (ptrs, flat_span(self.tensors))
        return self._span[1]
