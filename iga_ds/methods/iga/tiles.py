"""What the batched IGA path is handed and hands back beyond the contract
(:mod:`iga_ds.methods.base`), for speed; a method's author never needs it.

- :class:`StableModules`: modules handed over again and again with the same storage (the
  engine hook's views of its buffers), so that the batched path may keep what it derives from
  their layout (its stacked views) from call to call.
- :class:`TiledResults`: results whose tensors tile a few buffers, checked through them.
- :class:`StatsTable`, :class:`PendingStats`: per-module statistics on their way from the
  device to the host, read when first used.
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
