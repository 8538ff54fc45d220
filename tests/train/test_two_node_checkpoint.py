"""A node lost while a checkpoint is being written must leave nothing a later run could take for a
checkpoint.

DeepSpeed's engine writes its `latest` file on rank 0 as soon as rank 0's own files are written,
before the barrier that ends its save; a node lost between the two leaves `latest` naming a
checkpoint without that node's ZeRO partition, and the resumed job fails. So every rank writes
into `partial-step_<N>`, DeepSpeed is asked not to write `latest`, and once DeepSpeed's save has
returned (past that barrier) rank 0 renames the folder to `step_<N>` and writes `latest`. A save
cut short leaves only the `partial-` folder, which the next save removes.
tests/launch/test_two_node_slurm.py powers a node off mid-run on a real two-node Slurm; these pin the
order, which a power-off hits only by chance. tests/train/test_train_resume.py resumes through
DeepSpeed's own loader from the renamed folders.
"""
from __future__ import annotations

import inspect
import logging
from pathlib import Path

import pytest

from iga_ds.errors import ConfigError
from iga_ds.train import checkpoint

MODEL_STATES = "mp_rank_00_model_states.pt"


def zero_partition(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


class DeepSpeedLikeEngine:
    """Writes files as DeepSpeed's ``save_checkpoint`` does for ``world`` ranks, and notes what the
    folder looked like at the point where the other ranks may still be writing (just before the
    final barrier). ``lose_a_node=True``: a rank is gone before that barrier, so the save never
    returns (here it raises, as the peer watch ends the process)."""

    def __init__(self, world: int = 2, lose_a_node: bool = False):
        self.world = world
        self.lose_a_node = lose_a_node
        self.latest_before_barrier: str | None = None
        self.step_folders_before_barrier: list[str] = []

    def save_checkpoint(self, save_dir, tag, client_state, exclude_frozen_parameters, save_latest=True):
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MODEL_STATES).write_bytes(b"model")
        for rank in range(self.world):
            (folder / zero_partition(rank)).write_bytes(f"partition of rank {rank}".encode())
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)
        latest = Path(save_dir) / "latest"
        self.latest_before_barrier = latest.read_text() if latest.exists() else None
        self.step_folders_before_barrier = sorted(p.name for p in Path(save_dir).glob(f"{checkpoint.TAG_PREFIX}*"))
        if self.lose_a_node:
            raise RuntimeError("lost contact with rank 1")
        return True  # DeepSpeed: dist.barrier(), then return


@pytest.fixture(autouse=True)
def no_optimizer_gather(monkeypatch):
    """The full-size optimizer file needs a real ZeRO engine; an empty file stands in for it."""
    monkeypatch.setattr(checkpoint, "save_full_optimizer_state", lambda engine, path, rank: path.write_bytes(b""))


def save(engine, ckpts: Path, step: int) -> Path:
    return checkpoint.save_checkpoint(engine, ckpts, step, {"step": step}, rank=0, keep_last=2)


def test_deepspeed_writes_latest_before_its_final_barrier():
    """What the stand-in above copies, read from the installed DeepSpeed."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    source = inspect.getsource(DeepSpeedEngine.save_checkpoint)
    assert "save_latest" in inspect.signature(DeepSpeedEngine.save_checkpoint).parameters
    assert source.index("'latest'") < source.rindex("dist.barrier()")


def test_latest_names_a_checkpoint_only_after_every_rank_wrote_it(tmp_path):
    engine = DeepSpeedLikeEngine()
    ckpts = tmp_path / "checkpoints"
    save(engine, ckpts, 1)
    assert save(engine, ckpts, 2) == ckpts / checkpoint.tag_for(2)
    # while the other ranks may still be writing step 2, nothing names it yet
    assert engine.latest_before_barrier == checkpoint.tag_for(1)
    assert engine.step_folders_before_barrier == [checkpoint.tag_for(1)]
    assert checkpoint.latest_checkpoint(ckpts) == ckpts / checkpoint.tag_for(2)
    assert sorted((ckpts / checkpoint.tag_for(2)).iterdir()) == sorted(
        ckpts / checkpoint.tag_for(2) / name
        for name in ("meta.json", "rng_rank00000.pt", checkpoint.FULL_OPTIMIZER_FILE, MODEL_STATES,
                     zero_partition(0), zero_partition(1)))
    assert not list(ckpts.glob("*.tmp")) and not list(ckpts.glob(".*"))
    assert not list(ckpts.glob(f"{checkpoint.PARTIAL_PREFIX}*"))


def test_a_save_cut_short_leaves_no_step_folder_and_the_next_save_removes_it(tmp_path, caplog):
    ckpts = tmp_path / "checkpoints"
    save(DeepSpeedLikeEngine(world=4), ckpts, 1)
    with pytest.raises(RuntimeError, match="lost contact"):
        save(DeepSpeedLikeEngine(world=4, lose_a_node=True), ckpts, 2)
    # the next run resumes from step 1; no folder it could take for step 2 is there
    assert sorted(p.name for p in ckpts.glob(f"{checkpoint.TAG_PREFIX}*")) == [checkpoint.tag_for(1)]
    assert checkpoint.resolve_resume("auto", ckpts) == ckpts / checkpoint.tag_for(1)
    leftover = ckpts / f"{checkpoint.PARTIAL_PREFIX}{checkpoint.tag_for(2)}"
    assert leftover.is_dir()
    with pytest.raises(ConfigError, match="did not finish"):
        checkpoint.resolve_resume(str(leftover), ckpts)

    # resumed on 2 ranks, it saves step 2 again: the leftover goes first, with one line, and
    # none of its 4-rank files end up in the new checkpoint
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        save(DeepSpeedLikeEngine(world=2), ckpts, 2)
    removed = [r.getMessage() for r in caplog.records if "did not finish" in r.getMessage()]
    assert removed == [f"removing {leftover}, left by a checkpoint save that did not finish"]
    assert not leftover.exists()
    step2 = ckpts / checkpoint.tag_for(2)
    assert sorted(p.name for p in step2.glob("zero_pp_rank_*")) == [zero_partition(0), zero_partition(1)]
    assert checkpoint.latest_checkpoint(ckpts) == step2


def test_a_step_saved_again_replaces_the_old_folder_whole(tmp_path):
    """A run that started over (``resume: never``) in the same output folder saves steps that are
    there already; each new folder holds only its own save's files."""
    ckpts = tmp_path / "checkpoints"
    save(DeepSpeedLikeEngine(world=4), ckpts, 1)
    save(DeepSpeedLikeEngine(world=2), ckpts, 1)
    step1 = ckpts / checkpoint.tag_for(1)
    assert sorted(p.name for p in step1.glob("zero_pp_rank_*")) == [zero_partition(0), zero_partition(1)]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", checkpoint.tag_for(1)]
