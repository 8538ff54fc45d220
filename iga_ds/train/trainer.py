"""The training loop: a PEFT LoRA model in a DeepSpeed ZeRO engine, driven through the IGA hook.

One loop serves one process (CPU or one GPU) and any launcher that sets the usual rank
variables. Per optimizer step every rank runs its micro-batches of whole isomer groups::

    with hook.micro_batch(domain_ids):
        logits = engine(...).logits * hook.dummy_scale()   # the scale only for IRM
        engine.backward(hook.objective(sequence_losses, domain_ids, scale))
    engine.step()

and rank 0 logs the step (``metrics.jsonl``, TensorBoard, a progress bar).
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from iga_ds.errors import ConfigError, DataError
from iga_ds.train.config import BUILTIN_TINY, RunConfig

log = logging.getLogger("iga_ds.train")


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


@dataclass
class TrainResult:
    status: str  # "completed" or "stopped" (a signal or the stop file asked to stop; a checkpoint was saved)
    step: int
    total_steps: int
    output_dir: Path
    adapter_dir: Path | None
    wall_seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)


# -- distributed setup -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_dist(local_rank: int | None = None) -> DistEnv:
    """Ranks from the launcher, Slurm or MPI (``iga_ds.launch.ranks``), exported for
    ``env://``; a lone process becomes rank 0 of 1 on a free local port."""
    import dataclasses

    import torch.distributed

    if torch.distributed.is_initialized():  # a second run in the same process reuses its group
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        # DeepSpeed reads these again at initialize, and the caller may have reset the environment
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
        return DistEnv(rank, world, local)
    try:
        from iga_ds.launch.ranks import apply_dist_env, resolve_dist_env
    except ImportError:  # the launch package is optional: plain launcher variables then
        resolve_dist_env = None
    if resolve_dist_env is not None:
        env = resolve_dist_env(local_rank=local_rank)
        if env.source == "single" and "MASTER_PORT" not in os.environ:
            env = dataclasses.replace(env, master_port=_free_port())  # never collide with a neighbour
        apply_dist_env(env)
        return DistEnv(env.rank, env.world_size, env.local_rank)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if local_rank is not None:
        os.environ["LOCAL_RANK"] = str(local_rank)
    return DistEnv(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


def _use_cpu() -> bool:
    import torch

    if os.environ.get("DS_ACCELERATOR", "") == "cpu":
        return True
    return not torch.cuda.is_available()


def init_distributed(dist: DistEnv) -> None:
    cpu = _use_cpu()
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the first deepspeed import
    import deepspeed
    import torch

    if not cpu:
        torch.cuda.set_device(dist.local_rank)
    elif not os.environ.get("IGA_DS_CPU_SHM_OP"):
        from iga_ds.ds.compat import disable_cpu_shm_comm_op

        disable_cpu_shm_comm_op()
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl", auto_mpi_discovery=False, verbose=False)


# -- configs ---------------------------------------------------------------------------------


def load_ds_json(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"deepspeed: config {path!r} not found")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None


def build_ds_config(run: RunConfig, ds_raw: dict[str, Any], world_size: int, accum: int, source: str = "deepspeed",
                    cpu: bool | None = None):
    """DeepSpeed dict and IGA block for this run: batch sizes from the run YAML, method from the
    run YAML when it names one, domains from ``data.domains`` when given."""
    from iga_ds.ds import IGAConfig, split_config

    ds, iga = split_config(ds_raw)
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ConfigError(
                f"{source}: remove {key!r}; AdamW and its cosine schedule come from the run YAML's schedule"
            )
    block = iga.to_dict()
    if run.method is not None:
        block["method"], block["params"] = run.method.name, dict(run.method.params)
    if run.data.domains is not None:
        block["domains"] = list(run.data.domains)
    iga = IGAConfig.from_dict(block, where="method" if run.method is not None else f"{source}: iga")
    micro = run.data.groups_per_micro_batch * iga.num_domains
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
    ds.setdefault("zero_allow_untested_optimizer", True)  # a torch AdamW, built here
    ds.setdefault("steps_per_print", 10**9)
    zero = ds.setdefault("zero_optimization", {})
    zero.setdefault("elastic_checkpoint", True)  # resume at another world size
    if _use_cpu() if cpu is None else cpu:
        for key in ("fp16", "bf16"):
            if ds.get(key, {}).get("enabled"):
                raise ConfigError(f"{source}: {key} is enabled but this run is on the CPU; use ds_configs/zero2_fp32.json")
    return ds, iga


# -- the loop --------------------------------------------------------------------------------


class Trainer:
    """Build everything from a RunConfig, then ``run()``; see the module docstring."""

    def __init__(
        self,
        config: RunConfig,
        base_model_dir: str | None = None,
        local_rank: int | None = None,
        on_step_end: Callable[[int, dict[str, Any]], None] | None = None,
        quiet: bool = False,
    ):
        self.cfg = config
        self.base_model_dir = base_model_dir
        self.local_rank = local_rank
        self.on_step_end = on_step_end
        self.quiet = quiet

    # the base model folder: a local directory, or the built-in tiny base built from the data
    def _resolve_base(self, records: list[dict]) -> str:
        if self.base_model_dir:
            return self.base_model_dir
        path = self.cfg.model.name_or_path
        if path == BUILTIN_TINY:
            from iga_ds.train.model import TinyBaseConfig
            from iga_ds.train.pretrain import default_tiny_base

            shape = TinyBaseConfig(**self.cfg.model.tiny) if self.cfg.model.tiny else None

            def build() -> str:
                return str(default_tiny_base(shape, progress=self.dist.rank == 0 and not self.quiet, log=self._print))

            return self._local_rank_zero_first(build)
        return path

    def _local_rank_zero_first(self, build):
        """Run ``build`` on each node's local rank 0 first, then on the other ranks (a cache hit
        there): one pretraining per node instead of one per rank racing for the same folder."""
        import torch.distributed as tdist

        if not (tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1):
            return build()
        first = self.dist.local_rank == 0
        try:
            result = build() if first else None
        finally:
            tdist.barrier()  # also when local rank 0 failed, so that the others do not hang here
        return result if first else build()

    def _print(self, msg: str) -> None:
        if self.dist.rank == 0 and not self.quiet:
            print(msg, flush=True)

    def run(self) -> TrainResult:
        t_start = time.perf_counter()
        cfg = self.cfg
        self.dist = dist = resolve_dist(self.local_rank)
        init_distributed(dist)
        import deepspeed
        import numpy as np
        import torch

        from iga_ds.ds import attach
        from iga_ds.train.batching import (GroupSampler, check_batch_layout, collate, complete_groups, read_records,
                                           unknown_words)
        from iga_ds.train.batching import sequence_losses
        from iga_ds.train.checkpoint import STOP_FILE, StopSignal, load_checkpoint, resolve_resume, save_checkpoint
        from iga_ds.train.model import add_lora, load_base_model, load_tokenizer
        from iga_ds.train.optim import GroupStepAdamW, lr_lambda

        if not os.environ.get("IGA_DS_VERBOSE"):
            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

        out = Path(cfg.output_dir)
        ckpt_dir = out / "checkpoints"
        accum = check_batch_layout(cfg.data.groups_per_step, cfg.data.groups_per_micro_batch, dist.world_size)
        ds_dict, iga = build_ds_config(cfg, load_ds_json(cfg.deepspeed), dist.world_size, accum, cfg.deepspeed)
        domains = list(iga.domains)

        if not cfg.data.train:
            raise ConfigError("data.train: expected the path of an isomer JSON Lines file")
        records = read_records(cfg.data.train)
        groups = complete_groups(records, domains, cfg.data.train)
        if not groups:
            raise DataError(f"{cfg.data.train}: no isomer group has all of the domains {domains}")
        dropped = len({str(r['group_id']) for r in records}) - len(groups)
        if dropped:
            self._print(f"note: {dropped} groups lack one of the domains {domains} and are skipped")
        sampler = GroupSampler(len(groups), cfg.data.groups_per_step, cfg.seed)
        total_steps = cfg.schedule.max_steps or max(1, math.ceil(cfg.schedule.epochs * sampler.steps_per_epoch))

        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        base_dir = self._resolve_base(records)
        tokenizer = load_tokenizer(cfg.tokenizer or base_dir)
        unk_rate, unk_examples = unknown_words(tokenizer, records)
        if unk_rate > 0.001:
            self._print(f"warning: {unk_rate:.1%} of the training tokens are unknown to the tokenizer of "
                        f"{cfg.tokenizer or base_dir} (e.g. {', '.join(map(repr, unk_examples))}); "
                        "the model cannot tell those words apart")
        model = load_base_model(base_dir, cfg.model.dtype, cfg.model.attn_implementation)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        model = add_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules, cfg.lora.rslora)
        trainable = [p for p in model.parameters() if p.requires_grad]
        n_trainable = sum(p.numel() for p in trainable)
        n_total = sum(p.numel() for p in model.parameters())
        s = cfg.schedule
        optimizer = GroupStepAdamW(trainable, lr=s.lr, betas=tuple(s.betas), eps=s.eps, weight_decay=s.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, s.warmup_ratio, s.min_lr_ratio))
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_dict, dist_init_required=False
        )
        hook = attach(engine, iga)

        start_step = 0
        resume_from = resolve_resume(cfg.resume, ckpt_dir)
        if resume_from is not None:
            client = load_checkpoint(engine, resume_from, dist.rank)
            start_step = int(client.get("step", 0))
            self._print(f"resumed from {resume_from} at step {start_step}")
        stop = StopSignal(out / STOP_FILE)
        if dist.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            # before step 1, whose collectives no other rank passes without this one: no rank
            # can read a request meant for an earlier run
            if stop.discard_stale():
                self._print(f"removed {out / STOP_FILE}, a stop request left by an earlier run")
            self._write_resolved_config(out, ds_dict, iga, base_dir, dist, total_steps, n_trainable, n_total)
            truncate_metrics(out / "metrics.jsonl", start_step)
        self._print(
            f"training LoRA r={cfg.lora.r}: {n_trainable:,} trainable of {n_total:,} parameters; "
            f"method {iga.method}; {len(groups)} groups, {total_steps} steps, world size {dist.world_size}"
        )

        writer = self._tensorboard(out, start_step) if dist.rank == 0 else None
        metrics_file = (out / "metrics.jsonl").open("a", encoding="utf-8") if dist.rank == 0 else None
        stop.install()
        from tqdm.auto import tqdm

        bar = tqdm(
            total=total_steps, initial=start_step, desc=f"train {iga.method}", dynamic_ncols=True,
            disable=dist.rank != 0 or not cfg.logging.progress or self.quiet,
        )
        history: list[dict[str, Any]] = []
        status = "completed"
        step = start_step
        client_state = lambda st: {"step": st, "world_size": dist.world_size, "total_steps": total_steps}
        save_adapter = lambda path: save_adapter_atomic(engine.module, tokenizer, path)
        ndom = len(domains)
        try:
            engine.train()
            while step < total_steps:
                t0 = time.perf_counter()
                mine = sampler.rank_groups(step, dist.rank, dist.world_size)
                per_micro = cfg.data.groups_per_micro_batch
                sums = torch.zeros(2 * ndom + 2, dtype=torch.float64)  # loss sums, counts, tokens, targets
                # per-domain loss sums stay on the device until the step ends: reading them per
                # micro-batch would stall the launch queue
                loss_sums = torch.zeros(ndom, dtype=torch.float64, device=engine.device)
                lr = engine.get_lr()[0]
                for i in range(0, len(mine), per_micro):
                    mb = collate(tokenizer, [groups[g] for g in mine[i : i + per_micro]], domains, cfg.data.max_length)
                    host_ids = mb.domain_ids  # the hook reads domain ids on the host
                    mb = mb.to(engine.device)
                    with hook.micro_batch(host_ids):
                        scale = hook.dummy_scale()
                        logits = engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
                        if scale is not None:
                            logits = logits * scale
                        seq = sequence_losses(logits, mb.labels)
                        loss = hook.objective(seq, mb.domain_ids, scale)
                        engine.backward(loss)
                    engine.step()
                    loss_sums.index_add_(0, mb.domain_ids, seq.detach().double())
                    sums[ndom : 2 * ndom] += torch.bincount(host_ids, minlength=ndom).double()
                    sums[-2] += mb.num_tokens
                    sums[-1] += mb.num_target_tokens
                sums[:ndom] += loss_sums.cpu()
                if torch.distributed.is_initialized() and dist.world_size > 1:
                    # on the engine's device: NCCL reduces no host tensors
                    sums_dev = sums.to(engine.device)
                    torch.distributed.all_reduce(sums_dev)
                    sums = sums_dev.cpu()
                step += 1
                dt = time.perf_counter() - t0
                record = self._step_record(step, sums, ndom, domains, lr, engine, hook, dt)
                history.append(record)
                if dist.rank == 0:
                    if step % cfg.logging.every_steps == 0 or step == total_steps:
                        metrics_file.write(json.dumps(record) + "\n")
                        metrics_file.flush()
                        if writer is not None:
                            for k, v in record.items():
                                if k != "step" and isinstance(v, (int, float)):
                                    writer.add_scalar(k.replace(".", "/"), v, step)
                    bar.update(1)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}")
                if self.on_step_end is not None:
                    self.on_step_end(step, record)
                every = cfg.checkpoint.every_steps
                stopping = stop.requested(engine.device) or step == cfg.checkpoint.stop_at_step
                if stopping or step == total_steps or (every and step % every == 0):
                    save_checkpoint(
                        engine, ckpt_dir, step, client_state(step), dist.rank, cfg.checkpoint.keep_last, save_adapter
                    )
                if stopping and stop.reason is not None and dist.rank == 0:
                    stop.consume()  # done: the next run must not stop on it
                if stopping and step < total_steps:
                    status = "stopped"
                    why = stop.reason or "checkpoint.stop_at_step"
                    self._print(f"stopping ({why}): checkpoint saved at step {step}; rerun with resume: auto to continue")
                    break
        finally:
            stop.uninstall()
            bar.close()
            if metrics_file is not None:
                metrics_file.close()
            if writer is not None:
                writer.close()
            hook.detach()

        adapter_dir = None
        if status == "completed":
            adapter_dir = out / "adapter"
            if dist.rank == 0:
                save_adapter_atomic(engine.module, tokenizer, adapter_dir)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        self.engine = engine
        return TrainResult(status, step, total_steps, out, adapter_dir, time.perf_counter() - t_start, history)

    def _step_record(self, step, sums, ndom, domains, lr, engine, hook, dt) -> dict[str, Any]:
        loss_sums, counts = sums[:ndom], sums[ndom : 2 * ndom]
        record: dict[str, Any] = {
            "step": step,
            "loss": float(loss_sums.sum() / counts.sum().clamp(min=1)),
            "lr": float(lr),
        }
        for i, d in enumerate(domains):
            record[f"loss.{d}"] = float(loss_sums[i] / counts[i].clamp(min=1))
        norm = engine.get_global_grad_norm()
        record["grad_norm"] = float(norm) if norm is not None else None
        for k, v in (hook.pop_stats() or {}).items():
            if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
                v = v.item()
            if isinstance(v, (int, float, bool)):
                record[f"hook.{k}"] = float(v)
        record["step_time_s"] = dt
        record["tokens_per_s"] = float(sums[-2]) / dt if dt > 0 else None
        record["target_tokens"] = int(sums[-1])
        return record

    def _tensorboard(self, out: Path, start_step: int):
        if not self.cfg.logging.tensorboard:
            return None
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events after the resumed step, so a resumed curve has no duplicates
        return SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def _write_resolved_config(self, out, ds_dict, iga, base_dir, dist, total_steps, n_trainable, n_total) -> None:
        import yaml

        from iga_ds.utils_io import atomic_write_text

        resolved = self.cfg.to_dict()
        resolved["resolved"] = {
            "base_model_dir": str(base_dir),
            "world_size": dist.world_size,
            "total_steps": total_steps,
            "trainable_parameters": n_trainable,
            "total_parameters": n_total,
            "deepspeed_config": ds_dict,
            "iga": iga.to_dict(),
        }
        atomic_write_text(out / "config.resolved.yaml", yaml.safe_dump(resolved, sort_keys=False))


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metric lines after ``last_step`` (left by a run killed after its last checkpoint),
    so a resumed run's metrics.jsonl has each step once."""
    from iga_ds.utils_io import atomic_write_text

    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
    atomic_write_text(path, "".join(k + "\n" for k in kept))


def save_adapter_atomic(peft_model, tokenizer, path: Path) -> None:
    """PEFT adapter (+ tokenizer) into ``path`` via a temporary folder and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(str(tmp), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    old = path.with_name(f".{path.name}.{os.getpid()}.old")
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def train(config: RunConfig, **kwargs) -> TrainResult:
    return Trainer(config, **kwargs).run()
