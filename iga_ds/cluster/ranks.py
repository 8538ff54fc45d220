"""Which rank am I? One answer for every way a job is started.

Order, first match wins:

1. launcher variables ``RANK``/``WORLD_SIZE`` (torchrun, the DeepSpeed pdsh/local launcher; its
   ``--local_rank`` argument is passed in by the caller);
2. ``SLURM_*`` of an ``srun`` task (``srun``, ``deepspeed --launcher slurm``, pyxis, Apptainer):
   ``deepspeed --launcher slurm`` sets no ``RANK``, so without this step every task would think it
   is rank 0;
3. ``OMPI_COMM_WORLD_*`` (Open MPI's ``mpirun``);
4. mpi4py discovery, only when mpi4py imports and an MPI launcher's PMI/PMIx variables are set
   (MPICH, Intel MPI, MVAPICH, or Open MPI when the variables above were removed).

``MASTER_ADDR``/``MASTER_PORT`` from the environment always win; otherwise the rendezvous host is
the first host of the Slurm step's node list, rank 0's host name under MPI, or 127.0.0.1 when all
ranks share one node. Without ``MASTER_PORT``, a job of one rank takes a port free on this host
(no other rank has to agree on it, and two one-GPU jobs on a machine must not meet on DeepSpeed's
default 29500); several ranks take the port derived from the Slurm job id, one rank 0 picked and
broadcast (mpi4py), or 29500.
"""
from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass, replace

from iga_ds.cluster.nodelist import expand_nodelist, expand_tasks_per_node
from iga_ds.errors import UserError

DEFAULT_MASTER_PORT = 29500
# Variables an MPI launcher sets for its processes; their presence means "started under MPI".
MPI_LAUNCHER_VARIABLES = ("PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MV2_COMM_WORLD_RANK")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, and how the ranks find each other."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "launcher", "slurm", "openmpi", "mpi4py", "single", or "initialized" (a group already up)

    def as_dict(self) -> dict:
        return asdict(self)


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value.strip())
    except ValueError:
        raise UserError(f"environment variable {name}={value!r}: expected an integer") from None


def _port(environ: Mapping[str, str], default: int) -> int:
    if "MASTER_PORT" not in environ:
        return default
    port = _int(environ, "MASTER_PORT")
    if not 1 <= port <= 65535:
        raise UserError(f"environment variable MASTER_PORT={port}: expected a TCP port 1-65535")
    return port


def slurm_default_port(job_id: str | None) -> int:
    """A port derived from the job id, so two jobs sharing a node do not fight over 29500."""
    if job_id and job_id.isdigit():
        return 20000 + int(job_id) % 10000
    return DEFAULT_MASTER_PORT


def _check(env: DistEnv, where: str) -> DistEnv:
    if env.world_size < 1:
        raise UserError(f"{where}: world size {env.world_size}, expected >= 1")
    if not 0 <= env.rank < env.world_size:
        raise UserError(f"{where}: rank {env.rank} outside 0..{env.world_size - 1}")
    if not 0 <= env.local_rank < env.local_world_size:
        raise UserError(f"{where}: local rank {env.local_rank} outside 0..{env.local_world_size - 1}")
    return env


def _from_launcher(environ: Mapping[str, str], local_rank: int | None) -> DistEnv | None:
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    if local_rank is None:
        if "LOCAL_RANK" in environ:
            local_rank = _int(environ, "LOCAL_RANK")
        elif world == 1:
            local_rank = 0
        else:
            raise UserError("RANK and WORLD_SIZE are set but LOCAL_RANK is not (nor --local_rank given)")
    # torchrun names it LOCAL_WORLD_SIZE, the DeepSpeed launcher LOCAL_SIZE.
    size_var = next((v for v in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE") if v in environ), None)
    if size_var:
        local_world = _int(environ, size_var)
    else:
        # Neither set: assume one node unless that contradicts the local rank.
        local_world = world
    addr = environ.get("MASTER_ADDR") or _fallback_master(environ, world, local_world, "RANK/WORLD_SIZE")
    return _check(
        DistEnv(rank, world, local_rank, local_world, addr, _port(environ, DEFAULT_MASTER_PORT), "launcher"),
        "launcher variables",
    )


def _fallback_master(environ: Mapping[str, str], world: int, local_world: int, what: str) -> str:
    if world == 1 or local_world == world:
        return "127.0.0.1"
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if nodelist:
        return expand_nodelist(nodelist, "SLURM_JOB_NODELIST")[0]
    raise UserError(f"{what} describe {world} ranks on several nodes but MASTER_ADDR is not set; "
                    "export MASTER_ADDR=<host of rank 0> (mpirun: -x MASTER_ADDR)")


def _from_slurm(environ: Mapping[str, str]) -> DistEnv | None:
    # Only an srun task has SLURM_STEP_ID. The batch script itself also sees SLURM_PROCID=0 and
    # SLURM_NTASKS=N, but it is one process: treating it as rank 0 of N would wait forever.
    if "SLURM_PROCID" not in environ or "SLURM_STEP_ID" not in environ:
        return None
    rank = _int(environ, "SLURM_PROCID")
    world_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    world = _int(environ, world_var) if world_var in environ else 1
    local_rank = _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
    per_node_var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if v in environ), None)
    if per_node_var:
        counts = expand_tasks_per_node(environ[per_node_var], per_node_var)
        node_id = _int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
        local_world = counts[node_id] if node_id < len(counts) else counts[-1]
    else:
        local_world = world
    nodelist_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                         if environ.get(v)), None)
    if environ.get("MASTER_ADDR"):
        addr = environ["MASTER_ADDR"]
    elif nodelist_var:
        addr = expand_nodelist(environ[nodelist_var], nodelist_var)[0]
    else:
        addr = "127.0.0.1"
    port = _port(environ, slurm_default_port(environ.get("SLURM_JOB_ID")))
    return _check(DistEnv(rank, world, local_rank, local_world, addr, port, "slurm"), "SLURM_* variables")


