"""Every shipped config loads and validates: run YAMLs under configs/ and DeepSpeed JSONs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
YAMLS = sorted((REPO / "configs").glob("*.yaml"))
JSONS = sorted((REPO / "ds_configs").glob("*.json"))


def test_configs_are_shipped():
    assert YAMLS and {p.name for p in JSONS} >= {"zero2.json", "zero2_fp32.json"}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_run_yaml_opens_with_its_command_and_validates(path, monkeypatch):
    from iga_ds.train.batching import check_batch_layout
    from iga_ds.config.run import load_run_config
    from iga_ds.config.deepspeed import build_ds_config, load_ds_json

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

    from iga_ds.engine import split_config

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


def test_config_reference_is_up_to_date():
    """docs/CONFIG.md is generated from the fields; its own regeneration command, run with --check."""
    import subprocess
    import sys

    doc = (REPO / "docs" / "CONFIG.md").read_text(encoding="utf-8")
    command = "python -m iga_ds.config.reference docs/CONFIG.md"
    assert command in doc
    check = subprocess.run([sys.executable, "-m", "iga_ds.config.reference", "--check", "docs/CONFIG.md"],
                           cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_every_config_field_is_documented():
    from iga_ds.config.hook import HookConfig
    from iga_ds.config.run import RunConfig, TinyBaseConfig

    def fields(model):
        for name, info in model.model_fields.items():
            yield f"{model.__name__}.{name}", info
            sub = info.annotation
            for arg in (getattr(sub, "__args__", None) or (sub,)):
                if isinstance(arg, type) and hasattr(arg, "model_fields"):
                    yield from fields(arg)

    undocumented = [key for model in (RunConfig, TinyBaseConfig, HookConfig) for key, info in fields(model)
                    if not (info.description or "").strip()]
    assert not undocumented


def test_the_run_yaml_and_the_iga_block_share_one_validator(tmp_path):
    """The same rule words for the same mistakes in either file, each naming its dotted key."""
    from iga_ds.config.hook import HookConfig
    from iga_ds.config.run import load_run_config
    from iga_ds.errors import ConfigError

    run = tmp_path / "run.yaml"
    run.write_text("data:\n  domains: [math, math]\n")
    with pytest.raises(ConfigError, match=r"run.yaml: data.domains: names must be unique"):
        load_run_config(run)
    with pytest.raises(ConfigError, match=r"^iga.domains: names must be unique"):
        HookConfig.from_dict({"domains": ["math", "math"]})
    with pytest.raises(ConfigError, match=r"^iga.colour: unknown key; expected one of: method, params, domains"):
        HookConfig.from_dict({"colour": "red"})
    with pytest.raises(ConfigError, match=r"^iga.seed: expected an integer, got True"):
        HookConfig.from_dict({"seed": True})
    with pytest.raises(ConfigError, match=r"^iga: method 'iga' has no parameter 'tua'"):
        HookConfig.from_dict({"method": "iga", "params": {"tua": 1}})
    # the spelling of the rank-r truncation before it was a method of its own names the method
    with pytest.raises(ConfigError, match=r"^iga.params[.:].*iga fixes its projection.*the method iga_svd is"):
        HookConfig.from_dict({"method": "iga", "params": {"projection": "svd"}})
    with pytest.raises(ConfigError, match=r"^iga.params[.:].*damping=0.5: acts only with projection 'tangent'.*the method iga is"):
        HookConfig.from_dict({"method": "iga_svd", "params": {"damping": 0.5}})


def test_method_parameters_shown_in_the_docs_validate():
    """Every `params: {...}` fragment the docs show for the hook's method loads through the real
    config validation and reaches the method as written."""
    import re

    import yaml

    from iga_ds.config.hook import HookConfig

    fragments = [(doc.name, method or "iga", m) for doc in sorted((REPO / "docs").glob("*.md"))
                 for method, m in re.findall(r"`(?:method: (\w+), )?params: (\{[^`]*\})`", doc.read_text(encoding="utf-8"))]
    assert fragments, "no params fragment found in docs/*.md"
    assert any(method != "iga" for _, method, _ in fragments), "no fragment names its method"
    for name, method_name, text in fragments:
        params = yaml.safe_load(text)
        method = HookConfig.from_dict({"method": method_name, "params": params}, name).build_method()
        assert method.name == method_name, (name, text)
        assert all(getattr(method, key) == value for key, value in params.items()), (name, text)
