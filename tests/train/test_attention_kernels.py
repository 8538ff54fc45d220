"""model.cudnn_attention: the trainer sets whether SDPA may pick cuDNN's attention kernel, for its
process, before it loads the model (the switch is PyTorch's own; without CUDA it changes nothing
else, so the run's losses cannot tell: the flag itself is read back)."""
from __future__ import annotations

import pytest
import torch
import yaml

from iga_ds.config.run import load_run_config
from iga_ds.train.model import allow_cudnn_attention
from iga_ds.train.trainer import Trainer
from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl


@pytest.fixture
def restore_cudnn_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_allow_cudnn_attention_sets_the_process_flag(restore_cudnn_flag):
    for allowed in (False, True, False):
        allow_cudnn_attention(allowed)
        assert torch.backends.cuda.cudnn_sdp_enabled() is allowed


@pytest.mark.slow
def test_the_trainer_applies_model_cudnn_attention(tmp_path, restore_cudnn_flag):
    data = write_isomer_jsonl(tmp_path / "train.jsonl", groups=4, seed=3)
    base = tiny_base(tmp_path, data)
    for name, over, want in (("default", {}, False), ("on", {"model.cudnn_attention": True}, True)):
        torch.backends.cuda.enable_cudnn_sdp(not want)  # the run must set it, whatever it was
        cfg = run_config_dict(tmp_path, data, output_dir=str(tmp_path / name), **{"schedule.max_steps": 1},
                              **{"data.groups_per_step": 2, "model.name_or_path": str(base)}, **over)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        assert Trainer(load_run_config(path), quiet=True).run().status == "completed"
        assert torch.backends.cuda.cudnn_sdp_enabled() is want, name
