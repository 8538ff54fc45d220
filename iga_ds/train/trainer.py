"""The training loop: a PEFT LoRA model in a DeepSpeed ZeRO engine, driven through the engine hook.

One loop serves one process (CPU or one GPU) and any launcher that sets the usual rank
variables. It reads as the script it is::

    session = trainer.setup()          # ranks, data, model, engine, hook, resume
    while step < total_steps:
        record = trainer.train_step(session, step)     # micro-batches of whole isomer groups
        logbook.write(record)                          # rank 0: metrics.jsonl, TensorBoard, bar
        stopping = trainer.checkpoint_if_due(session, step)

and each micro-batch of a step is::

    with hook.micro_batch(domain_ids):
        scale = hook.dummy_scale()         # IRM's dummy classifier scale; None for every other method
        logits = engine(...).logits
        if scale is not None:
            logits = logits * scale
        engine.backward(hook.objective(sequence_losses, domain_ids, scale))
    engine.step()

A run holds a lock on its output folder (:mod:`iga_ds.train.lock`); a resume checks the
checkpoint it resumes (:mod:`iga_ds.train.checkpoint`); too many skipped steps in a row, or a
non-finite adapter, stop it in one line (:mod:`iga_ds.train.divergence`).

With ``data.padding_free`` a micro-batch is one row of its sequences back to back, and the hook
also gets their lengths: ``hook.micro_batch(domain_ids, sequence_lengths)``.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from iga_ds.cluster.liveness import PeerWatch
from iga_ds.cluster.ranks import DistEnv
from iga_ds.config.deepspeed import build_ds_config, load_ds_json
from iga_ds.config.hook import HookConfig
from iga_ds.config.run import BUILTIN_TINY, RUN_CONFIG, RunConfig, TinyBaseConfig
from iga_ds.data.groups import complete_groups
from iga_ds.data.prompts import CHAT, PromptFormat, prompt_format, save_prompt_format
from iga_ds.engine.hook import EngineHook, attach
from iga_ds.errors import ConfigError, DataError, UserError
from iga_ds.files import atomic_write_text, check_output_dir, follow_umask
from iga_ds.train.attention import VARLEN_ATTENTION, require_varlen_attention
from iga_ds.train.batching import (
    PLAIN_FORMAT,
    GroupSampler,
    TokenizedGroups,
    check_batch_layout,
    read_records,
    tokenize_groups,
    tokenized_cache_root,
    unknown_words,
)
from iga_ds.train.checkpoint import (STOP_FILE, SetupInterrupted, StopSignal, adopt_schedule, check_checkpoint_files,
                                    check_run_identity, check_schedule, load_checkpoint, lock_output_dir,
                                    read_checkpoint_meta, read_method_state, resolve_resume, save_checkpoint,
                                    write_failure)
from iga_ds.train.divergence import SkippedSteps, check_finite_weights
from iga_ds.train.distributed import init_distributed, resolve_dist
from iga_ds.train.logbook import METRICS_FILE, Logbook, truncate_metrics
from iga_ds.train.trackers import require_trackers
from iga_ds.train.model import (allow_cudnn_attention, build_lora_model, load_tokenizer, require_liger_kernel,
                                seed_everything)
from iga_ds.train.model_card import make_portable
from iga_ds.train.optim import build_optimizer, lr_lambda
from iga_ds.train.pretrain import default_tiny_base
from iga_ds.train.profiling import StepProfiler
from iga_ds.train.update_norms import UpdateNorms

log = logging.getLogger("iga_ds.train")


@dataclass
class TrainResult:
    status: str  # "completed" or "stopped" (a signal or the stop file asked to stop; a checkpoint was saved)
    step: int
    total_steps: int
    output_dir: Path
    adapter_dir: Path | None
    wall_seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Session:
    """Everything :meth:`Trainer.setup` builds for the loop."""

    dist: DistEnv
    engine: Any
    hook: EngineHook
    hook_config: HookConfig
    tokenizer: Any
    batches: TokenizedGroups  # every instance of the training groups, tokenized once
    sampler: GroupSampler
    total_steps: int
    start_step: int
    out: Path
    stop: StopSignal
    updates: UpdateNorms  # how far each LoRA module moved (update_norms.json)
    prompt_format: PromptFormat = PLAIN_FORMAT  # how records became the token rows; recorded with the adapter

    @property
    def domains(self) -> list[str]:
        return list(self.hook_config.domains)


@dataclass
class StepTotals:
    """What one optimizer step saw, summed over micro-batches (and then over ranks)."""

    loss_sums: torch.Tensor  # per domain, float64, on the engine's device until the step ends
    sequences: torch.Tensor  # per domain, float64, on the host
    tokens: float = 0.0
    target_tokens: float = 0.0

    def all_reduce(self, device) -> None:
        """Sum over ranks: one collective for all of it (NCCL reduces no host tensors)."""
        n = len(self.sequences)
        packed = torch.cat([self.loss_sums.to(device), self.sequences.to(device),
                            torch.tensor([self.tokens, self.target_tokens], dtype=torch.float64, device=device)])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(packed)
        packed = packed.cpu()
        self.loss_sums, self.sequences = packed[:n], packed[n:2 * n]
        self.tokens, self.target_tokens = float(packed[-2]), float(packed[-1])


class Trainer:
    """Build everything from a RunConfig, then ``run()``; see the module docstring."""

    def __init__(self, config: RunConfig, base_model_dir: str | None = None, local_rank: int | None = None,
                 on_step_end: Callable[[int, dict[str, Any]], None] | None = None, quiet: bool = False):
        self.cfg = config
        self.base_model_dir = base_model_dir
        self.local_rank = local_rank
        self.on_step_end = on_step_end
        self.quiet = quiet

    def run(self) -> TrainResult:
        t_start = time.perf_counter()
        # a stop signal during setup ends the run at once, in one line (the default action was a
        # silent death); once training runs, it asks for a checkpoint at the next step boundary
        stop = StopSignal(Path(self.cfg.output_dir) / STOP_FILE).install(setup_phase="starting")
        try:
            s = self.setup(stop)
            stop.training()
            return self._train(s, t_start)
        except SetupInterrupted as interrupted:
            raise interrupted.as_error() from None
        finally:
            stop.uninstall()
            self._release_lock()  # also on an error or an interrupt: the folder is free again

    def _train(self, s: Session, t_start: float) -> TrainResult:
        """The loop over steps, then the final adapter."""
        book = Logbook(s.out, self.cfg.logging, s.start_step, s.total_steps, f"train {s.hook_config.method}",
                       active=s.dist.rank == 0, quiet=self.quiet)
        history: list[dict[str, Any]] = []
        status, step = "completed", s.start_step
        profiler = StepProfiler(s.out, self.cfg.logging.profile_steps, self.cfg.logging.profile_after, s.engine.device,
                                active=s.dist.rank == 0, log=self._print, start_step=step, total_steps=s.total_steps)
        skipped = SkippedSteps(s.hook_config.max_skipped_steps if s.hook_config.skip_nonfinite else 0)
        # fp16's loss scaler skips steps while it finds its scale: those are no divergence
        deepspeed_skips_count = not s.engine.fp16_enabled()
        try:
            s.engine.train()
            last_end = time.perf_counter()
            while step < s.total_steps:
                skipped_before = s.engine.skipped_steps  # the hook's skips and DeepSpeed's own
                with profiler.step(step):  # logging.profile_steps: torch.profiler over a window of steps
                    record = self.train_step(s, step)
                # end to end, as a trainer's callbacks see a step: the last step's logging and
                # checkpoint check included (step_time_s is the step's own work)
                end = time.perf_counter()
                record["step_interval_s"], last_end = end - last_end, end
                step += 1
                history.append(record)
                book.write(record)
                if self.on_step_end is not None:
                    self.on_step_end(step, record)
                # a diverged run stops here, its last checkpoint as it was
                skipped.observe(record, deepspeed_skips_count and s.engine.skipped_steps > skipped_before)
                if self.checkpoint_if_due(s, step) and step < s.total_steps:
                    status = "stopped"
                    break
            profiler.finish()  # the run ended inside the window: the steps it profiled
        except Exception as exc:
            self.peers.raise_if_lost(exc)  # a collective failed: name the rank that is gone, if one is
            raise
        finally:
            profiler.close()
            book.close()
            s.hook.detach()
        adapter_dir = self.finish(s, status)
        self.peers.stop()
        return TrainResult(status, step, s.total_steps, s.out, adapter_dir, time.perf_counter() - t_start, history)

    # -- setup -------------------------------------------------------------------------------------

    def setup(self, stop: StopSignal | None = None) -> Session:
        """Everything the loop needs; ``stop`` (installed for setup, see :meth:`run`) is told what
        setup is doing, for the line a stop signal ends it with."""
        cfg = self.cfg
        stop = stop or StopSignal(Path(cfg.output_dir) / STOP_FILE)
        stop.phase = "starting the process group"
        self.dist = dist = resolve_dist(self.local_rank)
        init_distributed(dist)
        if not os.environ.get("IGA_DS_VERBOSE"):
            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self._check_requirements()
        accum = check_batch_layout(cfg.data.groups_per_step, cfg.data.groups_per_micro_batch, dist.world_size)
        ds_dict, hook_config = build_ds_config(cfg, load_ds_json(cfg.deepspeed), dist.world_size, accum,
                                               cfg.deepspeed, run_source=cfg.source, check_model=True)
        self.peers = PeerWatch(dist, hook_config.timeout_s).start()  # a lost rank gets a name, not a hang
        stop.phase = "reading the data"
        records, groups = self._load_groups(list(hook_config.domains))
        sampler = GroupSampler(len(groups), cfg.data.groups_per_step, cfg.seed)
        total_steps = cfg.schedule.max_steps or max(1, math.ceil(cfg.schedule.epochs * sampler.steps_per_epoch))
        seed_everything(cfg.seed)
        stop.phase = "loading the model"
        base_dir = self._resolve_base(records)
        tokenizer, fmt = self._load_tokenizer(base_dir, records)
        batches = self._tokenize(tokenizer, groups, fmt)
        engine, counts = self._build_engine(base_dir, ds_dict, total_steps)
        hook = attach(engine, hook_config)
        try:  # a refused resume leaves no hook behind: its wrapped step, its frozen garbage collector
            check_halves(hook, cfg.data.groups_per_step)
            updates = UpdateNorms(engine.module)
            out = Path(cfg.output_dir)
            self._lock_output(out)  # before the resume reads what another run could be writing
            stop.phase = "looking for a checkpoint to resume"
            start_step = self._resume(engine, hook, out, updates, total_steps)
            stop.phase = "preparing the output folder"
            if dist.rank == 0:
                self._prepare_output(out, stop, start_step, {
                    "base_model_dir": str(base_dir), "world_size": dist.world_size, "total_steps": total_steps,
                    "trainable_parameters": counts[0], "total_parameters": counts[1], "prompt_format": fmt.name,
                    "train_records": len(records), "train_groups": len(groups),
                    "deepspeed_config": ds_dict, "iga": hook_config.to_dict()})
        except BaseException:
            hook.detach()
            self._release_lock()
            raise
        self._print(f"training LoRA r={cfg.lora.r}: {counts[0]:,} trainable of {counts[1]:,} parameters; "
                    f"method {hook_config.method}; {len(groups)} groups, {total_steps} steps, "
                    f"world size {dist.world_size}")
        return Session(dist, engine, hook, hook_config, tokenizer, batches, sampler, total_steps, start_step, out, stop,
                       updates, fmt)

    def _check_requirements(self) -> None:
        """What the run needs that no file can give, before anything loads."""
        cfg = self.cfg
        check_output_dir(cfg.output_dir, "output_dir")
        require_trackers(cfg.logging)
        if cfg.model.liger_kernel:
            require_liger_kernel()
        if cfg.model.attn_implementation == VARLEN_ATTENTION:
            require_varlen_attention()

    def _load_groups(self, domains: list[str]) -> tuple[list[dict], list[list[dict]]]:
        train = self.cfg.data.train
        if not train:
            raise ConfigError("data.train: expected an isomer set (a JSON Lines, Parquet or Arrow file, a saved "
                              "dataset folder or a hub id)")
        records = read_records(train)
        groups = complete_groups(records, domains, train)
        if not groups:
            raise DataError(f"{train}: no isomer group has all of the domains {domains}")
        dropped = len({str(r['group_id']) for r in records}) - len(groups)
        if dropped:
            self._print(f"note: {dropped} groups lack one of the domains {domains} and are skipped")
        return records, groups

    def _resolve_base(self, records: list[dict]) -> str:
        """The base model folder: a local directory, or the built-in tiny base (built once per node)."""
        if self.base_model_dir:
            return self.base_model_dir
        path = self.cfg.model.name_or_path
        if path != BUILTIN_TINY:
            return path
        shape = TinyBaseConfig(**self.cfg.model.tiny) if self.cfg.model.tiny else None

        def build() -> str:
            show = self.dist.rank == 0 and not self.quiet and self.cfg.logging.progress
            return str(default_tiny_base(shape, progress=show, log=self._print))

        return self._local_rank_zero_first(build)

    def _local_rank_zero_first(self, build):
        """Run ``build`` on each node's local rank 0 first, then on the other ranks (a cache hit
        there): one pretraining per node instead of one per rank racing for the same folder."""
        tdist = torch.distributed
        if not (tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1):
            return build()
        first = self.dist.local_rank == 0
        try:
            result = build() if first else None
        finally:
            tdist.barrier()  # also when local rank 0 failed, so that the others do not hang here
        return result if first else build()

    def _tokenize(self, tokenizer, groups: list[list[dict]], fmt: PromptFormat = PLAIN_FORMAT) -> TokenizedGroups:
        """Every training instance tokenized once by ``Dataset.map`` into the ``datasets`` cache,
        on each node's local rank 0 first; the other ranks then load that result."""
        root = tokenized_cache_root()

        def build() -> TokenizedGroups:
            return tokenize_groups(tokenizer, groups, self.cfg.data.max_length, root, self.cfg.data.tokenize_processes,
                                   fmt)

        batches = self._local_rank_zero_first(build)
        if batches.built:
            self._print(f"tokenized {len(batches.rows)} instances once (Dataset.map, "
                        f"{self.cfg.data.tokenize_processes} process(es)); cached in {batches.path}")
        else:
            self._print(f"tokens of {len(batches.rows)} instances read from the cache {batches.path}")
        return batches

    def _load_tokenizer(self, base_dir: str, records: list[dict]) -> tuple[Any, PromptFormat]:
        """The tokenizer, and the prompt format for it (``data.prompt_format``)."""
        name = self.cfg.tokenizer or base_dir
        tokenizer = load_tokenizer(name)
        fmt = prompt_format(tokenizer, self.cfg.data.prompt_format)
        if fmt.name == CHAT:
            self._print("prompts: the tokenizer's chat template (problem as the user turn, loss on the assistant "
                        "turn only)")
        unk_rate, unk_examples = unknown_words(tokenizer, records, prompt_format=fmt)
        if unk_rate > 0.001:
            self._print(f"warning: {unk_rate:.1%} of the training tokens are unknown to the tokenizer of {name} "
                        f"(e.g. {', '.join(map(repr, unk_examples))}); the model cannot tell those words apart")
        return tokenizer, fmt

    def _build_engine(self, base_dir: str, ds_dict: dict, total_steps: int):
        """The LoRA model in a DeepSpeed engine, with the run YAML's optimizer and schedule; also
        (trainable, total) parameter counts."""
        cfg, s = self.cfg, self.cfg.schedule
        allow_cudnn_attention(cfg.model.cudnn_attention)
        model = build_lora_model(cfg, base_dir, note=self._print)
        trainable = [p for p in model.parameters() if p.requires_grad]
        counts = (sum(p.numel() for p in trainable), sum(p.numel() for p in model.parameters()))
        optimizer = build_optimizer(trainable, s)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, s.warmup_ratio, s.min_lr_ratio))
        import deepspeed  # only after init_distributed has chosen the accelerator (DS_ACCELERATOR)

        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_dict, dist_init_required=False)
        return engine, counts

    def _lock_output(self, out: Path) -> None:
        """One run per output folder: rank 0 holds its lock, and every rank stops when another run does."""
        self.lock = lock_output_dir(out, self.dist.rank)

    def _release_lock(self) -> None:
        lock = getattr(self, "lock", None)
        if lock is not None:
            lock.release()
            self.lock = None

    def _resume(self, engine, hook: EngineHook, out: Path, updates: UpdateNorms, total_steps: int) -> int:
        resume_from = resolve_resume(self.cfg.resume, out / "checkpoints", note=self._print)
        if resume_from is None:
            if self.cfg.resume in ("auto", "previous-good") and (out / RUN_CONFIG).is_file():
                self._print(f"no checkpoint in {out / 'checkpoints'} to resume; starting at step 0")
            return 0
        check_checkpoint_files(resume_from)  # a truncated or corrupt file: one line naming it
        allowed = check_run_identity(resume_from, read_checkpoint_meta(resume_from).get("run"), self._identity(hook),
                                     self.cfg.checkpoint.allow_changes)
        if allowed:
            self._print(f"resuming {resume_from} with changed settings (checkpoint.allow_changes): "
                        f"{', '.join(allowed)}")
        client = load_checkpoint(engine, resume_from, self.dist.rank)
        try:  # a state the method does not take (another method or variance than the run saved)
            hook.load_method_state(read_method_state(resume_from))
        except ValueError as exc:
            raise ConfigError(f"resume: {resume_from}: {exc}") from None
        start_step = int(client.get("step", 0))
        changes = check_schedule(resume_from, client.get("schedule"), self._schedule(total_steps),
                                 self.cfg.checkpoint.allow_schedule_change)
        if changes:
            s = self.cfg.schedule
            adopt_schedule(engine, s.lr, s.betas, s.eps, s.weight_decay)
        updates.load_state(client.get("update_path"))
        self._print(f"resumed from {resume_from} at step {start_step}"
                    + (f", continuing under the new schedule: {', '.join(changes)}" if changes else ""))
        return start_step

    def _identity(self, hook: EngineHook) -> dict[str, Any]:
        """The resolved settings that define the run (config.run.RUN_IDENTITY): each checkpoint
        records them and a resume compares them."""
        cfg = self.cfg
        return {"method.name": hook.config.method, "method.params": dict(hook.config.params),
                "data.domains": list(hook.config.domains), "data.train": cfg.data.train,
                **{f"lora.{key}": value for key, value in cfg.lora.to_dict().items()},
                "model.name_or_path": self.base_model_dir or cfg.model.name_or_path, "model.tiny": cfg.model.tiny,
                "model.dtype": cfg.model.dtype, "schedule.optimizer": cfg.schedule.optimizer}

    def _schedule(self, total_steps: int) -> dict[str, Any]:
        """The settings a run's steps follow, saved with each checkpoint; a resume compares them.
        The seed orders the groups the remaining steps take."""
        schedule = self.cfg.schedule.to_dict()
        if schedule["max_steps"] is not None:
            del schedule["epochs"]  # max_steps wins over it
        return {**{f"schedule.{key}": value for key, value in schedule.items()},
                "data.groups_per_step": self.cfg.data.groups_per_step, "total_steps": total_steps,
                "seed": self.cfg.seed}

    def _prepare_output(self, out: Path, stop: StopSignal, start_step: int, resolved: dict[str, Any]) -> None:
        """Rank 0, before step 1 (whose collectives no other rank passes without it): a stale stop
        request removed, the resolved config written, metric lines past the resumed step dropped."""
        out.mkdir(parents=True, exist_ok=True)
        if stop.discard_stale():
            self._print(f"removed {out / STOP_FILE}, a stop request left by an earlier run")
        atomic_write_text(out / RUN_CONFIG,
                          yaml.safe_dump({**self.cfg.to_dict(), "resolved": resolved}, sort_keys=False))
        truncate_metrics(out / METRICS_FILE, start_step)

    # -- one step ----------------------------------------------------------------------------------

    def train_step(self, s: Session, step: int) -> dict[str, Any]:
        """One optimizer step: this rank's micro-batches of the step's groups; returns its record."""
        t0 = time.perf_counter()
        engine, hook, domains = s.engine, s.hook, s.domains
        mine = s.sampler.rank_groups(step, s.dist.rank, s.dist.world_size)
        # a method comparing two halves of each domain's groups: each group's half of the step
        halves = s.sampler.rank_halves(s.dist.rank, s.dist.world_size) if hook.domain_halves else None
        per_micro = self.cfg.data.groups_per_micro_batch
        # per-domain loss sums stay on the device until the step ends: reading them per
        # micro-batch would stall the launch queue
        totals = StepTotals(torch.zeros(len(domains), dtype=torch.float64, device=engine.device),
                            torch.zeros(len(domains), dtype=torch.float64))
        lr = engine.get_lr()[0]
        s.updates.begin_step()
        for i in range(0, len(mine), per_micro):
            mb = s.batches.micro_batch(mine[i: i + per_micro], self.cfg.data.padding_free,
                                       halves[i: i + per_micro] if halves is not None else None)
            # the hook reads domain ids (and a packed row's sequence lengths, the halves) on the host
            host_ids, host_lengths = mb.domain_ids, mb.sequence_lengths
            mb = mb.to(engine.device)
            with hook.micro_batch(host_ids, host_lengths, mb.halves):
                scale = hook.dummy_scale()
                logits = engine(**mb.model_inputs()).logits
                if scale is not None:
                    logits = logits * scale
                seq = mb.sequence_losses(logits)
                engine.backward(hook.objective(seq, mb.domain_ids, scale))
            engine.step()
            totals.loss_sums.index_add_(0, mb.domain_ids, seq.detach().double())
            totals.sequences += torch.bincount(host_ids, minlength=len(domains)).double()
            totals.tokens += mb.num_tokens
            totals.target_tokens += mb.num_target_tokens
        totals.all_reduce(engine.device)
        update_norm = s.updates.end_step()
        return self._step_record(step + 1, totals, domains, lr, engine, hook, update_norm, time.perf_counter() - t0)

    @staticmethod
    def _step_record(step: int, totals: StepTotals, domains: list[str], lr: float, engine, hook,
                     update_norm: torch.Tensor, seconds: float) -> dict[str, Any]:
        losses, counts = totals.loss_sums, totals.sequences
        record: dict[str, Any] = {
            "step": step,
            "loss": float(losses.sum() / counts.sum().clamp(min=1)),
            "lr": float(lr),
        }
        for i, d in enumerate(domains):
            record[f"loss.{d}"] = float(losses[i] / counts[i].clamp(min=1))
        norm = engine.get_global_grad_norm()
        record["grad_norm"] = float(norm) if norm is not None else None
        record["update_norm"] = float(update_norm)
        for k, v in (hook.pop_stats() or {}).items():
            if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
                v = v.item()
            if isinstance(v, (int, float, bool)):
                record[f"hook.{k}"] = float(v)
        record["step_time_s"] = seconds
        record["tokens_per_s"] = totals.tokens / seconds if seconds > 0 else None
        record["target_tokens"] = int(totals.target_tokens)
        return record

    # -- checkpoints and the end -------------------------------------------------------------------

    def checkpoint_if_due(self, s: Session, step: int) -> bool:
        """Save when a stop is asked for, at the end, and every ``checkpoint.every_steps``;
        True when the run should stop here (every rank agrees: the check is collective)."""
        every = self.cfg.checkpoint.every_steps
        stopping = s.stop.requested(s.engine.device) or step == self.cfg.checkpoint.stop_at_step
        if stopping or step == s.total_steps or (every and step % every == 0):
            check_finite_weights(s.engine.module, f"the checkpoint of step {step}")
            state = {"step": step, "world_size": s.dist.world_size, "total_steps": s.total_steps,
                     "update_path": s.updates.state(), "schedule": self._schedule(s.total_steps)}
            save_checkpoint(s.engine, s.out / "checkpoints", step, state, s.dist.rank, self.cfg.checkpoint.keep_last,
                            lambda path: save_adapter_atomic(s.engine.module, s.tokenizer, path, s.prompt_format,
                                                             self._portable(s, step)),
                            method_state=s.hook.method_state(), meta={"run": self._identity(s.hook)})
        if stopping and s.stop.reason is not None and s.dist.rank == 0:
            s.stop.consume()  # done: the next run must not stop on it
        if stopping and step < s.total_steps:
            why = s.stop.reason or "checkpoint.stop_at_step"
            self._print(f"stopping ({why}): checkpoint saved at step {step}; rerun with resume: auto to continue")
        return stopping

    def finish(self, s: Session, status: str) -> Path | None:
        """The final adapter (rank 0) once every step ran; the engine stays for callers that test it."""
        adapter_dir = None
        if status == "completed":
            adapter_dir = s.out / "adapter"
            check_finite_weights(s.engine.module, f"the adapter {adapter_dir}")  # never "done" from NaN weights
            if s.dist.rank == 0:
                save_adapter_atomic(s.engine.module, s.tokenizer, adapter_dir, s.prompt_format, self._portable(s))
                s.updates.write(s.out, s.total_steps)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        self.engine = s.engine
        return adapter_dir

    def _portable(self, s: Session, step: int | None = None) -> Callable[[Path], Any]:
        """What makes a saved adapter folder portable: its base named as the user wrote it (or the
        folder given to the trainer), and a model card of the run at ``step`` (None: the end)."""
        spec = self.base_model_dir or self.cfg.model.name_or_path
        return lambda folder: make_portable(folder, s.out, spec, self.cfg.model.tiny or None, step)

    def _print(self, msg: str) -> None:
        if self.dist.rank == 0 and not self.quiet:
            print(msg, flush=True)