def _from_openmpi(environ: Mapping[str, str]) -> DistEnv | None:
    if "OMPI_COMM_WORLD_RANK" not in environ or "OMPI_COMM_WORLD_SIZE" not in environ:
        return None
    rank, world = _int(environ, "OMPI_COMM_WORLD_RANK"), _int(environ, "OMPI_COMM_WORLD_SIZE")
    local_rank = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in environ else 0
    local_world = (_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
                   if "OMPI_COMM_WORLD_LOCAL_SIZE" in environ else world)
    port = _port(environ, DEFAULT_MASTER_PORT)
    env = _check(DistEnv(rank, world, local_rank, local_world, environ.get("MASTER_ADDR", ""), port, "openmpi"),
                 "OMPI_COMM_WORLD_*")
    if env.master_addr:
        return env
    if world == local_world:
        return replace(env, master_addr="127.0.0.1")
    if _mpi4py_importable() and any(v in environ for v in MPI_LAUNCHER_VARIABLES):
        return None  # several nodes and no MASTER_ADDR: mpi4py asks rank 0 for its host
    return replace(env, master_addr=_fallback_master(environ, world, local_world, "OMPI_COMM_WORLD_* variables"))


def _mpi4py_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def _from_mpi4py(environ: Mapping[str, str]) -> DistEnv | None:
    if not any(v in environ for v in MPI_LAUNCHER_VARIABLES) or not _mpi4py_importable():
        return None
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_world = node_comm.Get_rank(), node_comm.Get_size()
    node_comm.Free()
    if environ.get("MASTER_ADDR"):
        addr = environ["MASTER_ADDR"]
    else:
        # Rank 0 names itself; on one node loopback avoids relying on name resolution.
        addr = comm.bcast("127.0.0.1" if local_world == world else socket.gethostname(), root=0)
    if "MASTER_PORT" in environ:
        port = _port(environ, DEFAULT_MASTER_PORT)
    else:
        port = comm.bcast(free_port() if rank == 0 else None, root=0)
    return _check(DistEnv(rank, world, local_rank, local_world, addr, port, "mpi4py"), "mpi4py discovery")


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous only this job will use)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _openmpi_disagrees_with_slurm(environ: Mapping[str, str]) -> bool:
    # mpirun inside an allocation starts its daemons with srun, so its ranks inherit the daemon
    # step's SLURM_* (one task per node). The innermost launcher, Open MPI, is then the truth.
    if "OMPI_COMM_WORLD_RANK" not in environ or "OMPI_COMM_WORLD_SIZE" not in environ:
        return False
    slurm_world = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS"))
    return (environ["OMPI_COMM_WORLD_SIZE"].strip() != (slurm_world or "").strip()
            or environ["OMPI_COMM_WORLD_RANK"].strip() != environ.get("SLURM_PROCID", "").strip())


def resolve_dist_env(environ: Mapping[str, str] | None = None, local_rank: int | None = None) -> DistEnv:
    """Resolve rank, world size and rendezvous from the environment (see the module docstring).

    ``local_rank`` is the ``--local_rank`` argument the DeepSpeed launcher passes to the script;
    it overrides ``LOCAL_RANK``. A process started by none of the launchers is rank 0 of 1.
    """
    environ = os.environ if environ is None else environ
    found = _from_launcher(environ, local_rank)
    if found is None and not _openmpi_disagrees_with_slurm(environ):
        found = _from_slurm(environ)
    if found is None:
        found = _from_openmpi(environ)
    if found is None:
        found = _from_mpi4py(environ)
    if found is None:
        port = _port(environ, DEFAULT_MASTER_PORT)
        found = DistEnv(0, 1, 0 if local_rank is None else local_rank, 1,
                        environ.get("MASTER_ADDR") or "127.0.0.1", port, "single")
        if found.local_rank != 0:
            raise UserError(f"--local_rank {local_rank} given but no launcher variables describe the job")
    if found.world_size == 1 and "MASTER_PORT" not in environ:
        found = replace(found, master_port=free_port())  # a lone rank: never collide with a neighbour
    return found


def apply_dist_env(env: DistEnv, environ: MutableMapping[str, str] | None = None) -> None:
    """Export the variables ``torch.distributed`` (``env://``) and ``deepspeed.init_distributed`` read.

    Also turns on NCCL's asynchronous error handling unless the user chose otherwise, so that a
    collective that fails or times out aborts the job instead of hanging it.
    """
    environ = os.environ if environ is None else environ
    environ["RANK"] = str(env.rank)
    environ["WORLD_SIZE"] = str(env.world_size)
    environ["LOCAL_RANK"] = str(env.local_rank)
    environ["LOCAL_WORLD_SIZE"] = str(env.local_world_size)
    environ["MASTER_ADDR"] = env.master_addr
    environ["MASTER_PORT"] = str(env.master_port)
    environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    environ.setdefault("NCCL_ASYNC_ERROR_HANDLING", "1")


def describe(env: DistEnv) -> str:
    """One line for logs: ``rank 1/2 (local 1/2) via slurm, rendezvous node01:21234 on host``."""
    return (f"rank {env.rank}/{env.world_size} (local {env.local_rank}/{env.local_world_size}) "
            f"via {env.source}, rendezvous {env.master_addr}:{env.master_port} on {socket.gethostname()}")


if __name__ == "__main__":  # pragma: no cover - handy inside an allocation: srun python -m ...
    print(describe(resolve_dist_env()))
    sys.exit(0)
