"""The DeepSpeed JSON of a run: read it, fill in what the run YAML decides, and resolve the
hook's settings from both files.

The batch sizes are counted in isomer groups in the run YAML, so the JSON leaves them
``"auto"``; the optimizer and its schedule come from the run YAML too. ``method`` (with its
``params``) and ``domains`` may be set in either file: in the run YAML as ``method.name``,
``method.params`` and ``data.domains``, in the JSON's ``iga`` block as ``method``, ``params``
and ``domains``. A setting given in both with different values is an error naming both.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from iga_ds.config.hook import BLOCK, HookConfig
from iga_ds.config.run import RunConfig
from iga_ds.errors import ConfigError
from iga_ds.files import atomic_write_json, read_json

# the shipped configs, beside the package in a source checkout
SHIPPED = Path(__file__).resolve().parents[2] / "ds_configs"


def use_cpu() -> bool:
    """Whether DeepSpeed runs on the CPU here: asked for with DS_ACCELERATOR=cpu, or no CUDA."""
    import torch  # a config read for --help must not load torch

    return os.environ.get("DS_ACCELERATOR", "") == "cpu" or not torch.cuda.is_available()


def load_ds_json(path: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise ConfigError(f"deepspeed: config {path!r} not found")
    return read_json(path, objects=True, error=ConfigError)


def resolve_hook_config(run: RunConfig, block: dict[str, Any] | None, source: str = "deepspeed",
                        run_source: str = "the run YAML") -> HookConfig:
    """The hook's settings from the JSON's ``iga`` block and the run YAML's method and domains."""
    block = dict(block or {})
    from_run = {}
    if run.method is not None:
        from_run["method"] = (run.method.name, "method.name")
        if "params" in run.method.model_fields_set:
            from_run["params"] = (dict(run.method.params), "method.params")
    if run.data.domains is not None:
        from_run["domains"] = (list(run.data.domains), "data.domains")
    for key, (value, run_key) in from_run.items():
        if key in block and block[key] != value:
            raise ConfigError(f"{key}: {run_source} sets {run_key}: {value!r} and {source} sets "
                              f"{BLOCK}.{key}: {block[key]!r}; set it in one of them")
        block[key] = value
    where = "method" if run.method is not None else f"{source}: {BLOCK}"
    return HookConfig.from_dict(block, where=where)


def build_ds_config(run: RunConfig, ds_raw: dict[str, Any], world_size: int, accum: int, source: str = "deepspeed",
                    cpu: bool | None = None, run_source: str = "the run YAML") -> tuple[dict[str, Any], HookConfig]:
    """The DeepSpeed dict and the hook's settings for this run: batch sizes from the run YAML's
    data settings, method and domains from whichever file sets them."""
    ds = {k: v for k, v in ds_raw.items() if k != BLOCK}
    hook = resolve_hook_config(run, ds_raw.get(BLOCK), source, run_source)
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ConfigError(
                f"{source}: remove {key!r}; AdamW and its cosine schedule come from the run YAML's schedule"
            )
    micro = run.data.groups_per_micro_batch * hook.num_domains
    want = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,
    }
    for key, value in want.items():
        given = ds.get(key, "auto")
        if given not in ("auto", value):
            raise ConfigError(
                f"{source}: {key} is {given!r} but the run YAML's data settings give {value}; "
                f'set it to "auto" (batches are counted in isomer groups in the run YAML)'
            )
        ds[key] = value
    ds.setdefault("zero_allow_untested_optimizer", True)  # a torch AdamW, built by the trainer
    ds.setdefault("steps_per_print", 10**9)
    zero = ds.setdefault("zero_optimization", {})
    zero.setdefault("elastic_checkpoint", True)  # resume at another world size
    if use_cpu() if cpu is None else cpu:
        for key in ("fp16", "bf16"):
            if ds.get(key, {}).get("enabled"):
                raise ConfigError(f"{source}: {key} is enabled but this run is on the CPU; "
                                  "use ds_configs/zero2_fp32.json")
    return ds, hook


def default_ds_config(out: Path) -> str:
    """The shipped fp32 ZeRO-2 config (CPU or GPU); installed without the repository, the same
    settings written under ``out``. Its ``iga`` block names no method: runs set their own."""
    shipped = SHIPPED / "zero2_fp32.json"
    if shipped.is_file():
        return str(shipped)
    cfg = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                              "elastic_checkpoint": True},
        "zero_allow_untested_optimizer": True,
    }
    path = Path(out) / "zero2_fp32.json"
    atomic_write_json(path, cfg)
    return str(path)
