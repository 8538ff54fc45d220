"""Time-limit signal -> checkpoint -> requeue -> resume, on a real one-node Slurm.

The signal is the one `#SBATCH --signal=B:USR1@120` makes Slurm send near the time limit, sent
now with `scancel --signal=USR1 --batch` so the test does not wait for a time limit. The
template forwards it to the ranks, they checkpoint and exit 0, the script requeues the job
(same id, same output_dir) and the second run resumes. A stand-in that follows the trainer's
contract proves the Slurm side alone; the real trainer runs the same path when it exists.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from slurm_helpers import CONTRACT_TRAINER, TRAINER_OVERRIDES, local_slurm_fixture, synth_data

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "slurm" / "cpu.sbatch"

local_slurm = pytest.fixture(scope="module")(local_slurm_fixture)


def submit(cluster, tmp_path: Path, *trainer_args: str, **env: str) -> str:
    job_env = {
        "IGA_PYTHON": sys.executable,
        "IGA_LOG_DIR": str(tmp_path / "logs"),
        "IGA_OUTPUT_DIR": str(tmp_path / "out"),
        "HF_HOME": str(tmp_path / "hf"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "IGA_SELFCHECK_ARGS": "--skip-ops",
        **env,
    }
    res = cluster.run("sbatch", "--parsable", f"--output={tmp_path}/%x-%j.out", str(TEMPLATE), *trainer_args,
                      cwd=REPO, env=job_env)
    return res.stdout.strip().split(";")[0]


def wait_for(predicate, timeout: float, what: str, cluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} not seen after {timeout:.0f} s; {cluster.logs_tail()}")


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def signal_then_wait_for_completion(cluster, job: str, progressed, timeout: float) -> str:
    wait_for(progressed, timeout, "training progress", cluster)
    assert cluster.job_field(job, "JobState") == "RUNNING"
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    # The job goes back to PENDING (Restarts=1), then runs again and completes.
    wait_for(lambda: cluster.job_field(job, "Restarts") == "1", 60, "requeue", cluster)
    return cluster.wait_done(job, timeout)[0]


def test_requeue_resumes_without_loss_or_duplication(local_slurm, tmp_path):
    trainer = tmp_path / "contract_trainer.py"
    trainer.write_text(CONTRACT_TRAINER)
    out = tmp_path / "out"
    # signals only: this test is about their way from Slurm to the ranks
    job = submit(local_slurm, tmp_path, "schedule.max_steps=30", IGA_TEST_STEP_SECONDS="0.5",
                 IGA_TEST_WATCH_STOP_FILE="0", IGA_TRAIN_SCRIPT=str(trainer))
    state = signal_then_wait_for_completion(
        local_slurm, job, lambda: len(lines(out / "steps-rank1.log")) >= 3, timeout=240)
    batch_log = (tmp_path / f"iga-cpu-{job}.out").read_text()
    assert state == "COMPLETED", batch_log
    assert "requeueing (restart 1)" in batch_log
    assert "restart 1, output" in batch_log  # the second run started
    for rank in (0, 1):
        # every step exactly once across both runs
        assert lines(out / f"steps-rank{rank}.log") == [str(s) for s in range(1, 31)]
        log = (tmp_path / "logs" / f"iga-cpu-{job}.rank{rank}.out").read_text()
        assert "SIGUSR1 -> checkpoint at step" in log, log
        resumed = [int(x.split()[-1]) for x in log.splitlines() if "resumed at step" in x]
        assert len(resumed) == 1 and 1 <= resumed[0] < 30, log
        assert log.count(f"selfcheck rank {rank}/2") == 2  # selfcheck ran first in both runs
    assert (out / "adapter" / "adapter_config.json").is_file()


def test_stop_file_reaches_ranks_that_ignore_the_signal(local_slurm, tmp_path):
    """A rank whose SIGUSR1 handler is gone still stops: the trap writes output_dir/STOP, the job
    requeues and resumes, every step runs once, and the file is gone afterwards."""
    trainer = tmp_path / "contract_trainer.py"
    trainer.write_text(CONTRACT_TRAINER)
    out = tmp_path / "out"
    job = submit(local_slurm, tmp_path, "schedule.max_steps=20", IGA_TEST_STEP_SECONDS="0.5",
                 IGA_TEST_IGNORE_USR1="1", IGA_TRAIN_SCRIPT=str(trainer))
    state = signal_then_wait_for_completion(
        local_slurm, job, lambda: len(lines(out / "steps-rank1.log")) >= 3, timeout=240)
    batch_log = (tmp_path / f"iga-cpu-{job}.out").read_text()
    assert state == "COMPLETED", batch_log
    for rank in (0, 1):
        assert lines(out / f"steps-rank{rank}.log") == [str(s) for s in range(1, 21)]
        log = (tmp_path / "logs" / f"iga-cpu-{job}.rank{rank}.out").read_text()
        assert "stop file -> checkpoint at step" in log and "SIGUSR1 ->" not in log, log
    assert not (out / "STOP").exists()


def test_no_requeue_without_signal_and_max_requeues_respected(local_slurm, tmp_path):
    trainer = tmp_path / "contract_trainer.py"
    trainer.write_text(CONTRACT_TRAINER)
    out = tmp_path / "out"
    job = submit(local_slurm, tmp_path, "schedule.max_steps=40", IGA_TEST_STEP_SECONDS="0.5",
                 IGA_TRAIN_SCRIPT=str(trainer), IGA_MAX_REQUEUES="0")
    # both ranks stepping, so both have their SIGUSR1 handler (a rank still starting would die of it)
    wait_for(lambda: all(len(lines(out / f"steps-rank{rank}.log")) >= 2 for rank in (0, 1)), 240,
             "training progress on both ranks", local_slurm)
    local_slurm.run("scancel", "--signal=USR1", "--batch", job)
    state, _ = local_slurm.wait_done(job, 120)
    batch_log = (tmp_path / f"iga-cpu-{job}.out").read_text()
    assert state == "COMPLETED" and local_slurm.job_field(job, "Restarts") == "0", batch_log
    assert "not requeueing: already requeued 0 times" in batch_log
    # stopped early with a checkpoint, no adapter: a manual resubmission would resume
    assert len(lines(out / "steps-rank0.log")) < 40
    assert json.loads((out / "checkpoint-rank0.json").read_text())["step"] >= 2


def test_requeue_with_the_real_trainer(local_slurm, tmp_path):
    out = tmp_path / "out"
    max_steps = 60
    job = submit(local_slurm, tmp_path, f"data.train={synth_data(tmp_path)}", *TRAINER_OVERRIDES,
                 f"schedule.max_steps={max_steps}")

    def metric_steps() -> list[int]:
        path = out / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]

    state = signal_then_wait_for_completion(local_slurm, job, lambda: len(metric_steps()) >= 1, timeout=900)
    batch_log = (tmp_path / f"iga-cpu-{job}.out").read_text()
    rank_logs = [(tmp_path / "logs" / f"iga-cpu-{job}.rank{r}.out").read_text() for r in (0, 1)]
    assert state == "COMPLETED", batch_log + rank_logs[0][-3000:]
    assert "requeueing (restart 1)" in batch_log
    assert metric_steps() == list(range(1, max_steps + 1))
    assert (out / "adapter" / "adapter_config.json").is_file()
    for log in rank_logs:
        assert "Traceback" not in log, log[-3000:]
