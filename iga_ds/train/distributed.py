"""The process group of a training run: ranks from any launcher, a rendezvous that names the
ranks that never came, then DeepSpeed's init.

Every rank first checks in at a key-value store rank 0 hosts on ``MASTER_PORT`` (the store
the process group is then built on). A rank that has not arrived within
``IGA_DS_RENDEZVOUS_TIMEOUT_S`` seconds (default 600, DeepSpeed's own rendezvous timeout)
stops every rank that did with one line naming the missing ones, exit code
:data:`EXIT_RANKS_MISSING`; a rank that cannot reach rank 0's store in that time names rank 0.
Like the rest of the rendezvous (``MASTER_ADDR``, ``MASTER_PORT``, the launcher's ranks) the
timeout comes from the environment, so the same job script sets it for every rank.
"""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as tdist

from iga_ds.cluster.ranks import DistEnv, apply_dist_env, resolve_dist_env
from iga_ds.config.deepspeed import use_cpu
from iga_ds.engine.internals import disable_cpu_shm_comm_op, forget_world_group
from iga_ds.errors import UserError

RENDEZVOUS_TIMEOUT_VARIABLE = "IGA_DS_RENDEZVOUS_TIMEOUT_S"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0
# the timeout of the process group's own collectives, as DeepSpeed's init gives it
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
EXIT_RANKS_MISSING = 3
ARRIVED = "iga-ds/rendezvous/arrived/"


class RanksMissing(UserError):
    """A rank never came to the rendezvous: the message names it; exit code :data:`EXIT_RANKS_MISSING`."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=EXIT_RANKS_MISSING)


def resolve_dist(local_rank: int | None = None) -> DistEnv:
    """Ranks from the launcher, Slurm or MPI (:mod:`iga_ds.cluster.ranks`), exported for
    ``env://``; a lone process becomes rank 0 of 1 on a free local port (so does a launcher's
    one rank, or a second run after ``destroy_process_group``, when ``MASTER_PORT`` is unset)."""
    if tdist.is_initialized():  # a second run in the same process reuses its group
        rank, world = tdist.get_rank(), tdist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        # DeepSpeed reads these again at initialize, and the caller may have reset the environment
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
        return DistEnv(rank, world, local, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                       os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0")),
                       "initialized")
    env = resolve_dist_env(local_rank=local_rank)  # one rank without MASTER_PORT: a free port
    apply_dist_env(env)
    return env


def rendezvous_timeout_s() -> float:
    """``IGA_DS_RENDEZVOUS_TIMEOUT_S``, or the default; anything but a positive number is one line."""
    raw = os.environ.get(RENDEZVOUS_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_RENDEZVOUS_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise UserError(f"{RENDEZVOUS_TIMEOUT_VARIABLE}: expected a positive number of seconds, got {raw!r}")
    return value


def init_distributed(dist: DistEnv) -> None:
    """gloo on the CPU, NCCL on GPUs; this rank's GPU is its local rank. Several ranks meet at
    :func:`rendezvous` first, and the process group is built on its store."""
    cpu = use_cpu()
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the first deepspeed import
    timeout_s = rendezvous_timeout_s()
    import deepspeed  # after DS_ACCELERATOR, which DeepSpeed reads when first imported

    if not cpu:
        torch.cuda.set_device(dist.local_rank)
    elif not os.environ.get("IGA_DS_CPU_SHM_OP"):
        disable_cpu_shm_comm_op()
    if not tdist.is_initialized():
        forget_world_group()  # a group of an earlier run in this process is gone with it
        if dist.world_size > 1:
            start_process_group(dist, rendezvous(dist, timeout_s), cpu)
        # DeepSpeed's communication layer over the group (which it starts itself for one rank)
        deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl", auto_mpi_discovery=False, verbose=False)


def start_process_group(dist: DistEnv, store, cpu: bool) -> None:
    """The process group on the rendezvous' store, as DeepSpeed's init would start it: NCCL bound
    to this rank's GPU (so that new groups split its communicator) where torch does that
    without hanging."""
    kwargs = {}
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    if not cpu and not (2, 6, 0) < version < (2, 7, 1):
        kwargs["device_id"] = torch.device("cuda", dist.local_rank)
    tdist.init_process_group("gloo" if cpu else "nccl", store=store, rank=dist.rank, world_size=dist.world_size,
                             timeout=GROUP_TIMEOUT, **kwargs)


def rendezvous(dist: DistEnv, timeout_s: float):
    """Meet every rank at the store rank 0 hosts on ``MASTER_PORT``; returns the store (for the
    process group), or raises :class:`RanksMissing` naming who is not there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    where = f"{dist.master_addr}:{dist.master_port}"
    store = _connect(dist, deadline, timeout_s, where)
    keys = [f"{ARRIVED}{r}" for r in range(dist.world_size)]
    try:
        store.set(keys[dist.rank], socket.gethostname())
        # asked every half second, one round trip for all the keys (a store's own wait that times
        # out prints its socket's warnings)
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                raise RanksMissing(f"rank {dist.rank}/{dist.world_size}: rank{'s' if len(missing) > 1 else ''} "
                                   f"{', '.join(map(str, missing))} of {dist.world_size} did not come to the "
                                   f"rendezvous at {where} within {timeout_s:g} s ({RENDEZVOUS_TIMEOUT_VARIABLE}); "
                                   f"start every rank, and check that each reaches {where}")
            time.sleep(min(0.5, timeout_s / 10))
    except RuntimeError as exc:  # the store went away: rank 0, which hosts it, gave up or died
        raise RanksMissing(f"rank {dist.rank}/{dist.world_size}: the rendezvous at {where} closed before every rank "
                           f"came (rank 0 hosts it: see its log; {_first_line(exc)})") from None
    return store


def _connect(dist: DistEnv, deadline: float, timeout_s: float, where: str):
    """Rank 0 hosts the store (or, under torchrun, every rank joins its agent's); the others
    connect once its port answers (the store's own retries print their sockets' warnings)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = dist.rank == 0 and not agent
    if not host and not _answers(dist.master_addr, dist.master_port, deadline):
        raise RanksMissing(f"rank {dist.rank}/{dist.world_size}: rank 0 did not answer at the rendezvous {where} "
                           f"within {timeout_s:g} s ({RENDEZVOUS_TIMEOUT_VARIABLE}); start rank 0, and check that "
                           f"this host reaches {where}")
    try:
        store = tdist.TCPStore(dist.master_addr, dist.master_port, is_master=host,
                               timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)),
                               wait_for_workers=False)
    except RuntimeError as exc:  # rank 0: its port taken by another job, say
        raise RanksMissing(f"rank {dist.rank}/{dist.world_size}: cannot {'host' if host else 'join'} the rendezvous "
                           f"at {where}: {_first_line(exc)}") from None
    if agent:  # torch's own prefix for the agent's store: keys of an earlier attempt stay apart
        store = tdist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return store


def _answers(addr: str, port: int, deadline: float) -> bool:
    """Whether something listens at ``addr:port`` before ``deadline`` (asked every half second)."""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(min(deadline - time.monotonic(), 2.0), 0.1)):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
