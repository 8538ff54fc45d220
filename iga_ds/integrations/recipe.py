"""An iga-ds run YAML as a Hugging Face (or TRL) Trainer run that trains what ``iga-ds train``
trains: :func:`run_recipe`.

``IGATrainer`` alone runs the Trainer's choices: its optimizer (AdamW in two parameter groups,
biases and norms without weight decay), its schedule (``lr_scheduler_type``, whose warm-up
starts at 0), and the model and data as the user's script builds them. ``run_recipe(config)``
builds from a run YAML what ``iga-ds train`` builds, in the form the trainer takes:

- ``model``: the base as ``iga-ds train`` loads it and the adapters as it adds them, the
  random state seeded with the run's ``seed`` right before, as the trainer seeds it (so the
  same LoRA A); fused LoRA layers where ``model.fused_lora``;
- ``tokenizer`` and ``train_dataset``: the trainer's prompt format and token rows (its
  tokenization, from its cache), in :func:`iga_ds.integrations.hf.isomer_dataset`'s layout,
  the groups in the order the trainer numbers them;
- ``iga``: the hook's settings, the DeepSpeed JSON's ``iga`` block and the run YAML resolved;
- ``deepspeed``: the DeepSpeed dict the trainer hands DeepSpeed (batch sizes, clipping, precision);
- ``schedule``: for ``IGATrainer(schedule=...)``, the trainer's optimizer (one group of every
  trainable parameter) and learning-rate schedule;
- :meth:`RunRecipe.training_arguments`: the rest (batch sizes in sequences, steps, the seed that
  orders the groups, clipping, precision, logging and checkpoint cadence).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from iga_ds.config.deepspeed import build_ds_config, load_ds_json
from iga_ds.config.hook import HookConfig
from iga_ds.config.run import RunConfig, ScheduleConfig, load_run_config
from iga_ds.data.groups import complete_groups
from iga_ds.data.prompts import prompt_format
from iga_ds.errors import ConfigError, DataError
from iga_ds.integrations.hf_data import DOMAIN_IDS, GROUP_INDEX
from iga_ds.train.batching import check_batch_layout, read_records, tokenize_groups, tokenized_cache_root
from iga_ds.train.model import build_lora_model, load_tokenizer, seed_everything
from iga_ds.train.model_card import base_location

__all__ = ["RunRecipe", "run_recipe", "lora_model"]


@dataclass
class RunRecipe:
    """What :func:`run_recipe` builds (see the module docstring)."""

    config: RunConfig
    model: Any
    tokenizer: Any
    train_dataset: Any
    iga: HookConfig
    schedule: ScheduleConfig
    deepspeed: dict[str, Any]
    total_steps: int
    accumulation_steps: int

    def trainer_kwargs(self) -> dict[str, Any]:
        """``IGATrainer(args=..., **recipe.trainer_kwargs())`` (or ``IGASFTTrainer``)."""
        return {"model": self.model, "processing_class": self.tokenizer, "train_dataset": self.train_dataset,
                "iga": self.iga, "schedule": self.schedule}

    def training_arguments(self, output_dir: str, arguments=None, **overrides):
        """``arguments`` (``TrainingArguments``, or TRL's ``SFTConfig``, whose own preparation of
        the rows is then skipped) of this run; ``overrides`` win over every field set here."""
        if arguments is None:
            from transformers import TrainingArguments as arguments
        cfg, s = self.config, self.schedule
        settings = dict(
            output_dir=output_dir, deepspeed=self.deepspeed, seed=cfg.seed, max_steps=self.total_steps,
            per_device_train_batch_size=cfg.data.groups_per_micro_batch * self.iga.num_domains,
            gradient_accumulation_steps=self.accumulation_steps, max_grad_norm=float(s.gradient_clipping),
            learning_rate=float(s.lr), weight_decay=float(s.weight_decay),
            bf16=bool(self.deepspeed.get("bf16", {}).get("enabled", False)), gradient_checkpointing=False,
            logging_steps=cfg.logging.every_steps, report_to="none", remove_unused_columns=False,
            save_strategy="steps" if cfg.checkpoint.every_steps else "no",
            save_steps=cfg.checkpoint.every_steps or 500)
        if s.optimizer == "adamw":  # as the Trainer's own AdamW would take them (schedule= builds it)
            settings.update(adam_beta1=float(s.betas[0]), adam_beta2=float(s.betas[1]), adam_epsilon=float(s.eps))
        fields = {f.name for f in dataclasses.fields(arguments)}
        if "dataset_kwargs" in fields:  # TRL's SFTConfig: the rows come tokenized, with group and domain
            settings.update(dataset_kwargs={"skip_prepare_dataset": True}, packing=False)
        return arguments(**{**settings, **overrides})


def run_recipe(config: RunConfig | str | os.PathLike, base_model_dir: str | None = None,
               world_size: int | None = None) -> RunRecipe:
    """``iga-ds train``'s run of ``config`` (a :class:`RunConfig` or a run YAML's path) for the
    Hugging Face Trainer, at ``world_size`` ranks (default: the launcher's ``WORLD_SIZE``);
    ``base_model_dir`` replaces ``model.name_or_path`` as the trainer's does."""
    cfg = config if isinstance(config, RunConfig) else load_run_config(config)
    if cfg.data.padding_free:
        raise ConfigError("data.padding_free: expected false: IGATrainer pads each sequence in its own row "
                          "(the same losses as the padding-free layout, rounded in another order)")
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    accum = check_batch_layout(cfg.data.groups_per_step, cfg.data.groups_per_micro_batch, world)
    ds, hook = build_ds_config(cfg, load_ds_json(cfg.deepspeed), world, accum, cfg.deepspeed, run_source=cfg.source)
    groups = complete_groups(read_records(cfg.data.train), list(hook.domains), cfg.data.train)
    if not groups:
        raise DataError(f"{cfg.data.train}: no isomer group has all of the domains {list(hook.domains)}")
    steps_per_epoch = len(groups) // cfg.data.groups_per_step
    if steps_per_epoch == 0:
        raise ConfigError(f"data.groups_per_step: {cfg.data.groups_per_step} groups per step but the data has only "
                          f"{len(groups)} complete groups")
    total = cfg.schedule.max_steps or max(1, math.ceil(cfg.schedule.epochs * steps_per_epoch))
    seed_everything(cfg.seed)  # as the trainer: before the tokenizer, the tokens and the model
    base = base_folder(cfg, base_model_dir)
    tokenizer = load_tokenizer(cfg.tokenizer or base)
    rows = token_rows(cfg, tokenizer, groups)
    model = lora_model(cfg, base)
    return RunRecipe(cfg, model, tokenizer, rows, hook, cfg.schedule, ds, total, accum)


def base_folder(cfg: RunConfig, base_model_dir: str | None) -> str:
    """The base model: ``base_model_dir``, else what ``iga-ds train`` loads for ``model.name_or_path``
    (the built-in tiny base pretrained and cached on first use)."""
    return base_model_dir or base_location(cfg.model.name_or_path, cfg.model.tiny, log=lambda *_: None)


def token_rows(cfg: RunConfig, tokenizer, groups: list[list[dict]]):
    """The trainer's token rows of ``groups`` (its prompt format and tokenization, through its
    cache) with the domain and group columns: row ``g * domains + d``, as the trainer numbers them."""
    fmt = prompt_format(tokenizer, cfg.data.prompt_format)
    batches = tokenize_groups(tokenizer, groups, cfg.data.max_length, tokenized_cache_root(),
                              cfg.data.tokenize_processes, fmt)
    n = batches.per_group
    index = range(len(batches.rows))
    return (batches.rows.add_column(DOMAIN_IDS, [i % n for i in index])
            .add_column(GROUP_INDEX, [i // n for i in index]))


def lora_model(cfg: RunConfig, base: str):
    """The LoRA model ``iga-ds train`` trains (:func:`iga_ds.train.model.build_lora_model`; its
    initial A drawn from the random state as it stands: :func:`run_recipe` seeds it first)."""
    return build_lora_model(cfg, base)
