"""On GPUs (NCCL, bf16): the ZeRO-2 hook at world size N against world size 1, same data and seed.

N is the number of visible CUDA devices (2 on a 2-GPU machine, 8 on a full node), or
IGA_DS_GPU_WORLD when set (at most the number of devices). Both runs see the same global batch
of each step (see equivalence_layouts): world size 1 accumulates all its micro-batches, world
size N two per rank, with unequal domain mixes per rank.

bf16 training differs between world sizes by rounding alone (other reduction order, other
micro-batch grouping), and AdamW's first steps turn that into weight differences of the order
of the learning rate wherever a gradient element is near zero. So the yardstick is DeepSpeed's
own plain path: ERM's relative update difference between world sizes. The hook must add no
error beyond it (within a factor of 2). Skipped without two CUDA devices. Writes what it
reached to $IGA_DS_RESULTS/gpu_equivalence.json when that variable is set (docs/HOOK.md).

The layout construction has a fast CPU test of its own (no GPU marks).
"""
from __future__ import annotations

import json
import os
from collections import Counter
from typing import NamedTuple

import pytest
import torch

from test_ds_hook import assert_checks_agree, reference, run
from tiny_models import tiny_peft_llama

MICRO = 3  # sequences per micro-batch
PER_RANK = 2  # micro-batches each rank of world size N accumulates
NUM_DOMAINS = 3  # sequence i is domain i % 3 (ds_worker.global_batch)


class Layouts(NamedTuple):
    size: int  # sequences per optimizer step
    one_rank: list  # layout of world size 1: [rank][micro-batch][sequence index]
    ranks: list  # layout of world size N
    gas_one: int  # gradient accumulation of world size 1
    gas_world: int  # gradient accumulation of each rank of world size N


def equivalence_layouts(world: int, micro: int = MICRO, per_rank: int = PER_RANK,
                        num_domains: int = NUM_DOMAINS) -> Layouts:
    """One optimizer step's global batch, laid out for world size 1 and for world size ``world``.

    ``world * per_rank`` micro-batches of ``micro`` sequences. World size 1 accumulates all of
    them, in index order (every micro-batch mixes the domains). World size N: each rank takes a
    contiguous slice of the sequences sorted by domain, ``per_rank`` micro-batches of it, so the
    ranks see unequal domain mixes (at larger N some ranks see one domain only) while the step
    as a whole has every domain equally often. At N = 2: 12 sequences, world size 1 accumulates
    4 micro-batches of 3, each rank 2.
    """
    if world < 1 or micro < 1 or per_rank < 1:
        raise ValueError(f"world {world}, micro {micro}, per_rank {per_rank}: expected positive integers")
    size = world * per_rank * micro
    one_rank = [[list(range(start, start + micro)) for start in range(0, size, micro)]]
    by_domain = sorted(range(size), key=lambda i: (i % num_domains, i))
    share = per_rank * micro
    ranks = [
        [by_domain[r * share + m * micro : r * share + (m + 1) * micro] for m in range(per_rank)]
        for r in range(world)
    ]
    return Layouts(size, one_rank, ranks, world * per_rank, per_rank)


def gpu_world() -> int:
    """World size of the GPU test: IGA_DS_GPU_WORLD if set, else the number of CUDA devices."""
    want = os.environ.get("IGA_DS_GPU_WORLD", "").strip()
    if want:
        return int(want)
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


WORLD = gpu_world()
needs_gpus = pytest.mark.skipif(
    not 2 <= WORLD <= _devices(),
    reason=f"needs 2 or more CUDA devices (world size {WORLD}, {_devices()} visible)",
)


