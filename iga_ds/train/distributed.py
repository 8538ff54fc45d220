"""The process group of a training run: ranks from any launcher, then DeepSpeed's init."""
from __future__ import annotations

import os

import torch
import torch.distributed as tdist

from iga_ds.cluster.ranks import DistEnv, apply_dist_env, resolve_dist_env
from iga_ds.config.deepspeed import use_cpu
from iga_ds.engine.internals import disable_cpu_shm_comm_op, forget_world_group


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


def init_distributed(dist: DistEnv) -> None:
    """gloo on the CPU, NCCL on GPUs; this rank's GPU is its local rank."""
    cpu = use_cpu()
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the first deepspeed import
    import deepspeed  # after DS_ACCELERATOR, which DeepSpeed reads when first imported

    if not cpu:
        torch.cuda.set_device(dist.local_rank)
    elif not os.environ.get("IGA_DS_CPU_SHM_OP"):
        disable_cpu_shm_comm_op()
    if not tdist.is_initialized():
        forget_world_group()  # a group of an earlier run in this process is gone with it
        deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl", auto_mpi_discovery=False, verbose=False)
