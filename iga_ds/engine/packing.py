"""The boundary's gathered output: each owner packs its modules' new factor gradients and
declared statistics into its chunk of one flat float32 buffer (the layout's ``out_offsets``),
the all-gather brings every chunk to every rank, and each rank unpacks every module's
gradients (views, no copy) and statistics (one small device-to-host copy). At world size 1
nothing travels: the results are taken as they are, their statistics rounded to float32 as
the packed path carries them, so that both report the same numbers.
"""
from __future__ import annotations

import math

import torch

from iga_ds.engine.collectives import Collectives
from iga_ds.engine.layout import Layout
from iga_ds.lora.modules import LoraModule
from iga_ds.methods.device_copies import host_to_device


class OutputPacking:
    """The packing of :class:`~iga_ds.engine.hook.EngineHook`'s gathered output, a part of the
    hook: it reads the hook's attributes declared here."""

    layout: Layout
    modules: list[LoraModule]
    stat_keys: tuple[str, ...]
    comm: Collectives
    device: torch.device
    _stat_index: torch.Tensor

    def _stat_positions(self) -> torch.Tensor:
        """Where each module's statistics sit in the gathered output: read back only those."""
        S = len(self.stat_keys)
        return torch.tensor(
            [self.layout.out_offsets[m.index] + m.rank * m.in_features + m.out_features * m.rank + j
             for m in self.modules for j in range(S)], dtype=torch.long, device=self.device)

    def _results_direct(self, mine: list[LoraModule], results) -> list | None:
        """World size 1: this rank owns every module, so packing would be pure copying."""
        if not results:
            return None
        return [(_as_shape(u.gA, (m.rank, m.in_features)), _as_shape(u.gB, (m.out_features, m.rank)))
                for m, u in zip(mine, results)]

    def _results_stats(self, mine: list[LoraModule], results) -> dict[str, dict[str, float]]:
        """Each module's statistics from the results themselves (world size 1), rounded to
        float32 as the packed path carries them, so that both report the same numbers."""
        table = self._stat_table(results).tolist() if results else []
        return {m.name: self._stat_dict(vals) for m, vals in zip(mine, table)}

    def _pack(self, mine: list[LoraModule], results) -> torch.Tensor:
        """This rank's chunk of the output: its modules' new gradients and statistics (zeros
        where the method did not run)."""
        lay, S = self.layout, len(self.stat_keys)
        out = torch.zeros(lay.out_chunk, dtype=torch.float32, device=self.device)
        if not results:
            return out
        base = self.comm.rank * lay.out_chunk
        # statistics are host floats: one host-to-device copy for all of them
        table = host_to_device(self._stat_table(results), self.device)
        for j, (m, u) in enumerate(zip(mine, results)):
            off = lay.out_offsets[m.index] - base
            nA, nB = m.rank * m.in_features, m.out_features * m.rank
            out[off: off + nA] = u.gA.reshape(-1)
            out[off + nA: off + nA + nB] = u.gB.reshape(-1)
            out[off + nA + nB: off + nA + nB + S] = table[j]
        return out

    def _unpack(self, gathered: torch.Tensor) -> list:
        """Every module's new (gA, gB), as views of the gathered output."""
        lay, updates = self.layout, []
        for m in self.modules:
            off = lay.out_offsets[m.index]
            nA, nB = m.rank * m.in_features, m.out_features * m.rank
            updates.append((gathered[off: off + nA].view(m.rank, m.in_features),
                            gathered[off + nA: off + nA + nB].view(m.out_features, m.rank)))
        return updates

    def _unpack_stats(self, gathered: torch.Tensor) -> dict[str, dict[str, float]]:
        """Every module's statistics from the gathered output: one small device-to-host copy."""
        host = gathered[self._stat_index].view(len(self.modules), len(self.stat_keys)).tolist()
        return {m.name: self._stat_dict(vals) for m, vals in zip(self.modules, host)}

    def _stat_table(self, results) -> torch.Tensor:
        """The results' declared statistics as one float32 host table (rows: modules; NaN where
        a module reports no such statistic)."""
        return torch.tensor([[float(u.stats.get(k, math.nan)) for k in self.stat_keys] for u in results],
                            dtype=torch.float32)

    def _stat_dict(self, values: list[float]) -> dict[str, float]:
        """One row of the table back to a statistics dict, without the statistics it lacks."""
        return {k: v for k, v in zip(self.stat_keys, values) if not math.isnan(v)}


def _as_shape(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``t`` as a float32 tensor of ``shape``; the methods' results usually are one already, and
    this runs once per tensor while the device waits for the host: no operator where none is
    needed."""
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.shape == shape else t.reshape(shape)
