"""``iga-ds selfcheck``: is this node, container and job fit to train, before any model loads?

Checks, cheapest first: package versions, the CPUs this rank may use (no fewer than the Slurm
step's ``SLURM_CPUS_PER_TASK``), the accelerator, which DeepSpeed ops can be used (built into
the wheel, or compatible for a just-in-time build; nothing is built here, and none is required
unless asked: the trainer steps torch's AdamW), free host and device memory, and, when the job
has more than one rank, a small all-reduce across all ranks (gloo on CPU, NCCL on GPU) under a
hard timeout. Every failure ends in one line saying what
failed and where, and a non-zero exit.
"""
from __future__ import annotations

import contextlib
import io
import os
import platform
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata

from iga_ds.cluster.ranks import DistEnv, apply_dist_env, describe, resolve_dist_env
from iga_ds.engine.internals import deepspeed_op_status
from iga_ds.errors import UserError

PACKAGES = ("torch", "deepspeed", "transformers", "peft", "iga-ds")
EXIT_FAILED = 1
EXIT_TIMEOUT = 3


class SelfcheckFailure(Exception):
    """A check failed; the message is the one line the user sees."""


@dataclass
class Report:
    host: str
    dist: dict
    versions: dict = field(default_factory=dict)
    cpus: dict = field(default_factory=dict)
    accelerator: dict = field(default_factory=dict)
    deepspeed_ops: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    all_reduce: dict | None = None
    ok: bool = True
    error: str | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_info(environ=None) -> dict:
    """How many CPUs this process may run on (its affinity), and how many per task the Slurm
    step asks for (``SLURM_CPUS_PER_TASK``; None outside Slurm)."""
    environ = os.environ if environ is None else environ
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux
        usable = os.cpu_count() or 1
    asked = environ.get("SLURM_CPUS_PER_TASK", "").strip()
    return {"usable": usable, "asked_per_task": int(asked) if asked.isdigit() else None}


def check_cpus(cpus: dict) -> None:
    """A rank bound to fewer CPUs than its task asked for starves (data loading, tokenization,
    the capture's host work): the srun that started it did not pass the job's CPUs on."""
    asked = cpus.get("asked_per_task")
    if asked and cpus["usable"] < asked:
        raise SelfcheckFailure(
            f"this rank may use {cpus['usable']} CPU(s) but the job asks for {asked} per task "
            "(SLURM_CPUS_PER_TASK): since Slurm 22.05 srun needs --cpus-per-task or SRUN_CPUS_PER_TASK "
            "(the templates in slurm/ pass both)")


def accelerator_info() -> dict:
    import torch

    info: dict = {"torch_cuda": torch.version.cuda, "ds_accelerator": os.environ.get("DS_ACCELERATOR")}
    if torch.cuda.is_available():
        info["kind"] = "cuda"
        info["device_count"] = torch.cuda.device_count()
        info["devices"] = [
            {"name": torch.cuda.get_device_name(i), "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
            for i in range(torch.cuda.device_count())
        ]
    else:
        info["kind"] = "cpu"
        info["device_count"] = 0
        info["cpu_threads"] = torch.get_num_threads()
    return info


def deepspeed_ops() -> dict[str, dict[str, bool]]:
    """For each op DeepSpeed knows: prebuilt into the install, and compatible (could JIT-build).

    The op builders are DeepSpeed's internals, read through ``engine.internals``; DeepSpeed
    prints warnings while probing, which are kept out of the report. A DeepSpeed whose builders
    moved fails the check with the line naming them.
    """
    noise = io.StringIO()
    with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
        try:
            return deepspeed_op_status()
        except UserError as exc:
            raise SelfcheckFailure(str(exc)) from None


def memory_info(dist: DistEnv, kind: str) -> dict:
    info: dict = {}
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) for line in f if ":" in line}
        info["host_available_gib"] = round(fields["MemAvailable"] / 2**20, 2)
        info["host_total_gib"] = round(fields["MemTotal"] / 2**20, 2)
    if kind == "cuda":
        import torch

        device = dist.local_rank % max(torch.cuda.device_count(), 1)
        free, total = torch.cuda.mem_get_info(device)
        info["device"] = device
        info["device_free_gib"] = round(free / 2**30, 2)
        info["device_total_gib"] = round(total / 2**30, 2)
    return info


