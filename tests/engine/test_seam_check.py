"""The DeepSpeed seam checked by behaviour: the gradient DeepSpeed's optimizer steps with is read
back, from where its step reads it, and compared with the one the engine hook wrote. A
DeepSpeed whose fragment link hands out copies (every attribute still there, so the attach check
passes) trained on zeros and ended "done" with grad_norm 0; it now stops in one line. Tiny CPU
runs of IGA through the trainer (ZeRO-2, gloo, one rank)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seam")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=4, seed=4)
    return tmp, data, tiny_base(tmp, data)


def _train(setup, out, steps=3, check_every_steps=None):
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    tmp, data, base = setup
    raw = run_config_dict(tmp, data, output_dir=str(out), **{
        "schedule.max_steps": steps, "method.name": "iga", "method.params": {"tau": 0.5}})
    if check_every_steps is not None:  # iga.check_every_steps in a copy of the run's DeepSpeed JSON
        ds = json.loads(Path(raw["deepspeed"]).read_text())
        ds["iga"]["check_every_steps"] = check_every_steps
        (out.parent / "ds.json").write_text(json.dumps(ds))
        raw["deepspeed"] = str(out.parent / "ds.json")
    return Trainer(config_from_dict(raw), base_model_dir=str(base), quiet=True).run()


def _fragments_handed_out_as_copies(patch: pytest.MonkeyPatch, from_write: int = 0, kept: bool = False) -> None:
    """DeepSpeed's fragment link returns a copy of each gradient fragment from the hook's
    ``from_write``-th write on (0: the first): what the hook writes there lands nowhere. ``kept``:
    the same copy at every call, so that a read through the link would find what was written."""
    from deepspeed.utils.tensor_fragment import tensor_fragment

    from iga_ds.engine.hook import EngineHook

    original, write = tensor_fragment.get_lp_grad_fragment, EngineHook._write
    broken, copies = {"on": False}, {}

    def get_lp_grad_fragment(self, index):
        fragment = original(self, index)
        if not broken["on"]:
            return fragment
        return copies.setdefault((id(self), index), fragment.clone()) if kept else fragment.clone()

    def _write(self, updates, step):
        broken["on"] = self.writes >= from_write
        return write(self, updates, step)

    patch.setattr(tensor_fragment, "get_lp_grad_fragment", get_lp_grad_fragment)
    patch.setattr(EngineHook, "_write", _write)


def _checks(patch: pytest.MonkeyPatch) -> list[float]:
    """The read-back differences of every check the hook makes, as they come."""
    from iga_ds.engine.internals import FullGradWriter

    seen, original = [], FullGradWriter.written_difference

    def written_difference(self, written):
        difference, tolerance = original(self, written)
        seen.append(float(difference))
        return difference, tolerance

    patch.setattr(FullGradWriter, "written_difference", written_difference)
    return seen


def test_fragments_handed_out_as_copies_trained_on_zeros_unnoticed(setup, tmp_path, monkeypatch):
    """The fault itself, with the check blinded: every step's gradient norm 0, and "done"."""
    import torch

    from iga_ds.engine.internals import FullGradWriter

    _fragments_handed_out_as_copies(monkeypatch)
    monkeypatch.setattr(FullGradWriter, "written_difference", lambda self, written: (torch.zeros(()), 1.0))
    result = _train(setup, tmp_path / "blind")
    assert result.status == "completed" and [r["grad_norm"] for r in result.history] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("from_write, stops_at, kept", [(0, 1, False), (2, 3, False), (0, 1, True)],
                         ids=["first-step", "third-step", "kept-copies"])
def test_fragments_handed_out_as_copies_stop_the_run_in_one_line(setup, tmp_path, monkeypatch, from_write, stops_at,
                                                                 kept):
    """Broken from the first write: stopped at step 1. Broken from the third on, with a check every
    2 steps: the check of step 1 reads back exactly what was written (fp32: the same bits), step 2
    has none, the check of step 3 stops the run (no adapter after the fault). Kept copies: the
    check reads where the step reads, not through the link the write went through."""
    import deepspeed

    from iga_ds.errors import UserError

    _fragments_handed_out_as_copies(monkeypatch, from_write, kept)
    seen = _checks(monkeypatch)
    out = tmp_path / "broken"
    with pytest.raises(UserError) as caught:
        _train(setup, out, steps=4, check_every_steps=2)
    line = str(caught.value)
    assert "\n" not in line and caught.value.exit_code == 2, line
    assert line.startswith(f"deepspeed {deepspeed.__version__}: optimizer step {stops_at}: the gradient "
                           "DeepSpeedZeroOptimizer would step with is not the one the engine hook wrote "
                           "(read back from DeepSpeedZeroOptimizer.averaged_gradients on rank 0, it differs by 1 "
                           "of its norm)"), line
    assert "install a deepspeed iga-ds is tested with" in line, line
    metrics = out / "metrics.jsonl"
    steps = [json.loads(row)["step"] for row in metrics.read_text().splitlines()] if metrics.exists() else []
    assert steps == list(range(1, stops_at)) and not (out / "adapter").exists()
    assert seen == [0.0] * (stops_at // 2) + [1.0]  # the fault: all of the written gradient missing
