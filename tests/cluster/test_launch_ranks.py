"""Rank resolution: launcher variables, then SLURM_*, then OMPI_*, then mpi4py; real processes are in
tests/launch/test_slurm_cpu.py and tests/launch/test_mpi_discovery.py, these cover the precedence
rules and the traps."""
from __future__ import annotations

import pytest
from dist_helpers import port_is_free

from iga_ds.errors import UserError
from iga_ds.cluster.ranks import DEFAULT_MASTER_PORT, DistEnv, apply_dist_env, resolve_dist_env, slurm_default_port

# What an srun task sees (copied from a real `srun -n2` on the test cluster, rank 1).
SRUN_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_NTASKS": "16",
    "SLURM_TASKS_PER_NODE": "8(x2)",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "16",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
}
# What the batch script itself sees: same job variables, but no step.
BATCH_STEP = {k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP")} | {"SLURM_PROCID": "0",
                                                                                         "SLURM_LOCALID": "0",
                                                                                         "SLURM_NODEID": "0"}
MPIRUN = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


def test_no_launcher_is_rank_zero_of_one_on_a_free_port():
    got = resolve_dist_env({})
    assert got == DistEnv(0, 1, 0, 1, "127.0.0.1", got.master_port, "single")
    # not DeepSpeed's default, which a neighbouring one-GPU job would also take
    assert got.master_port != DEFAULT_MASTER_PORT and port_is_free(got.master_port)


@pytest.mark.parametrize("env", [{"RANK": "0", "WORLD_SIZE": "1"},  # a launcher's one rank, or the
                                 # variables a first run in this process exported, MASTER_PORT gone
                                 BATCH_STEP | {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1",
                                               "SLURM_STEP_NUM_TASKS": "1", "SLURM_TASKS_PER_NODE": "1",
                                               "SLURM_STEP_TASKS_PER_NODE": "1"}])
def test_one_rank_without_master_port_takes_a_free_port(env):
    got = resolve_dist_env(env)
    assert got.world_size == 1 and got.master_port != DEFAULT_MASTER_PORT and port_is_free(got.master_port)


def test_master_port_from_the_environment_is_kept_for_one_rank_too():
    assert resolve_dist_env({"MASTER_PORT": "1234"}).master_port == 1234


def test_several_ranks_without_master_port_keep_the_shared_default():
    # the ranks must agree without talking: no free port of one host's choosing
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert resolve_dist_env(env).master_port == DEFAULT_MASTER_PORT


def test_launcher_variables_win_and_local_rank_argument_overrides_env():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_SIZE": "4",
           "MASTER_ADDR": "h0", "MASTER_PORT": "1234", **SRUN_TASK}
    got = resolve_dist_env(env, local_rank=1)
    assert got == DistEnv(5, 8, 1, 4, "h0", 1234, "launcher")


def test_launcher_without_local_rank_is_an_error_for_several_ranks():
    with pytest.raises(UserError, match="LOCAL_RANK"):
        resolve_dist_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})


def test_srun_task_uses_slurm_step_and_first_node_as_rendezvous():
    got = resolve_dist_env(SRUN_TASK)
    assert got == DistEnv(9, 16, 1, 8, "node01", slurm_default_port("4242"), "slurm")


def test_deepspeed_slurm_launcher_ranks_are_distinct():
    # `deepspeed --launcher slurm` exports MASTER_ADDR/PORT but no RANK: each task must still
    # get its own rank from SLURM_PROCID, not all be rank 0.
    ranks = set()
    for procid in range(16):
        env = SRUN_TASK | {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % 8),
                           "SLURM_NODEID": str(procid // 8), "MASTER_ADDR": "node01", "MASTER_PORT": "21234"}
        got = resolve_dist_env(env)
        assert (got.source, got.master_addr, got.master_port) == ("slurm", "node01", 21234)
        ranks.add(got.rank)
    assert ranks == set(range(16))


def test_uneven_tasks_per_node_gives_this_nodes_count():
    env = SRUN_TASK | {"SLURM_STEP_NUM_TASKS": "5", "SLURM_STEP_TASKS_PER_NODE": "3,2",
                       "SLURM_PROCID": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"}
    assert resolve_dist_env(env).local_world_size == 2


def test_batch_script_is_one_process_not_rank_zero_of_many():
    got = resolve_dist_env(BATCH_STEP)
    assert (got.rank, got.world_size, got.source) == (0, 1, "single")


def test_openmpi_alone():
    got = resolve_dist_env(MPIRUN | {"MASTER_ADDR": "h0"})
    assert got == DistEnv(3, 4, 1, 2, "h0", DEFAULT_MASTER_PORT, "openmpi")


def test_openmpi_on_one_node_needs_no_master_addr():
    env = MPIRUN | {"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert resolve_dist_env(env).master_addr == "127.0.0.1"


def test_mpirun_inside_allocation_beats_the_daemons_slurm_variables():
    # mpirun starts its daemons with one srun task per node: ranks inherit that step's SLURM_*.
    orted_step = SRUN_TASK | {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2",
                              "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    got = resolve_dist_env(orted_step | MPIRUN | {"MASTER_ADDR": "node01"})
    assert (got.rank, got.world_size, got.source) == (3, 4, "openmpi")


def test_srun_with_matching_openmpi_variables_stays_slurm():
    env = SRUN_TASK | {"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16"}
    assert resolve_dist_env(env).source == "slurm"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "rank 2 outside 0..1"),
        (SRUN_TASK | {"SLURM_STEP_TASKS_PER_NODE": "8(2)"}, "SLURM_STEP_TASKS_PER_NODE"),
        (SRUN_TASK | {"SLURM_STEP_NODELIST": "node[01-"}, "SLURM_STEP_NODELIST"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
        (MPIRUN | {"OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, "local rank 1 outside 0..0"),
    ],
)
def test_bad_variables_name_the_variable(env, message):
    with pytest.raises(UserError, match=message):
        resolve_dist_env(env)


def test_several_nodes_without_master_addr_outside_slurm_is_an_error(monkeypatch):
    import iga_ds.cluster.ranks as ranks

    monkeypatch.setattr(ranks, "_mpi4py_importable", lambda: False)
    with pytest.raises(UserError, match="MASTER_ADDR"):
        resolve_dist_env(MPIRUN)


def test_apply_then_resolve_round_trips_and_sets_nccl_error_handling():
    original = resolve_dist_env(SRUN_TASK)
    exported: dict[str, str] = {"NCCL_ASYNC_ERROR_HANDLING": "0"}
    apply_dist_env(original, exported)
    assert exported["RANK"] == "9" and exported["MASTER_ADDR"] == "node01"
    assert exported["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert exported["NCCL_ASYNC_ERROR_HANDLING"] == "0"  # the user's choice is kept
    again = resolve_dist_env(exported)
    assert (again.rank, again.world_size, again.local_rank, again.local_world_size,
            again.master_addr, again.master_port) == (9, 16, 1, 8, "node01", original.master_port)


def test_slurm_default_port_differs_between_jobs_and_stays_in_range():
    ports = {slurm_default_port(str(j)) for j in range(1000, 1010)}
    assert len(ports) == 10 and all(20000 <= p < 30000 for p in ports)
    assert slurm_default_port(None) == DEFAULT_MASTER_PORT
