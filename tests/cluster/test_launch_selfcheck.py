"""`iga-ds selfcheck` and `iga-ds hostfile`: single process in-process, two real processes over gloo."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helpers import free_port
from iga_ds.cli import main
from iga_ds.cluster.selfcheck import run_selfcheck

REPO = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def single_process(monkeypatch):
    for var in list(os.environ):
        if var in LAUNCH_VARS or var.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_")):
            monkeypatch.delenv(var)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def test_single_process_report(single_process):
    report = run_selfcheck(require_ops=("cpu_adam",))
    assert report.ok, report.error
    assert report.dist["world_size"] == 1 and report.all_reduce is None
    assert {"python", "torch", "deepspeed", "transformers", "peft", "iga-ds"} <= set(report.versions)
    assert report.accelerator["kind"] == "cpu"
    assert {"fused_adam", "cpu_adam"} <= set(report.deepspeed_ops)
    assert report.memory["host_available_gib"] > 0


def test_missing_op_fails_with_one_line_and_exit_1(single_process, capsys):
    rc = main(["selfcheck", "--require-ops", "no_such_op"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert len(err) == 1 and err[0].startswith("iga-ds selfcheck: FAILED on rank 0/1")
    assert "no_such_op" in err[0]


def test_op_builders_moved_in_deepspeed_fail_with_one_line(single_process, monkeypatch, capsys):
    # probed through engine.internals, the one seam on DeepSpeed's internals
    import deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed.ops.op_builder.all_ops", None)  # its import fails
    assert main(["selfcheck"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("iga-ds selfcheck: FAILED on rank 0/1")
    assert f"deepspeed {deepspeed.__version__}: the op builders" in err[0]


def test_memory_floor_and_bad_timeout(single_process, capsys):
    assert main(["selfcheck", "--skip-ops", "--min-free-gib", "1e9"]) == 1
    assert "host memory free" in capsys.readouterr().err
    assert main(["selfcheck", "--timeout", "0"]) == 2  # UserError: the CLI prints it, exit 2


def test_json_output_is_one_object(single_process, capsys):
    assert main(["selfcheck", "--json", "--skip-ops"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and json.loads(out[0])["ok"] is True


def test_a_rank_with_fewer_cpus_than_its_task_asked_for_fails(single_process, monkeypatch, capsys):
    # The symptom of an srun that did not pass the job's --cpus-per-task on (Slurm >= 22.05).
    usable = len(os.sched_getaffinity(0))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(usable))
    report = run_selfcheck(check_ops=False)
    assert report.ok and report.cpus == {"usable": usable, "asked_per_task": usable}
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(usable + 1))
    assert main(["selfcheck", "--skip-ops"]) == 1
    err = capsys.readouterr().err
    assert f"may use {usable} CPU(s) but the job asks for {usable + 1} per task" in err
    assert "--cpus-per-task" in err and "Traceback" not in err


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


@pytest.mark.slow
def test_two_processes_all_reduce_over_gloo():
    port = free_port()
    cmd = [sys.executable, "-m", "iga_ds.cli", "selfcheck", "--json", "--skip-ops", "--timeout", "60"]
    procs = [subprocess.Popen(cmd, env=_rank_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err
    reports = [json.loads(out) for out, _ in outs]
    assert [r["dist"]["source"] for r in reports] == ["launcher", "launcher"]
    for r in reports:
        assert r["all_reduce"]["sum"] == 1 + 2 and r["all_reduce"]["hosts"] == [socket.gethostname()] * 2


@pytest.mark.slow
def test_missing_peer_times_out_with_a_clear_message():
    # WORLD_SIZE=2 but only rank 0 starts (e.g. every task believed it was rank 0 and one won).
    res = subprocess.run(
        [sys.executable, "-m", "iga_ds.cli", "selfcheck", "--skip-ops", "--timeout", "3"],
        env=_rank_env(0, 2, free_port()), capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("iga-ds selfcheck: FAILED on rank 0/2")
    assert "distinct ranks" in last and "Traceback" not in res.stderr


def test_hostfile_from_slurm_variables(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08],cpu1")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8(x2),2")
    out = tmp_path / "hostfile"
    assert main(["hostfile", "--output", str(out)]) == 0
    assert out.read_text() == "gpu07 slots=8\ngpu08 slots=8\ncpu1 slots=2\n"
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    assert main(["hostfile"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "gpu07 slots=4"


def test_hostfile_without_node_list_is_a_user_error(monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert main(["hostfile"]) == 2
    assert "SLURM_JOB_NODELIST" in capsys.readouterr().err
