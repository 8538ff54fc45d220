"""Where each module's per-domain sums and results sit in the hook's flat buffers.

Modules are assigned to owner ranks (balanced by their out x in cost) and split into waves of
consecutive modules; each wave's buffers hold one equal chunk per owner rank, so that one
reduce-scatter brings a wave's sums to their owners and one all-gather its results back.
Pure bookkeeping: no tensors, no process groups.
"""
from __future__ import annotations

from dataclasses import dataclass

from iga_ds.lora.modules import LoraModule


def assign_owners(modules: list[LoraModule], world_size: int, balance: str = "out_x_in") -> dict[int, int]:
    """Owner rank of each module (by module index): largest first onto the least-loaded rank
    (deterministic)."""
    if balance == "round_robin":
        return {m.index: m.index % world_size for m in modules}
    load = [0] * world_size
    owners = {}
    for m in sorted(modules, key=lambda m: (-m.full_rank_cost, m.index)):
        rank = min(range(world_size), key=lambda k: (load[k], k))
        owners[m.index] = rank
        load[rank] += m.full_rank_cost
    return owners


def split_into_waves(modules: list[LoraModule], waves: int) -> list[list[LoraModule]]:
    """At most ``waves`` runs of consecutive modules of about equal full-rank cost, none empty."""
    waves = max(1, min(int(waves), len(modules)))
    total = sum(m.full_rank_cost for m in modules)
    groups: list[list[LoraModule]] = []
    current: list[LoraModule] = []
    done = 0
    for i, m in enumerate(modules):
        current.append(m)
        done += m.full_rank_cost
        cuts_left = waves - 1 - len(groups)
        modules_left = len(modules) - i - 1
        if cuts_left > 0 and modules_left > 0 and (
                done * waves >= total * (len(groups) + 1) or modules_left == cuts_left):
            groups.append(current)
            current = []
    groups.append(current)
    return groups


def run_waves(count: int, start_exchange, compute, start_gather) -> list:
    """The schedule that overlaps the method with its collectives.

    Wave k + 1's sums travel while wave k's method runs, and wave k's results travel while
    wave k + 1's runs: ``start_exchange(k)`` and ``start_gather(k, packed)`` return
    :class:`~iga_ds.engine.collectives.Pending` collectives, ``compute(k, received)`` the packed results.
    Returns the gathers still in flight, in wave order.
    """
    pending = start_exchange(0)
    gathers = []
    for k in range(count):
        received = pending.wait()
        if k + 1 < count:
            pending = start_exchange(k + 1)
        gathers.append(start_gather(k, compute(k, received)))
    return gathers


@dataclass
class Wave:
    """Modules combined together; their sums sit in ``[in_start, in_start + W * in_chunk)`` of
    the input buffer (one chunk per owner rank), their results likewise in the output buffer."""

    modules: list[LoraModule]
    in_start: int
    in_chunk: int
    out_start: int
    out_chunk: int


@dataclass
class Layout:
    """Where each module's per-domain sums and results sit in the flat buffers."""

    owners: list[int]
    in_offsets: list[int]  # into the flat input buffer (wave and rank chunk offsets included)
    out_offsets: list[int]  # into the gathered output buffer
    waves: list[Wave]
    in_size: int
    out_size: int


def build_layout(modules: list[LoraModule], world_size: int, num_domains: int, waves: int = 1,
                 balance: str = "out_x_in", *, num_stats: int) -> Layout:
    """Buffers laid out wave by wave, each wave in one equal chunk per owner rank, so that one
    reduce-scatter brings a wave's sums to their owners and one all-gather its results back.
    A module's result is its new (gA, gB) and ``num_stats`` statistics."""
    in_sizes = [num_domains * (m.rank * m.in_features + m.out_features * m.rank) for m in modules]
    out_sizes = [m.rank * m.in_features + m.out_features * m.rank + num_stats for m in modules]
    owners, in_offsets, out_offsets = [0] * len(modules), [0] * len(modules), [0] * len(modules)
    placed: list[Wave] = []
    in_pos = out_pos = 0
    for group in split_into_waves(modules, waves):
        # owners balanced within each wave: every rank has work in every wave
        group_owners = assign_owners(group, world_size, balance)
        in_used, out_used = [0] * world_size, [0] * world_size
        for m in group:
            k = owners[m.index] = group_owners[m.index]
            in_offsets[m.index], out_offsets[m.index] = in_used[k], out_used[k]
            in_used[k] += in_sizes[m.index]
            out_used[k] += out_sizes[m.index]
        in_chunk, out_chunk = max(in_used) or 1, max(out_used) or 1
        for m in group:
            in_offsets[m.index] += in_pos + owners[m.index] * in_chunk
            out_offsets[m.index] += out_pos + owners[m.index] * out_chunk
        placed.append(Wave(group, in_pos, in_chunk, out_pos, out_chunk))
        in_pos += world_size * in_chunk
        out_pos += world_size * out_chunk
    return Layout(owners, in_offsets, out_offsets, placed, max(in_pos, 1), max(out_pos, 1))
