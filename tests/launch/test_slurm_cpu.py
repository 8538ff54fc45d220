"""slurm/cpu.sbatch on a real one-node Slurm (munged, slurmctld, slurmd on localhost).

First the plumbing alone (2 ranks, `iga-ds selfcheck`, gloo all-reduce), then the trainer for
2 ranks x 2 steps when launch/train.py and configs/tiny_cpu.yaml exist.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from slurm_helpers import TRAINER_OVERRIDES, local_slurm_fixture, synth_data

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "slurm" / "cpu.sbatch"


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory):
    """The one-node cluster, keeping a finished job's record 5 s (MinJobAge), which these tests
    read at once: `sbatch --wait` then asks for the job's state every 2 s instead of backing off
    to 32 s (tests/slurm_helpers.py)."""
    yield from local_slurm_fixture(tmp_path_factory, min_job_age=5)


def submit_wait(cluster, tmp_path: Path, *trainer_args: str, timeout: float = 480, sbatch_wait: bool = False,
                **env: str):
    """Submit the CPU template with logs and outputs under tmp_path, wait; returns (rc, job id).

    ``sbatch_wait`` uses ``sbatch --wait`` as a user would; otherwise the job is polled (quicker)."""
    job_env = {
        "IGA_PYTHON": sys.executable,
        "IGA_LOG_DIR": str(tmp_path / "logs"),
        "IGA_OUTPUT_DIR": str(tmp_path / "out"),
        # HF downloads and Triton stay in the test's folder; DeepSpeed's op builds are shared.
        "HF_HOME": str(tmp_path / "hf"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        **env,
    }
    res = cluster.run(
        "sbatch", *(["--wait"] if sbatch_wait else []), "--parsable", f"--output={tmp_path}/%x-%j.out",
        str(TEMPLATE), *trainer_args, check=False, timeout=timeout, cwd=REPO, env=job_env,
    )
    job_id = res.stdout.strip().split(";")[0]
    assert job_id.isdigit(), res.stdout + res.stderr
    if sbatch_wait:
        return res.returncode, job_id
    _state, exit_code = cluster.wait_done(job_id, timeout)
    return exit_code, job_id


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"<{path.name} missing>"


def test_cpu_template_selfcheck_two_ranks_gloo(local_slurm, tmp_path):
    rc, job = submit_wait(local_slurm, tmp_path, IGA_SELFCHECK_ONLY="1", sbatch_wait=True)
    batch_log = read(tmp_path / f"iga-cpu-{job}.out")
    rank_logs = [read(tmp_path / "logs" / f"iga-cpu-{job}.rank{r}.out") for r in (0, 1)]
    assert rc == 0, batch_log + "\n".join(rank_logs) + local_slurm.logs_tail()
    assert "selfcheck passed on all ranks" in batch_log
    for rank, log in enumerate(rank_logs):
        line = re.search(rf"selfcheck rank {rank}/2 local {rank}/2 host \S+ source slurm: (\S+).*", log)
        assert line and line.group(1) == "ok", log
        assert "all-reduce gloo sum 3 == 3" in line.group(0)
    assert "deepspeed ops usable:" in rank_logs[0]
    assert not (tmp_path / "out" / "adapter").exists()


def test_cpu_template_selfcheck_failure_fails_the_job(local_slurm, tmp_path):
    # Require an op DeepSpeed does not have: each rank fails with one line, the job stops there.
    # The step runs with --kill-on-bad-exit: the first rank to fail ends the others, so a rank
    # that reached the check later (each imports DeepSpeed on its own; on a loaded machine
    # seconds apart) may be cut by Slurm before it prints, and then its log says so
    rc, job = submit_wait(local_slurm, tmp_path, IGA_SELFCHECK_ARGS="--require-ops no_such_op --skip-ops")
    assert rc != 0
    assert "selfcheck failed" in read(tmp_path / f"iga-cpu-{job}.out")
    reported = 0
    for rank in (0, 1):
        log = read(tmp_path / "logs" / f"iga-cpu-{job}.rank{rank}.out")
        failed = f"iga-ds selfcheck: FAILED on rank {rank}/2" in log and "no_such_op" in log
        assert failed or "CANCELLED" in log, log
        assert "Traceback" not in log
        reported += failed
    assert reported >= 1
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_cpu_template_trains_two_ranks_two_steps(local_slurm, tmp_path):
    rc, job = submit_wait(local_slurm, tmp_path, f"data.train={synth_data(tmp_path)}", *TRAINER_OVERRIDES,
                          "schedule.max_steps=2", timeout=900, sbatch_wait=True)
    batch_log = read(tmp_path / f"iga-cpu-{job}.out")
    rank_logs = [read(tmp_path / "logs" / f"iga-cpu-{job}.rank{r}.out") for r in (0, 1)]
    assert rc == 0, batch_log + "\n".join(x[-3000:] for x in rank_logs)
    assert "training step ended with status 0" in batch_log
    out = tmp_path / "out"
    adapter = out / "adapter"
    assert (adapter / "adapter_config.json").is_file(), sorted(p.name for p in out.iterdir())
    assert any(adapter.glob("adapter_model.*")), sorted(p.name for p in adapter.iterdir())
    steps = [json.loads(line)["step"] for line in read(out / "metrics.jsonl").splitlines() if line.strip()]
    assert steps == [1, 2], steps
    for rank, log in enumerate(rank_logs):
        assert f"selfcheck rank {rank}/2" in log
        assert "Traceback" not in log, log[-3000:]


def test_deepspeed_slurm_launcher_gives_each_rank_its_own_rank(local_slurm, tmp_path):
    # `deepspeed --launcher slurm` exports no RANK: without SLURM_* resolution both ranks would be
    # rank 0 and the all-reduce would never complete.
    entry = tmp_path / "entry.py"
    entry.write_text("import sys\nfrom iga_ds.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    env = {"IGA_TRAIN_SCRIPT": str(entry), "IGA_PYTHON": sys.executable, "IGA_SLOTS": "2",
           "DS_ACCELERATOR": "cpu", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    res = local_slurm.run(
        "sbatch", "--parsable", "--ntasks=2", f"--output={tmp_path}/ds.out", "--wrap",
        "launch/deepspeed_slurm.sh selfcheck --skip-ops --timeout 60", cwd=REPO, env=env,
    )
    _state, exit_code = local_slurm.wait_done(res.stdout.strip().split(";")[0], 300)
    log = read(tmp_path / "ds.out")
    assert exit_code == 0, log
    assert "cmd = srun -n 2" in log  # DeepSpeed's slurm launcher, not its local one
    for rank in (0, 1):
        assert re.search(rf"selfcheck rank {rank}/2 local {rank}/2 host \S+ source slurm: ok", log), log
