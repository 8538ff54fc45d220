"""What the engine hook and the batched methods share for speed, and a method's author never
needs: the contract itself is :mod:`iga_ds.methods.base`.

- :class:`StableModules`: modules handed over again and again with the same storage, so a
  method may keep what it derives from their layout (the fused IGA's stacked views).
- :class:`TiledResults`: results whose tensors tile a few buffers, checked through them.
- :class:`StatsTable`, :class:`PendingStats`: per-module statistics on their way from the
  device to the host, read when first used.
- :func:`host_to_device`, :func:`stacked_view`, :func:`flat_span`: copies that do not stall the
  device, and views of many tensors as one without a copy.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Iterator, Sequence

import torch


class StableModules(list):
    """A list of :class:`~iga_ds.methods.base.ModuleGrads` that a caller hands to a method
    again and again, whose tensors keep their storage and shapes from call to call while their
    values change (the engine hook's views of the buffers it writes in place each step).

    A method may keep, in :attr:`derived`, what it builds from the layout alone (stacked views
    of the tensors, per-module constants on the device) and reuse it on the next call instead
    of rebuilding it while the device waits; the keys are the method's own. The caller must
    not replace the modules or their tensors: it hands over a new list instead."""

    def __init__(self, modules=()):
        super().__init__(modules)
        self.derived: dict = {}


class TiledResults(list):
    """A method's results, one per module, whose gradient tensors are views that cover
    ``bases`` exactly, element for element (a batched method's per-module results are views
    of a few stacked buffers). A caller may check the bases in place of every module's
    tensors: the engine hook's finiteness check then costs a reduction per base and no
    per-module work on the host, while the device waits for it."""

    def __init__(self, results=(), bases: Sequence[torch.Tensor] = ()):
        super().__init__(results)
        self.bases = list(bases)


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


def flat_span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view of all the tensors, in order, when they lie back to back in one storage
    (contiguous, of one dtype, each starting where the one before ends; their sizes may
    differ), as ZeRO lays out a group's parameters; None otherwise. Where
    :func:`stacked_view` needs equal sizes equally spaced, this needs no gaps."""
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


class StatsTable:
    """Statistics of many modules computed on the device (rows: statistics, columns: modules),
    on their way to the host.

    The copy is queued without waiting for the device (into pinned memory, on CUDA); the host
    waits for it only when a value is first read. The engine hook reads them after the
    optimizer step has been queued, so the device is never left idle for them.
    ``send=False``: the table's values are still being written (its columns can be handed out
    already); :meth:`send` queues the copy once they are."""

    def __init__(self, keys: Sequence[str], table: torch.Tensor, send: bool = True):
        self.keys = list(keys)
        self._table = table
        self._ready = None
        self._host: torch.Tensor | None = None
        self._rows: list[list[float]] | None = None
        if send:
            self.send()

    def send(self) -> None:
        """Queue the copy of the table to the host (once its values are all written)."""
        table = self._table
        if table.device.type == "cuda":
            self._host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
            self._host.copy_(table, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:  # on the CPU already, or a device without pinned copies: a plain copy
            self._host = table.cpu()
        self._table = None

    def column(self, index: int) -> "PendingStats":
        """One module's statistics, read when first used."""
        return PendingStats(self, index)

    def values(self, index: int) -> dict[str, float]:
        if self._host is None:
            raise RuntimeError("statistics read before their table was sent to the host")
        if self._rows is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._rows = self._host.tolist()
        return {key: row[index] for key, row in zip(self.keys, self._rows)}


class PendingStats(MutableMapping):
    """One module's statistics from a :class:`StatsTable`: a dict once first read."""

    def __init__(self, table: StatsTable, index: int):
        self._table, self._index = table, index
        self._values: dict[str, float] | None = None

    def _resolved(self) -> dict[str, float]:
        if self._values is None:
            self._values = self._table.values(self._index)
        return self._values

    def __getitem__(self, key: str) -> float:
        return self._resolved()[key]

    def __setitem__(self, key: str, value: float) -> None:
        self._resolved()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._resolved()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())

    def __repr__(self) -> str:
        return f"PendingStats({self._resolved()!r})"