def _watchdog(seconds: float, what: str, dist: DistEnv) -> threading.Timer:
    """Hard stop: a wedged NCCL or gloo call can ignore its own timeout; this cannot hang."""

    def fire() -> None:
        print(f"iga-ds selfcheck: FAILED on {describe(dist)}: {what} did not finish in {seconds:.0f} s "
              f"(are all {dist.world_size} ranks started, with distinct ranks, and can they reach "
              f"{dist.master_addr}:{dist.master_port}?)", file=sys.stderr, flush=True)
        os._exit(EXIT_TIMEOUT)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def all_reduce_check(dist: DistEnv, backend: str, timeout_s: float) -> dict:
    """Sum of (rank + 1) over all ranks must be W(W+1)/2; also gathers every rank's host name."""
    import datetime

    import torch
    import torch.distributed as tdist

    apply_dist_env(dist)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(dist.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    timer = _watchdog(timeout_s + 15, "rendezvous and all-reduce", dist)
    start = time.perf_counter()
    try:
        tdist.init_process_group(backend=backend, init_method="env://", rank=dist.rank,
                                 world_size=dist.world_size,
                                 timeout=datetime.timedelta(seconds=timeout_s))
        joined = time.perf_counter()
        value = torch.full((1024,), float(dist.rank + 1), dtype=torch.float64 if backend == "gloo" else torch.float32,
                           device=device)
        tdist.all_reduce(value)
        hosts: list = [None] * dist.world_size
        tdist.all_gather_object(hosts, socket.gethostname())
        tdist.barrier()
        got = value.cpu().double()
    except Exception as exc:  # surfaced as one line by the caller
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise SelfcheckFailure(
            f"{backend} rendezvous/all-reduce failed: {type(exc).__name__}: {first_line} "
            f"(are all {dist.world_size} ranks started, with distinct ranks, and can they reach "
            f"{dist.master_addr}:{dist.master_port}?)") from exc
    finally:
        timer.cancel()
        if tdist.is_initialized():
            tdist.destroy_process_group()
    expected = dist.world_size * (dist.world_size + 1) / 2
    if not torch.all(got == expected):
        raise SelfcheckFailure(f"{backend} all-reduce returned {got[0].item()} (and maybe others), "
                               f"expected {expected} for {dist.world_size} ranks")
    return {
        "backend": backend,
        "world_size": dist.world_size,
        "sum": got[0].item(),
        "expected": expected,
        "rendezvous_s": round(joined - start, 3),
        "total_s": round(time.perf_counter() - start, 3),
        "hosts": hosts,
    }


def run_selfcheck(
    *,
    local_rank: int | None = None,
    backend: str = "auto",
    timeout_s: float = 120.0,
    require_ops: tuple[str, ...] = (),
    check_ops: bool = True,
    min_free_gib: float = 0.0,
) -> Report:
    """Run all checks; ``report.ok`` is False and ``report.error`` says why when one fails."""
    dist = resolve_dist_env(local_rank=local_rank)
    report = Report(host=socket.gethostname(), dist=dist.as_dict())
    try:
        report.versions = package_versions()
        missing = [name for name in ("torch", "deepspeed") if report.versions.get(name) is None]
        if missing:
            raise SelfcheckFailure(f"package(s) not installed: {', '.join(missing)}")
        report.cpus = cpu_info()
        check_cpus(report.cpus)
        report.accelerator = accelerator_info()
        kind = report.accelerator["kind"]
        if check_ops or require_ops:
            report.deepspeed_ops = deepspeed_ops()
            for op in require_ops:
                status = report.deepspeed_ops.get(op)
                if status is None:
                    raise SelfcheckFailure(f"DeepSpeed has no op named {op!r}; known: "
                                           f"{', '.join(sorted(report.deepspeed_ops))}")
                if not (status["installed"] or status["compatible"]):
                    raise SelfcheckFailure(f"DeepSpeed op {op} is neither prebuilt nor buildable here "
                                           "(run `ds_report`; in the image, build it with DS_BUILD_"
                                           f"{op.upper()}=1)")
        report.memory = memory_info(dist, kind)
        free = report.memory.get("device_free_gib", report.memory.get("host_available_gib"))
        if min_free_gib and free is not None and free < min_free_gib:
            where = "GPU" if kind == "cuda" else "host"
            raise SelfcheckFailure(f"only {free} GiB {where} memory free, --min-free-gib asks {min_free_gib}")
        if backend == "auto":
            backend = "nccl" if kind == "cuda" else "gloo"
        if backend == "nccl" and kind != "cuda":
            raise SelfcheckFailure("backend nccl asked for but no CUDA device is visible")
        if dist.world_size > 1:
            report.all_reduce = all_reduce_check(dist, backend, timeout_s)
    except SelfcheckFailure as exc:
        report.ok = False
        report.error = str(exc)
    return report


def format_report(report: Report) -> str:
    """Human-readable report; ranks other than 0 print one line."""
    d = report.dist
    head = (f"selfcheck rank {d['rank']}/{d['world_size']} local {d['local_rank']}/{d['local_world_size']} "
            f"host {report.host} source {d['source']}: {'ok' if report.ok else 'FAILED'}")
    if report.all_reduce:
        ar = report.all_reduce
        head += f" (all-reduce {ar['backend']} sum {ar['sum']:g} == {ar['expected']:g}, {ar['total_s']} s)"
    if report.cpus:
        head += f" cpus {report.cpus['usable']}"
    if d["rank"] != 0:
        return head
    lines = [head]
    lines.append("  versions: " + ", ".join(f"{k} {v or 'MISSING'}" for k, v in report.versions.items()))
    acc = report.accelerator
    if acc:
        devices = ", ".join(f"{x['name']} (sm {x['capability']})" for x in acc.get("devices", []))
        lines.append(f"  accelerator: {acc['kind']}" + (f" x{acc['device_count']}: {devices}" if devices else ""))
    if report.deepspeed_ops:
        usable = [n for n, s in report.deepspeed_ops.items() if s["installed"] or s["compatible"]]
        prebuilt = [n for n, s in report.deepspeed_ops.items() if s["installed"]]
        lines.append(f"  deepspeed ops usable: {', '.join(usable) or 'none'}")
        lines.append(f"  deepspeed ops prebuilt: {', '.join(prebuilt) or 'none (JIT-built on first use)'}")
    if report.memory:
        lines.append("  memory: " + ", ".join(f"{k} {v}" for k, v in report.memory.items()))
    lines.append(f"  rendezvous: {d['master_addr']}:{d['master_port']}")
    if report.all_reduce:
        lines.append(f"  ranks on hosts: {', '.join(map(str, report.all_reduce['hosts']))}")
    return "\n".join(lines)


def failure_line(report: Report) -> str:
    d = report.dist
    return (f"iga-ds selfcheck: FAILED on rank {d['rank']}/{d['world_size']} ({report.host}): {report.error}")