def save_adapter_atomic(peft_model, tokenizer, path: Path, fmt: PromptFormat | None = None,
                        finish: Callable[[Path], Any] | None = None) -> None:
    """PEFT adapter (+ tokenizer, + the prompt format it was trained with) into ``path`` via a
    temporary folder and a rename; ``finish(folder)`` completes the folder before the rename
    (:func:`iga_ds.train.model_card.make_portable`: the base named portably, the model card)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_adapter_folder(peft_model, tokenizer, tmp, fmt, finish)
    except OSError as exc:  # a full disk, say: one line naming what was being written
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"writing the adapter {path} (through {tmp}): {write_failure(exc)}") from None
    old = path.with_name(f".{path.name}.{os.getpid()}.old")
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _write_adapter_folder(peft_model, tokenizer, folder: Path, fmt: PromptFormat | None,
                          finish: Callable[[Path], Any] | None) -> None:
    """Everything an adapter folder holds, written into ``folder`` (the temporary one)."""
    peft_model.save_pretrained(str(folder), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    if fmt is not None:
        save_prompt_format(folder, fmt)
    if finish is not None:
        finish(folder)
    follow_umask(folder)  # safetensors writes the weights 0600; the adapter is read like every other output


def check_halves(hook: EngineHook, groups_per_step: int) -> None:
    """A method that compares two halves of each domain's groups needs an even number of groups a step."""
    if hook.domain_halves and groups_per_step % 2:
        raise ConfigError(f"data.groups_per_step: method {hook.method.name!r} (variance: debiased) splits each "
                          f"step's groups in two equal halves; expected an even number, got {groups_per_step}")


def train(config: RunConfig, **kwargs) -> TrainResult:
    return Trainer(config, **kwargs).run()
