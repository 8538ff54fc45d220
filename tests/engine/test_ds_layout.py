"""The hook's buffer layout and its collectives in one process.

The numbers these feed are checked end to end against a single-process reference in
tests/engine/test_ds_hook.py (gloo processes); here: the bookkeeping itself.
"""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from iga_ds.engine.collectives import Collectives
from iga_ds.methods.iga.method import MASK_STATISTICS
from iga_ds.engine.layout import assign_owners, build_layout
from iga_ds.lora.modules import LoraModule


def fake_modules(shapes: list[tuple[int, int, int]]) -> list[LoraModule]:
    """LoRA modules of the given (rank, in, out) shapes (weights on the meta device: shapes only)."""
    return [LoraModule(f"m{i}", i, nn.Linear(fin, r, bias=False, device="meta"),
                       nn.Linear(r, fout, bias=False, device="meta"), 2.0)
            for i, (r, fin, fout) in enumerate(shapes)]


def random_shapes(rng: random.Random, count: int) -> list[tuple[int, int, int]]:
    return [(rng.choice([2, 4, 6]), rng.choice([8, 16, 40]), rng.choice([8, 24, 64])) for _ in range(count)]


def test_owners_balance_by_size_largest_first():
    modules = fake_modules([(4, 64, 64), (4, 8, 8), (4, 8, 8), (4, 64, 64), (4, 16, 16)])
    owners = assign_owners(modules, 2)
    load = [sum(m.full_rank_cost for m in modules if owners[m.index] == k) for k in range(2)]
    assert owners[0] != owners[3] and abs(load[0] - load[1]) <= 64 * 64


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_module_sits_in_its_owners_chunk_without_overlap(world_size):
    rng = random.Random(world_size)
    modules = fake_modules(random_shapes(rng, 9))
    N = 3
    lay = build_layout(modules, world_size, N, num_stats=len(MASK_STATISTICS))
    assert (lay.in_size, lay.out_size) == (world_size * lay.in_chunk, world_size * lay.out_chunk)
    in_used = torch.zeros(lay.in_size, dtype=torch.int32)
    out_used = torch.zeros(lay.out_size, dtype=torch.int32)
    for m in modules:
        k = lay.owners[m.index]
        n_in = N * (m.rank * m.in_features + m.out_features * m.rank)
        n_out = m.rank * m.in_features + m.out_features * m.rank + len(MASK_STATISTICS)
        assert k * lay.in_chunk <= lay.in_offsets[m.index] and lay.in_offsets[m.index] + n_in <= (k + 1) * lay.in_chunk
        assert k * lay.out_chunk <= lay.out_offsets[m.index]
        assert lay.out_offsets[m.index] + n_out <= (k + 1) * lay.out_chunk
        in_used[lay.in_offsets[m.index]: lay.in_offsets[m.index] + n_in] += 1
        out_used[lay.out_offsets[m.index]: lay.out_offsets[m.index] + n_out] += 1
    assert in_used.max() == 1 and out_used.max() == 1  # no two modules share an element
    # with enough modules every rank has work
    assert len(set(lay.owners)) == min(world_size, len(modules))


def test_single_process_collectives():
    comm = Collectives()
    assert comm.world_size == 1
    flat = torch.arange(6.0)
    assert torch.equal(comm.start_reduce_scatter_sum(flat).wait(), flat)
    out = torch.empty(6)
    assert comm.start_all_gather(flat, out).wait() is out and torch.equal(out, flat)
    with pytest.raises(ValueError, match="holds 5 elements, expected 1 x 6"):
        comm.start_all_gather(flat, torch.empty(5))


def test_equal_modules_of_one_rank_stack_as_views_of_its_buffer():
    # the fused method stacks modules of one shape; laid out one after another, as a rank's
    # buffer holds them, their gradient sums stack without a copy (fused._stacked)
    from iga_ds.methods.iga.batched import _stacked

    modules = fake_modules([(4, 16, 12)] * 5)
    N = 3
    lay = build_layout(modules, 1, N, num_stats=len(MASK_STATISTICS))
    flat = torch.arange(lay.in_size, dtype=torch.float32)
    gA, gB = [], []
    for m in modules:  # as the hook's buffers view it
        off, nA, nB = lay.in_offsets[m.index], N * m.rank * m.in_features, N * m.out_features * m.rank
        gA.append(flat[off: off + nA].view(N, m.rank, m.in_features))
        gB.append(flat[off + nA: off + nA + nB].view(N, m.out_features, m.rank))
    for pieces in (gA, gB):
        stacked = _stacked(pieces)
        assert torch.equal(stacked, torch.stack(pieces))
        assert stacked.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    # and so do the float32 copies of bf16 factors, A then B of each module
    from iga_ds.engine.float32_copies import Float32Copies

    weights = [torch.randn(shape, dtype=torch.bfloat16) for _ in modules for shape in ((4, 16), (12, 4))]
    copies = Float32Copies(weights).refresh()
    for pieces in (copies[0::2], copies[1::2]):
        stacked = _stacked(pieces)
        assert torch.equal(stacked, torch.stack(pieces))
        assert stacked.untyped_storage().data_ptr() == pieces[0].untyped_storage().data_ptr()
