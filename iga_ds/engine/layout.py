"""Where each module's per-domain sums and results sit in the hook's flat buffers.

Modules are assigned to owner ranks (balanced by their out x in cost); the buffers hold one
equal chunk per owner rank, so that one reduce-scatter brings the sums to their owners and one
all-gather the results back. Pure bookkeeping: no tensors, no process groups.
"""
from __future__ import annotations

from dataclasses import dataclass

from iga_ds.lora.modules import LoraModule


def assign_owners(modules: list[LoraModule], world_size: int) -> dict[int, int]:
    """Owner rank of each module (by module index): largest first onto the least-loaded rank
    (deterministic)."""
    load = [0] * world_size
    owners = {}
    for m in sorted(modules, key=lambda m: (-m.full_rank_cost, m.index)):
        rank = min(range(world_size), key=lambda k: (load[k], k))
        owners[m.index] = rank
        load[rank] += m.full_rank_cost
    return owners


@dataclass
class Layout:
    """Where each module's per-domain sums and results sit in the flat buffers: rank k's
    modules in ``[k * in_chunk, (k + 1) * in_chunk)`` of the input buffer, their results
    likewise in the output buffer."""

    owners: list[int]
    in_offsets: list[int]  # into the flat input buffer (the owner's chunk offset included)
    out_offsets: list[int]  # into the gathered output buffer
    in_chunk: int
    out_chunk: int
    in_size: int
    out_size: int


def build_layout(modules: list[LoraModule], world_size: int, num_domains: int, *, num_stats: int) -> Layout:
    """Buffers laid out in one equal chunk per owner rank. A module's result is its new
    (gA, gB) and ``num_stats`` statistics."""
    in_sizes = [num_domains * (m.rank * m.in_features + m.out_features * m.rank) for m in modules]
    out_sizes = [m.rank * m.in_features + m.out_features * m.rank + num_stats for m in modules]
    owners, in_offsets, out_offsets = [0] * len(modules), [0] * len(modules), [0] * len(modules)
    assigned = assign_owners(modules, world_size)
    in_used, out_used = [0] * world_size, [0] * world_size
    for m in modules:
        k = owners[m.index] = assigned[m.index]
        in_offsets[m.index], out_offsets[m.index] = in_used[k], out_used[k]
        in_used[k] += in_sizes[m.index]
        out_used[k] += out_sizes[m.index]
    in_chunk, out_chunk = max(in_used, default=0) or 1, max(out_used, default=0) or 1
    for m in modules:
        in_offsets[m.index] += owners[m.index] * in_chunk
        out_offsets[m.index] += owners[m.index] * out_chunk
    return Layout(owners, in_offsets, out_offsets, in_chunk, out_chunk, world_size * in_chunk,
                  world_size * out_chunk)
