"""``iga-ds train --dry-run``: resolve a run exactly as the trainer would, and train nothing.

The run YAML with its overrides, every path, the DeepSpeed JSON with its ``iga`` block, the
batch layout at the given world size, and DeepSpeed's own reading of the resolved dict: an
error in any of them is the same one-line error the training run would stop on, before a job
waits in a queue. Inputs that a run needs but that may not exist yet where the dry run is
made (the data, a local model folder) are listed with whether they were found.
"""
from __future__ import annotations

import os
from typing import Any

from iga_ds.config.deepspeed import build_ds_config, load_ds_json
from iga_ds.config.run import BUILTIN_TINY, RunConfig
from iga_ds.data.sources import resolve_source
from iga_ds.errors import ConfigError, DataError, UserError
from iga_ds.models import resolve_model_source
from iga_ds.train.batching import check_batch_layout


def _data_state(spec: str | None) -> str:
    if not spec:
        return "not set"
    try:
        source = resolve_source(spec)  # nothing is read or downloaded
    except DataError:
        return "not found here"
    return "a Hugging Face hub dataset id" if source.kind == "hub" else f"found ({source.kind})"


def _model_state(spec: str) -> str:
    if spec == BUILTIN_TINY:
        return "built in (pretrained on first use, then cached)"
    try:
        return resolve_model_source(spec, "model.name_or_path").describe()  # nothing is downloaded
    except UserError:
        return "not found here"


def resolve_run(cfg: RunConfig, world_size: int = 1, cpu: bool | None = None) -> dict[str, Any]:
    """The resolved run: what config.resolved.yaml would hold, less what needs the model."""
    if world_size < 1:
        raise ConfigError(f"--world-size: expected a positive number of ranks, got {world_size}")
    if cpu is None:  # a dry run on a login node checks the config as written for its cluster
        cpu = os.environ.get("DS_ACCELERATOR", "") == "cpu"
    accum = check_batch_layout(cfg.data.groups_per_step, cfg.data.groups_per_micro_batch, world_size)
    ds_dict, hook = build_ds_config(cfg, load_ds_json(cfg.deepspeed), world_size, accum, cfg.deepspeed, cpu=cpu,
                                    run_source=cfg.source, check_model=False)
    _check_with_deepspeed(ds_dict, cfg.deepspeed)
    return {
        **cfg.to_dict(),
        "resolved": {
            "world_size": world_size,
            "gradient_accumulation_steps": accum,
            "deepspeed_config": ds_dict,
            "iga": hook.to_dict(),
            "inputs": {
                "data.train": f"{cfg.data.train or '-'} ({_data_state(cfg.data.train)})",
                "model.name_or_path": f"{cfg.model.name_or_path} ({_model_state(cfg.model.name_or_path)})",
                "deepspeed": f"{cfg.deepspeed} (found)",
            },
        },
    }


def _check_with_deepspeed(ds_dict: dict[str, Any], source: str) -> None:
    """DeepSpeed's own parser on the resolved dict (batch sizes restated for one rank, which is
    what it sees without a process group)."""
    from deepspeed.runtime.config import DeepSpeedConfig  # heavy: only when a dry run asks

    micro, accum = ds_dict["train_micro_batch_size_per_gpu"], ds_dict["gradient_accumulation_steps"]
    try:
        DeepSpeedConfig({**ds_dict, "train_batch_size": micro * accum})
    except Exception as exc:  # DeepSpeed raises assertion and pydantic errors alike
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{source}: DeepSpeed rejects the resolved config: {first}") from None
