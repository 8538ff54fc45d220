"""A node lost while a checkpoint is being written must not leave `latest` naming it.

DeepSpeed's engine writes its `latest` file on rank 0 as soon as rank 0's own files are written,
before the barrier that ends its save; a node lost between the two leaves `latest` naming a
checkpoint without that node's ZeRO partition, and the resumed job fails. The trainer therefore
asks DeepSpeed not to write it and writes it itself after DeepSpeed's save returned (past that
barrier). tests/test_two_node_slurm.py powers a node off mid-run on a real two-node Slurm; this
pins the order, which a power-off hits only by chance.
"""
from __future__ import annotations

import inspect
from pathlib import Path

from iga_ds.train import checkpoint


class DeepSpeedLikeEngine:
    """Writes files as DeepSpeed's ``save_checkpoint`` does, and notes what ``latest`` said at
    the point where the other ranks may still be writing (just before the final barrier)."""

    def __init__(self):
        self.latest_before_barrier: str | None = None

    def save_checkpoint(self, save_dir, tag, client_state, exclude_frozen_parameters, save_latest=True):
        folder = Path(save_dir) / tag
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"model")
        (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"partition of rank 0")
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)
        latest = Path(save_dir) / "latest"
        self.latest_before_barrier = latest.read_text() if latest.exists() else None
        return True  # DeepSpeed: dist.barrier(), then return


def test_deepspeed_writes_latest_before_its_final_barrier():
    """What the stand-in above copies, read from the installed DeepSpeed."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    source = inspect.getsource(DeepSpeedEngine.save_checkpoint)
    assert "save_latest" in inspect.signature(DeepSpeedEngine.save_checkpoint).parameters
    assert source.index("'latest'") < source.rindex("dist.barrier()")


def test_latest_names_a_checkpoint_only_after_every_rank_wrote_it(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "save_full_optimizer_state", lambda engine, path, rank: path.write_bytes(b""))
    engine = DeepSpeedLikeEngine()
    ckpts = tmp_path / "checkpoints"
    checkpoint.save_checkpoint(engine, ckpts, 1, {"step": 1}, rank=0, keep_last=2)
    checkpoint.save_checkpoint(engine, ckpts, 2, {"step": 2}, rank=0, keep_last=2)
    # while the other ranks may still be writing step 2, `latest` still names step 1
    assert engine.latest_before_barrier == checkpoint.tag_for(1)
    assert checkpoint.latest_checkpoint(ckpts) == ckpts / checkpoint.tag_for(2)
    assert not list(ckpts.glob("*.tmp")) and not list(ckpts.glob(".*"))
