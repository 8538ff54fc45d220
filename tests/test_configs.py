"""Every shipped config loads and validates: run YAMLs under configs/ and DeepSpeed JSONs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
YAMLS = sorted((REPO / "configs").glob("*.yaml"))
JSONS = sorted((REPO / "ds_configs").glob("*.json"))


def test_configs_are_shipped():
    assert YAMLS and {p.name for p in JSONS} >= {"zero2.json", "zero2_fp32.json"}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_run_yaml_opens_with_its_command_and_validates(path, monkeypatch):
    from iga_ds.train.batching import check_batch_layout
    from iga_ds.train.config import load_run_config
    from iga_ds.train.trainer import build_ds_config, load_ds_json

    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and f"--config configs/{path.name}" in first, first
    monkeypatch.chdir(REPO)
    cfg = load_run_config(path)
    assert (REPO / cfg.deepspeed).is_file()
    # the launch command decides the world size: `--num_gpus N` for the deepspeed launcher
    world = int(first.split("--num_gpus")[1].split()[0]) if "--num_gpus" in first else 1
    ds_path = first.split("--deepspeed")[1].split()[0] if "--deepspeed" in first else cfg.deepspeed
    accum = check_batch_layout(cfg.data.groups_per_step, cfg.data.groups_per_micro_batch, world)
    ds, iga = build_ds_config(cfg, load_ds_json(str(REPO / ds_path)), world, accum, ds_path, cpu=world == 1)
    assert ds["train_batch_size"] == cfg.data.groups_per_step * iga.num_domains
    assert iga.method == (cfg.method.name if cfg.method else iga.method)


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.name)
def test_deepspeed_json_has_a_valid_iga_block(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    from iga_ds.ds import split_config

    raw = json.loads(path.read_text())
    assert "iga" in raw
    ds, iga = split_config(raw)
    iga.validate()
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"].get("elastic_checkpoint") is True  # resume at another world size
    # DeepSpeed's own parser accepts it once the "auto" batch sizes are filled in
    filled = {**ds, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 8}
    DeepSpeedConfig(filled)


def test_precision_matches_the_file_name():
    fp32 = json.loads((REPO / "ds_configs" / "zero2_fp32.json").read_text())
    gpu = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    assert not fp32.get("bf16", {}).get("enabled") and not fp32.get("fp16", {}).get("enabled")
    assert gpu["bf16"]["enabled"] is True
