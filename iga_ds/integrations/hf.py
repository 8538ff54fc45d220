"""The Hugging Face ``Trainer`` as an iga-ds run: :class:`IGATrainer` and what it needs.

``IGATrainer`` is a ``transformers.Trainer`` that, under DeepSpeed ZeRO-0/1/2, attaches the engine
hook (:func:`iga_ds.engine.attach`) to the Trainer's own engine on its first step and detaches it
when ``train`` returns. Each micro-batch's forward and backward run inside
``hook.micro_batch(domain_ids)`` (a ``training_step`` override: under DeepSpeed accelerate runs
``engine.step()`` inside ``accelerator.backward``, before any callback could act); the loss is
``hook.objective`` of per-sequence losses, which the Trainer divides by the accumulation steps
(``loss_is_scaled_for_ga = False``), as the hook's capture expects. :class:`GroupStepSampler`
orders the rows so that accelerate's sharding gives each rank, at each step, the slice of whole
isomer groups ``iga-ds train`` gives it; :class:`IsomerCollator` keeps each row's domain. The
Trainer's logs gain ``loss.<domain>`` (every run, ERM included) and ``hook.<statistic>`` (the
method's, averaged over the logging window), and so do its ``report_to`` trackers. Checkpoints
are the Trainer's own; a method with state across steps (IGA's ``variance: ema``) also writes
each rank's share into the checkpoint folder and reads them back on resume. As in ``iga-ds
train``, ``iga.max_skipped_steps`` skipped steps in a row (a non-finite loss or gradient) stop
the run in one line naming the first non-finite quantity. ``schedule=`` (the run YAML's
``schedule:``) replaces the Trainer's optimizer and learning-rate schedule with ``iga-ds
train``'s (:mod:`iga_ds.integrations.recipe` builds the rest of an ``iga-ds train`` run). All of it is
:class:`IGATrainerMixin`, which :class:`IGATrainer` puts before ``Trainer`` and
``iga_ds.integrations.sft.IGASFTTrainer`` before TRL's ``SFTTrainer``.
"""
from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from iga_ds.config.base import validate_section
from iga_ds.config.hook import HookConfig
from iga_ds.config.run import ScheduleConfig
from iga_ds.engine.hook import attach
from iga_ds.engine.internals import GroupStepAdamW
from iga_ds.errors import ConfigError, DataError, UserError
from iga_ds.integrations.hf_data import COLUMNS, DOMAIN_IDS, GROUP_INDEX, isomer_dataset
from iga_ds.train.batching import IGNORE_INDEX, GroupSampler, sequence_losses
from iga_ds.train.checkpoint import read_method_state, save_method_state
from iga_ds.train.divergence import DivergedRun, SkippedSteps
from iga_ds.train.optim import build_optimizer, lr_lambda

__all__ = ["IGATrainer", "IGATrainerMixin", "IsomerCollator", "GroupStepSampler", "isomer_dataset", "hook_config",
           "schedule_config"]


def hook_config(iga: HookConfig | dict | None) -> HookConfig:
    """The method's settings: a :class:`HookConfig`, or the DeepSpeed JSON's ``iga`` block as a dict."""
    if isinstance(iga, HookConfig):
        return iga
    if iga is None:
        raise ConfigError("IGATrainer: iga: expected the method's settings, e.g. "
                          "{'method': 'iga', 'params': {'tau': 0.5}, 'domains': [...]}")
    return HookConfig.from_dict(iga, where="iga")


def schedule_config(schedule: ScheduleConfig | dict | None) -> ScheduleConfig | None:
    """``iga-ds train``'s optimizer and schedule: a :class:`ScheduleConfig`, or the run YAML's
    ``schedule:`` block as a dict; None leaves the Trainer's own."""
    if schedule is None or isinstance(schedule, ScheduleConfig):
        return schedule
    return validate_section(ScheduleConfig, schedule, "schedule")


# -- data -------------------------------------------------------------------------------------


