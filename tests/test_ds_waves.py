"""The hook's buffer layout and the schedule that overlaps the method with its collectives.

The numbers these feed are checked end to end against a single-process reference in
tests/test_ds_hook.py (gloo processes, several wave counts); here: the bookkeeping itself.
"""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from iga_ds.engine.collectives import Collectives, Pending
from iga_ds.methods.iga.method import MASK_STATISTICS
from iga_ds.engine.layout import assign_owners, build_layout, run_waves, split_into_waves
from iga_ds.lora.modules import LoraModule


def fake_modules(shapes: list[tuple[int, int, int]]) -> list[LoraModule]:
    """LoRA modules of the given (rank, in, out) shapes (weights on the meta device: shapes only)."""
    return [LoraModule(f"m{i}", i, nn.Linear(fin, r, bias=False, device="meta"),
                       nn.Linear(r, fout, bias=False, device="meta"), 2.0)
            for i, (r, fin, fout) in enumerate(shapes)]


def random_shapes(rng: random.Random, count: int) -> list[tuple[int, int, int]]:
    return [(rng.choice([2, 4, 6]), rng.choice([8, 16, 40]), rng.choice([8, 24, 64])) for _ in range(count)]


@pytest.mark.parametrize("seed", range(6))
def test_waves_are_consecutive_nonempty_and_balanced(seed):
    rng = random.Random(seed)
    modules = fake_modules(random_shapes(rng, rng.randint(1, 12)))
    total = sum(m.full_rank_cost for m in modules)
    biggest = max(m.full_rank_cost for m in modules)
    for waves in range(1, len(modules) + 3):
        groups = split_into_waves(modules, waves)
        assert [m.index for g in groups for m in g] == list(range(len(modules)))
        assert len(groups) == min(waves, len(modules)) and all(groups)
        if all(m.full_rank_cost == modules[0].full_rank_cost for m in modules):
            continue
        # each cut is made at the first module that reaches its share, unless modules run short
        for g in groups[:-1]:
            assert sum(m.full_rank_cost for m in g) <= total / len(groups) + biggest or len(g) == 1


def test_equal_modules_split_evenly():
    modules = fake_modules([(4, 16, 16)] * 12)
    assert [len(g) for g in split_into_waves(modules, 4)] == [3, 3, 3, 3]
    assert [len(g) for g in split_into_waves(modules, 5)] == [3, 2, 3, 2, 2]
    assert [len(g) for g in split_into_waves(modules, 12)] == [1] * 12


def test_owners_balance_by_size_largest_first():
    modules = fake_modules([(4, 64, 64), (4, 8, 8), (4, 8, 8), (4, 64, 64), (4, 16, 16)])
    owners = assign_owners(modules, 2)
    load = [sum(m.full_rank_cost for m in modules if owners[m.index] == k) for k in range(2)]
    assert owners[0] != owners[3] and abs(load[0] - load[1]) <= 64 * 64
    assert assign_owners(modules, 2, "round_robin") == {i: i % 2 for i in range(5)}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("waves", [1, 2, 3, 7])
def test_every_module_sits_in_its_owners_chunk_of_its_wave_without_overlap(world_size, waves):
    rng = random.Random(world_size * 10 + waves)
    modules = fake_modules(random_shapes(rng, 9))
    N = 3
    lay = build_layout(modules, world_size, N, waves, num_stats=len(MASK_STATISTICS))
    assert len(lay.waves) == min(waves, len(modules))
    in_used = torch.zeros(lay.in_size, dtype=torch.int32)
    out_used = torch.zeros(lay.out_size, dtype=torch.int32)
    in_pos = out_pos = 0
    for wave in lay.waves:
        assert (wave.in_start, wave.out_start) == (in_pos, out_pos)  # waves back to back
        in_pos += world_size * wave.in_chunk
        out_pos += world_size * wave.out_chunk
        owners_here = set()
        for m in wave.modules:
            k = lay.owners[m.index]
            owners_here.add(k)
            n_in = N * (m.rank * m.in_features + m.out_features * m.rank)
            n_out = m.rank * m.in_features + m.out_features * m.rank + len(MASK_STATISTICS)
            chunk_in = wave.in_start + k * wave.in_chunk
            chunk_out = wave.out_start + k * wave.out_chunk
            assert chunk_in <= lay.in_offsets[m.index] and lay.in_offsets[m.index] + n_in <= chunk_in + wave.in_chunk
            assert chunk_out <= lay.out_offsets[m.index] and lay.out_offsets[m.index] + n_out <= chunk_out + wave.out_chunk
            in_used[lay.in_offsets[m.index]: lay.in_offsets[m.index] + n_in] += 1
            out_used[lay.out_offsets[m.index]: lay.out_offsets[m.index] + n_out] += 1
        # a wave with enough modules gives every rank work
        assert len(owners_here) == min(world_size, len(wave.modules))
    assert (in_pos, out_pos) == (lay.in_size, lay.out_size)
    assert in_used.max() == 1 and out_used.max() == 1  # no two modules share an element
    assert sorted(m.index for w in lay.waves for m in w.modules) == list(range(len(modules)))


