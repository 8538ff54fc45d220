"""Optimizer state that does not depend on the world size (for resuming at another size).

DeepSpeed refuses to load ZeRO optimizer partitions saved at a different world size. Each
checkpoint therefore also keeps every LoRA parameter's full Adam moments, gathered with
``deepspeed.utils.safe_get_full_optimizer_state``; on a size change they are written back
into the new partitions. The write needs DeepSpeed's private link between parameters and
optimizer-state slices, which is why this lives in the one package that touches internals.
"""
from __future__ import annotations

import os
from pathlib import Path

from iga_ds.errors import ConfigError

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _trainable(engine):
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def save_full_optimizer_state(engine, file: Path, rank: int) -> None:
    """Gather every LoRA parameter's Adam moments to full size (collective); rank 0 writes."""
    from deepspeed.utils import safe_get_full_optimizer_state
    from safetensors.torch import save_file

    tensors = {}
    for name, param in _trainable(engine):
        for key in ADAM_MOMENTS:
            full = safe_get_full_optimizer_state(param, key)
            if full is None:
                return  # not a ZeRO-partitioned optimizer: its own checkpoint suffices
            if rank == 0:
                tensors[f"{name}/{key}"] = full.detach().float().cpu().contiguous()
    if rank == 0:
        groups = engine.optimizer.param_groups
        tmp = file.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"adam_step": str(int(groups[0].get("step", 0)))})
        os.replace(tmp, file)


def load_full_optimizer_state(engine, file: Path) -> None:
    """Set the Adam moments and step of ``file`` into this run's ZeRO partitions."""
    import torch
    from deepspeed.utils import safe_set_full_optimizer_state
    from safetensors import safe_open

    if not file.is_file():
        raise ConfigError(f"resume: {file} is missing; this checkpoint cannot change the world size")
    zero = engine.optimizer
    opt = zero.optimizer  # the torch AdamW over this rank's flat fp32 partitions
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
    if link is None:
        raise ConfigError("resume: this DeepSpeed version cannot change the world size on resume (ZeRO-1/2 only)")
    with safe_open(str(file), framework="pt") as f:
        step = int(f.metadata()["adam_step"])
        # A fresh engine has no Adam state yet (torch creates it at the first step) and
        # DeepSpeed links each parameter to its slice of that state only then: create the
        # state the way AdamW would, link, then write the gathered moments into the slices.
        for group in opt.param_groups:
            group["step"] = step
            for flat in group["params"]:
                opt.state[flat] = {
                    "step": torch.tensor(float(step), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format),
                }
        link()
        for name, param in _trainable(engine):
            for key in ADAM_MOMENTS:
                safe_set_full_optimizer_state(param, f.get_tensor(f"{name}/{key}").to(param.device), key)