@dataclass
class IsomerCollator:
    """Rows padded into a micro-batch that keeps each row's domain and group, and as ``halves``
    each row's half of the micro-batch's groups (its group's place there, even or odd)."""

    pad_token_id: int
    num_domains: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        for column in COLUMNS:
            if column not in features[0]:
                raise DataError(f"IGATrainer: a training row has no {column!r} column; build the dataset with "
                                "iga_ds.integrations.hf.isomer_dataset and set remove_unused_columns=False")
        groups = [int(f[GROUP_INDEX]) for f in features]
        places = {g: i for i, g in enumerate(dict.fromkeys(groups))}
        width = max(len(f["input_ids"]) for f in features)
        input_ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            input_ids[i, :n] = torch.as_tensor(f["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.as_tensor(f["labels"], dtype=torch.long)
            mask[i, :n] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels,
                DOMAIN_IDS: torch.tensor([int(f[DOMAIN_IDS]) for f in features], dtype=torch.long),
                GROUP_INDEX: torch.tensor(groups, dtype=torch.long),
                "halves": torch.tensor([places[g] % 2 for g in groups], dtype=torch.long)}


def check_whole_groups(group_index: torch.Tensor, num_domains: int) -> None:
    """A training micro-batch holds whole groups (evaluation's batches need not): else one line."""
    groups, counts = torch.unique(group_index, return_counts=True)
    partial = groups[counts != num_domains].tolist()
    if partial:
        raise DataError(f"IGATrainer: a micro-batch holds part of group(s) {partial}; each needs all {num_domains} "
                        "domains (use IGATrainer's sampler and a batch size that is a multiple of the domains)")


def check_isomer_rows(dataset, num_domains: int) -> int:
    """The number of groups of a dataset laid out as :func:`isomer_dataset` lays it out (group by
    group, each in the domains' order); anything else is a one-line error."""
    names = getattr(dataset, "column_names", None) or []
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise DataError(f"IGATrainer: train_dataset has no column(s) {missing}; build it with "
                        "iga_ds.integrations.hf.isomer_dataset(rows, tokenizer, domains, ...)")
    domains, groups = list(dataset[DOMAIN_IDS]), list(dataset[GROUP_INDEX])
    if len(domains) % num_domains:
        raise DataError(f"IGATrainer: train_dataset has {len(domains)} rows, not whole groups of {num_domains}")
    for i, (d, g) in enumerate(zip(domains, groups)):
        if d != i % num_domains or g != i // num_domains:
            raise DataError(f"IGATrainer: train_dataset row {i}: expected group {i // num_domains}, domain "
                            f"{i % num_domains} (rows group by group, in the domains' order), got {g}, {d}")
    return len(domains) // num_domains


class GroupStepSampler(torch.utils.data.Sampler):
    """Row indices of whole groups, ``iga-ds train``'s order: step ``s`` takes
    :class:`iga_ds.train.batching.GroupSampler`'s groups of step ``s``, rank ``r`` its ``r``-th slice,
    micro-batch ``i`` of a rank the ``i``-th part of that slice. Accelerate gives rank ``r`` the
    micro-batches ``r, r + W, ...`` of the order, so micro-batch ``i`` of rank ``r`` is put at
    ``i * W + r``. The incomplete last step of an epoch is dropped."""

    def __init__(self, num_groups: int, num_domains: int, groups_per_micro_batch: int, world_size: int,
                 accumulation_steps: int, seed: int):
        per_step = groups_per_micro_batch * world_size * accumulation_steps
        if num_groups < per_step:
            raise ConfigError(f"IGATrainer: a step takes {per_step} groups (per_device_train_batch_size / domains "
                              f"x world size x gradient_accumulation_steps), but train_dataset has {num_groups}")
        self.num_domains, self.per_micro = num_domains, groups_per_micro_batch
        self.world_size, self.accumulation = world_size, accumulation_steps
        self.groups = GroupSampler(num_groups, per_step, seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.groups.steps_per_epoch * self.groups.groups_per_step * self.num_domains

    def __iter__(self) -> Iterator[int]:
        spe, per_rank = self.groups.steps_per_epoch, self.groups.groups_per_step // self.world_size
        for within in range(spe):
            groups = self.groups.step_groups(self.epoch * spe + within)
            for i in range(self.accumulation):
                for r in range(self.world_size):
                    start = r * per_rank + i * self.per_micro
                    for g in groups[start: start + self.per_micro]:
                        yield from range(g * self.num_domains, (g + 1) * self.num_domains)


# -- what the logs gain ------------------------------------------------------------------------


class DomainLosses:
    """Sums of per-sequence losses and sequence counts per domain since the last log."""

    def __init__(self, domains: list[str]):
        self.domains = domains
        self.sums: torch.Tensor | None = None  # losses then counts, on the loss's device

    def add(self, sequence_losses: torch.Tensor, domain_ids: torch.Tensor) -> None:
        n = len(self.domains)
        if self.sums is None:
            self.sums = torch.zeros(2 * n, dtype=torch.float64, device=sequence_losses.device)
        ids = domain_ids.to(sequence_losses.device)
        self.sums.index_add_(0, ids, sequence_losses.detach().double())
        self.sums.index_add_(0, ids + n, torch.ones_like(ids, dtype=torch.float64))

    def pop(self, reduce, overall: bool = False) -> dict[str, float]:
        """``loss.<domain>``: each domain's mean sequence loss over the window, on every rank
        (``reduce`` sums a tensor over the ranks), and with ``overall`` the mean over all
        sequences as ``loss``; {} where nothing was added."""
        if self.sums is None:
            return {}
        totals, self.sums = reduce(self.sums).cpu(), None
        n = len(self.domains)
        out = {f"loss.{d}": float(totals[i] / totals[n + i]) for i, d in enumerate(self.domains)
               if totals[n + i] > 0}
        if overall:
            out["loss"] = float(totals[:n].sum() / totals[n:].sum().clamp(min=1))
        return out

    def clear(self) -> None:
        self.sums = None


class StepStatistics:
    """The hook's scalar statistics of each optimizer step, averaged over the logging window."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.steps = 0

    def add(self, stats: dict) -> None:
        if not stats:
            return
        self.steps += 1
        for key, value in stats.items():
            if key != "step" and isinstance(value, (int, float, bool)):
                self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def pop(self) -> dict[str, float]:
        out = {f"hook.{k}": v / self.steps for k, v in self.sums.items()} if self.steps else {}
        self.sums, self.steps = {}, 0
        return out


class SkippedStepLimit:
    """``iga.max_skipped_steps`` as ``iga-ds train`` enforces it (:mod:`iga_ds.train.divergence`):
    that many optimizer steps in a row skipped for a non-finite loss or gradient (by the hook or
    by DeepSpeed's own check) stop the run, naming the first non-finite quantity of the row."""

    def __init__(self, config: HookConfig):
        self.limit = config.max_skipped_steps if config.skip_nonfinite else 0
        self.in_a_row = SkippedSteps(0)  # counts and remembers the row's first; the limit is checked here
        self.step_losses = DomainLosses(list(config.domains))  # this step's, read where it was skipped

    def observe(self, step: int, skipped: bool, reduce, grad_norm) -> None:
        """After optimizer step ``step`` (1-based); every rank skips a step together, so the sums
        over ranks (``reduce``) of a skipped step's losses are a collective each rank reaches."""
        record: dict = {"step": step, "hook.skipped": skipped}
        if skipped:
            record.update(self.step_losses.pop(reduce, overall=True), grad_norm=grad_norm)
        self.step_losses.clear()
        self.in_a_row.observe(record)
        if self.limit and self.in_a_row.in_a_row >= self.limit:
            first, what = self.in_a_row.first
            raise DivergedRun(f"IGATrainer: step {step}: {self.in_a_row.in_a_row} optimizer steps in a row skipped "
                              f"for a non-finite loss or gradient, the first at step {first} ({what}); the run has "
                              "diverged: lower the learning rate or look at the data (iga.max_skipped_steps sets "
                              "the limit)")


class PlainObjective:
    """The hook's per-micro-batch interface without DeepSpeed, for the methods that need none:
    loss-level ones (ERM, IRM, V-REx), whose objective is all they do."""

    def __init__(self, config: HookConfig):
        self.method = config.build_method()
        if self.method.scope != "loss":
            raise ConfigError(f"IGATrainer: method {config.method!r} combines per-domain gradients and needs "
                              "DeepSpeed ZeRO-0/1/2: set TrainingArguments.deepspeed")
        self.num_domains, self.domain_halves, self.device = config.num_domains, False, None

    @contextlib.contextmanager
    def micro_batch(self, domain_ids, halves=None):
        yield self

    def dummy_scale(self):
        return torch.ones((), requires_grad=True) if self.method.needs_dummy_scale() else None

    def objective(self, sequence_losses, domain_ids, dummy_scale=None):
        return self.method.objective(sequence_losses, domain_ids.to(sequence_losses.device), self.num_domains,
                                     dummy_scale)

    def pop_stats(self) -> dict:
        return {}

    def detach(self) -> None:
        pass


class MethodStateCallback(TrainerCallback):
    """Each rank's share of the method's state into the checkpoint folder the Trainer just saved
    (``method_state_rank<R>.safetensors``, as ``iga-ds train`` writes it)."""

    def __init__(self, trainer: "IGATrainerMixin"):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        hook = self.trainer.iga_hook
        if hook is not None and not isinstance(hook, PlainObjective):
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            save_method_state(folder, args.process_index, hook.method_state())
        return control


# -- the trainer -------------------------------------------------------------------------------


class IGATrainerMixin:
    """What makes a ``transformers.Trainer`` (or a subclass: TRL's ``SFTTrainer``) run an iga-ds
    run of ``iga``'s method (see the module docstring); put it first among the bases."""

    def __init__(self, *args, iga: HookConfig | dict | None = None, schedule: ScheduleConfig | dict | None = None,
                 **kwargs):
        if importlib.util.find_spec("accelerate") is None:  # the Trainer's own engine
            raise UserError("IGATrainer needs accelerate: pip install 'iga-ds[hf]'")
        self.iga_config = hook_config(iga)
        self.iga_schedule = schedule_config(schedule)
        super().__init__(*args, **kwargs)
        n = self.iga_config.num_domains
        check_clipping(self.iga_schedule, self.args.max_grad_norm)
        if self.args.remove_unused_columns:
            raise ConfigError("TrainingArguments.remove_unused_columns: expected False (IGATrainer needs the "
                              f"{DOMAIN_IDS!r} and {GROUP_INDEX!r} columns in every batch)")
        if self.args.per_device_train_batch_size % n:
            raise ConfigError(f"TrainingArguments.per_device_train_batch_size: expected whole isomer groups, a "
                              f"multiple of the {n} domains, got {self.args.per_device_train_batch_size}")
        if not self.is_deepspeed_enabled:
            PlainObjective(self.iga_config)  # a method that needs DeepSpeed is refused here, not at step 1
        if kwargs.get("data_collator") is None:
            self.data_collator = IsomerCollator(pad_token_id(self.processing_class), n)
        # a mean over sequences, which the Trainer is to divide by the accumulation steps (both flags:
        # transformers 5 reads the first, earlier releases the second)
        self.loss_is_scaled_for_ga = False
        self.model_accepts_loss_kwargs = False
        self.iga_hook = None
        self.resume_dir: Path | None = None
        self.domain_losses = DomainLosses(list(self.iga_config.domains))
        self.step_statistics = StepStatistics()
        self.skip_limit = SkippedStepLimit(self.iga_config)
        self.add_callback(MethodStateCallback(self))

    # -- data ---------------------------------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        n = self.iga_config.num_domains
        num_groups = check_isomer_rows(dataset, n)
        per_micro = self.args.per_device_train_batch_size // n
        return GroupStepSampler(num_groups, n, per_micro, self.args.world_size,
                                self.args.gradient_accumulation_steps, self.args.seed)

    def create_optimizer(self, *args, **kwargs):
        """The Trainer's optimizer; its torch AdamW as one that also keeps its step count where
        DeepSpeed's elastic ZeRO checkpoint (the shipped JSONs' ``elastic_checkpoint``) saves and
        restores it, else a resume from the Trainer's checkpoint fails in DeepSpeed's load. With
        ``schedule``: ``iga-ds train``'s, one group of every trainable parameter."""
        if self.iga_schedule is not None:
            if self.optimizer is None:
                model = (args[0] if args else kwargs.get("model")) or self.model
                self.optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], self.iga_schedule)
            return self.optimizer
        optimizer = super().create_optimizer(*args, **kwargs)
        if type(optimizer) is torch.optim.AdamW:
            keep = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused")
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
            self.optimizer = GroupStepAdamW(groups, **{k: v for k, v in optimizer.defaults.items() if k in keep})
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's schedule; with ``schedule``: ``iga-ds train``'s (linear warm-up from
        ``lr / warm-up steps``, cosine decay to ``lr x min_lr_ratio``) over the Trainer's steps."""
        if self.iga_schedule is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            s = self.iga_schedule
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer if optimizer is not None else self.optimizer,
                lr_lambda(num_training_steps, s.warmup_ratio, s.min_lr_ratio))
            self._created_lr_scheduler = True  # the Trainer makes it anew at its next train()
        return self.lr_scheduler

    # -- the run ------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """The Trainer's ``train``; the hook attaches at the first step and is detached at the end."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ConfigError(f"resume_from_checkpoint: no checkpoint in {self.args.output_dir}")
        self.resume_dir = Path(resume_from_checkpoint) if resume_from_checkpoint else None
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            if self.iga_hook is not None:
                self.iga_hook.detach()
                self.iga_hook = None

    def attach_hook(self):
        """The hook on the Trainer's DeepSpeed engine (it exists only once ``train`` has prepared
        it), with the method's state of the checkpoint resumed from; without DeepSpeed, the
        loss-level methods' objective."""
        if self.iga_hook is not None:
            return self.iga_hook
        if not self.is_deepspeed_enabled:
            self.iga_hook = PlainObjective(self.iga_config)
            return self.iga_hook
        hook = attach(self.accelerator.deepspeed_engine_wrapped.engine, self.iga_config)
        try:
            if hook.domain_halves and (self.args.per_device_train_batch_size // hook.num_domains) % 2:
                raise ConfigError(f"TrainingArguments.per_device_train_batch_size: method {hook.method.name!r} "
                                  "(variance: debiased) splits each micro-batch's groups in two halves; expected "
                                  "an even number of groups a micro-batch")
            if self.resume_dir is not None:
                hook.load_method_state(read_method_state(self.resume_dir))
        except BaseException:
            hook.detach()
            raise
        self.iga_hook = hook
        return hook

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step (forward, backward, and at the boundary DeepSpeed's step) inside
        the hook's micro-batch; the hook's statistics are kept for the next log."""
        hook = self.attach_hook()
        check_whole_groups(inputs[GROUP_INDEX].cpu(), self.iga_config.num_domains)
        domain_ids = inputs[DOMAIN_IDS].cpu()  # the hook reads them on the host
        halves = inputs["halves"].cpu() if hook.domain_halves else None
        engine = getattr(hook, "engine", None)  # None without DeepSpeed: nothing is skipped there
        skipped_before = engine.skipped_steps if engine is not None else 0
        with hook.micro_batch(domain_ids, halves=halves):
            loss = super().training_step(model, inputs, num_items_in_batch)
        stats = hook.pop_stats()
        if stats:  # the step's boundary ran inside this micro-batch's backward
            self.step_ended(stats, engine, skipped_before)
        return loss

    def step_ended(self, stats: dict, engine, skipped_before: int) -> None:
        """The hook's statistics kept for the next log; a skipped step (the hook's verdict, or
        DeepSpeed's own check) counted toward ``iga.max_skipped_steps``."""
        self.step_statistics.add(stats)
        skipped = bool(stats.get("skipped")) or engine.skipped_steps > skipped_before
        norm = engine.get_global_grad_norm()
        self.skip_limit.observe(self.state.global_step + 1, skipped, self.sum_over_ranks,
                                float(norm) if norm is not None else None)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The method's objective of per-sequence losses (mean token cross-entropy of each
        sequence's completion); in evaluation their plain mean."""
        inputs = dict(inputs)
        domain_ids, labels = inputs.pop(DOMAIN_IDS), inputs.pop("labels")
        inputs.pop("halves", None)
        inputs.pop(GROUP_INDEX, None)
        hook = self.iga_hook if model.training else None
        scale = hook.dummy_scale() if hook is not None else None
        outputs = model(**inputs, use_cache=False)
        logits = outputs.logits if scale is None else outputs.logits * scale
        losses = sequence_losses(logits, labels)
        if hook is None:
            loss = losses.mean()
        else:
            self.domain_losses.add(losses, domain_ids)
            self.skip_limit.step_losses.add(losses, domain_ids)
            loss = hook.objective(losses, domain_ids, scale)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """A training log (it has ``loss``) gains ``loss.<domain>`` and ``hook.<statistic>``."""
        if "loss" in logs:
            logs = {**logs, **self.domain_losses.pop(self.sum_over_ranks), **self.step_statistics.pop()}
        super().log(logs, start_time)

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Through the Trainer's accelerator: every rank logs at the same steps."""
        if self.args.world_size > 1:
            return self.accelerator.reduce(tensor, reduction="sum")
        return tensor


class IGATrainer(IGATrainerMixin, Trainer):
    """A ``transformers.Trainer`` whose run is an iga-ds run of ``iga``'s method; ``train_dataset``
    comes from :func:`isomer_dataset`, ``per_device_train_batch_size`` is whole groups (a multiple
    of the domains)."""


def check_clipping(schedule: ScheduleConfig | None, max_grad_norm: float | None) -> None:
    """With ``schedule``, the Trainer's clipping is ``iga-ds train``'s (under DeepSpeed the
    Trainer hands ``max_grad_norm`` to the engine as its ``gradient_clipping``)."""
    if schedule is not None and float(max_grad_norm or 0.0) != float(schedule.gradient_clipping):
        raise ConfigError(f"TrainingArguments.max_grad_norm: expected {schedule.gradient_clipping} (the schedule's "
                          f"gradient_clipping, as iga-ds train clips), got {max_grad_norm}")


def pad_token_id(tokenizer) -> int:
    """The tokenizer's padding id (its end-of-sequence id where it has none; 0 without a tokenizer)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0