# -- the layouts (CPU, fast) -------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_layouts_hold_the_same_global_batch_once_per_step(world):
    lay = equivalence_layouts(world)
    assert lay.size == world * PER_RANK * MICRO
    assert len(lay.one_rank) == 1 and len(lay.ranks) == world
    for layout, gas in ((lay.one_rank, lay.gas_one), (lay.ranks, lay.gas_world)):
        # every rank accumulates `gas` micro-batches of MICRO sequences (ds_worker reads the
        # micro-batch size from layout[0][0])
        assert all(len(rank) == gas for rank in layout)
        assert all(len(mb) == MICRO for rank in layout for mb in rank)
        flat = [i for rank in layout for mb in rank for i in mb]
        # every sequence exactly once per step: the same global set in both layouts
        assert sorted(flat) == list(range(lay.size))
    # the same number of micro-batches per step: DeepSpeed's loss scaling 1 / (world x gas) agrees
    assert lay.gas_one == world * lay.gas_world
    domains = Counter(i % NUM_DOMAINS for rank in lay.ranks for mb in rank for i in mb)
    assert set(domains.values()) == {lay.size // NUM_DOMAINS}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_layouts_give_the_ranks_unequal_domain_mixes(world):
    lay = equivalence_layouts(world)
    mixes = {tuple(sorted(Counter(i % NUM_DOMAINS for mb in rank for i in mb).items())) for rank in lay.ranks}
    assert len(mixes) > 1, "all ranks see the same domain mix: the per-rank sums would not be tested"
    # world size 1: every micro-batch holds one sequence of each domain
    assert all(sorted(i % NUM_DOMAINS for i in mb) == [0, 1, 2] for mb in lay.one_rank[0])


def test_two_rank_layout_keeps_the_per_rank_sets_of_the_recorded_run():
    # the run recorded in docs/HOOK.md: rank 0 held {0, 3, 1, 6, 9, 4}, rank 1 {7, 10, 2, 5, 8, 11}
    lay = equivalence_layouts(2)
    assert lay.size == 12 and lay.gas_one == 4 and lay.gas_world == 2
    assert [sorted(i for mb in rank for i in mb) for rank in lay.ranks] == [[0, 1, 3, 4, 6, 9], [2, 5, 7, 8, 10, 11]]


def test_gpu_world_reads_the_override(monkeypatch):
    monkeypatch.setenv("IGA_DS_GPU_WORLD", "8")
    assert gpu_world() == 8
    monkeypatch.delenv("IGA_DS_GPU_WORLD")
    assert gpu_world() == _devices()


# -- the GPU run --------------------------------------------------------------------------------


def relative_update_difference(a: dict, b: dict, start: dict) -> float:
    """||theta_a - theta_b|| / ||theta_b - theta_0|| over all trainable tensors."""
    num = sum((a[k] - b[k]).double().pow(2).sum() for k in b) ** 0.5
    den = sum((b[k] - start[k]).double().pow(2).sum() for k in b) ** 0.5
    return float(num / den)


@pytest.mark.gpu
@pytest.mark.slow
@needs_gpus
def test_zero2_bf16_world_size_n_matches_world_size_1(tmp_path):
    world = WORLD
    lay = equivalence_layouts(world)
    key = f"w{world}_vs_w1"
    start = {n: p.detach().clone() for n, p in tiny_peft_llama(seed=0).named_parameters() if p.requires_grad}
    record = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bf16", "steps": 3,
              "lr": 1e-2, "world_size": world, "sequences_per_step": lay.size, "micro_batch": MICRO,
              "gas_world_1": lay.gas_one, f"gas_world_{world}": lay.gas_world,
              "metric": f"||theta_W{world} - theta_W1|| / ||theta_W1 - theta_0||", "methods": {}}
    for method, params in (("erm", {}), ("iga", {"tau": 0.5}), ("pcgrad", {})):
        common = {"method": method, "params": params, "steps": 3, "cuda": True, "bf16": True, "lr": 1e-2,
                  "overlap_comm": True}
        (tmp_path / method / "w1").mkdir(parents=True)
        (tmp_path / method / f"w{world}").mkdir(parents=True)
        w1 = run(tmp_path / method / "w1", {**common, "gas": lay.gas_one, "layout": lay.one_rank}, world=1)["params"]
        wn = run(tmp_path / method / f"w{world}", {**common, "gas": lay.gas_world, "layout": lay.ranks},
                 world=world)["params"]
        fp32 = reference({**common, "gas": lay.gas_world, "layout": lay.ranks, "cuda": False})
        record["methods"][method] = {
            key: relative_update_difference(wn, w1, start),
            f"w{world}_bf16_vs_fp32_reference": relative_update_difference(wn, fp32, start),
        }
    print(json.dumps(record, indent=2))
    out = os.environ.get("IGA_DS_RESULTS")
    if out:
        with open(os.path.join(out, "gpu_equivalence.json"), "w") as f:
            json.dump(record, f, indent=2)
    erm = record["methods"]["erm"][key]
    for method in ("iga", "pcgrad"):
        assert record["methods"][method][key] <= max(2 * erm, 1e-3), record


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(_devices() < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["erm", "iga"])
def test_fused_gradient_checks_give_deepspeeds_answers_in_bf16(tmp_path, method):
    """In bf16 DeepSpeed runs its per-tensor NaN/Inf test at every step (on a CPU, where bf16 is
    refused, only the norm runs): the hook's multi-tensor test and norm against DeepSpeed's own
    loops on the same gradients, clean and with a NaN, +Inf or -Inf put into one element."""
    got = run(tmp_path, {"method": method, "params": {}, "gas": 2, "layout": [[[0, 1, 2], [3, 4, 5]]], "steps": 2,
                         "cuda": True, "bf16": True, "compare_checks": True}, world=1)
    assert got["skipped"] == 0
    assert_checks_agree(got, steps=2)