class Recorder:
    """Collectives and a method that log the order in which they are started and waited for."""

    def __init__(self):
        self.log: list[str] = []

    def pending(self, name: str, value):
        log = self.log

        class Logged(Pending):
            def wait(self):
                log.append(f"wait {name}")
                return super().wait()

        return Logged(value)


def test_the_schedule_sends_the_next_wave_before_computing_this_one():
    rec = Recorder()

    def exchange(k):
        rec.log.append(f"exchange {k}")
        return rec.pending(f"exchange {k}", f"sums {k}")

    def compute(k, received):
        assert received == f"sums {k}"
        rec.log.append(f"compute {k}")
        return f"results {k}"

    def gather(k, packed):
        assert packed == f"results {k}"
        rec.log.append(f"gather {k}")
        return rec.pending(f"gather {k}", k)

    in_flight = run_waves(3, exchange, compute, gather)
    assert rec.log == [
        "exchange 0", "wait exchange 0", "exchange 1", "compute 0", "gather 0",
        "wait exchange 1", "exchange 2", "compute 1", "gather 1",
        "wait exchange 2", "compute 2", "gather 2",
    ]
    # the gathers are left in flight for the caller
    assert [p.wait() for p in in_flight] == [0, 1, 2] and rec.log[-1] == "wait gather 2"


def test_single_process_collectives():
    comm = Collectives()
    assert comm.world_size == 1
    flat = torch.arange(6.0)
    assert torch.equal(comm.start_reduce_scatter_sum(flat).wait(), flat)
    out = torch.empty(6)
    assert comm.start_all_gather(flat, out).wait() is out and torch.equal(out, flat)
    with pytest.raises(ValueError, match="holds 5 elements, expected 1 x 6"):
        comm.start_all_gather(flat, torch.empty(5))


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_overlap_waves_must_be_a_whole_number_at_least_one(value):
    from iga_ds.engine import HookConfig
    from iga_ds.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^iga\.overlap_waves: expected a whole number of waves, at least 1"):
        HookConfig.from_dict({"method": "iga", "overlap_waves": value})


def test_overlap_waves_round_trips_and_defaults_to_one():
    from iga_ds.engine import HookConfig

    assert HookConfig().overlap_waves == 1
    cfg = HookConfig.from_dict({"method": "iga", "overlap_waves": 4})
    assert cfg.overlap_waves == 4 and HookConfig.from_dict(cfg.to_dict()) == cfg


def test_equal_modules_of_one_rank_stack_as_views_of_its_buffer():
    # the fused method stacks modules of one shape; laid out one after another, as a rank's
    # buffer holds them, their gradient sums stack without a copy (fused._stacked)
    from iga_ds.methods.iga.fused import _stacked

    modules = fake_modules([(4, 16, 12)] * 5)
    N = 3
    lay = build_layout(modules, 1, N, 1, num_stats=len(MASK_STATISTICS))
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
    from iga_ds.engine.hook import Float32Copies

    weights = [torch.randn(shape, dtype=torch.bfloat16) for _ in modules for shape in ((4, 16), (12, 4))]
    copies = Float32Copies(weights).refresh()
    for pieces in (copies[0::2], copies[1::2]):
        stacked = _stacked(pieces)
        assert torch.equal(stacked, torch.stack(pieces))
        assert stacked.untyped_storage().data_ptr() == pieces[0].untyped_storage().data_ptr()
