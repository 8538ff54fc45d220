"""slurm/cpu.sbatch on a real two-node Slurm: each node a network namespace with its own address,
host name and slurmd (tests/netns_helpers.py, tests/slurm_helpers.py), slurmctld in a third.

The template runs as users copy it. What the test sets: on the sbatch line `--nodes=2`,
`--cpus-per-task=2` and `--output` (the batch log in the test's folder); in the environment
`IGA_PYTHON` (this interpreter), `IGA_LOG_DIR`, `IGA_OUTPUT_DIR`, `HF_HOME` and `TRITON_CACHE_DIR`
(the test's folder), `IGA_SELFCHECK_ARGS=--skip-ops` (no DeepSpeed op probes),
`OMP_WAIT_POLICY=PASSIVE`, and for the powered-off node `IGA_DS_CONFIG` (a copy of the default
with a short peer timeout); the trainer's `key=value` arguments name the data, the steps and the
checkpoints. One gloo rank per node, with the 2 CPUs of its node; the rendezvous is node1 at its
address in its namespace, and rank 1 can reach it only across the bridge the test built.

- trained with the real trainer, stopped by the time-limit signal, requeued and resumed on both
  nodes: every step logged once, each rank's selfcheck saw 2 CPUs, and the adapter equals a
  single-process run of the same config within 1e-5 (fp32);
- node2 powered off mid-run (its link goes silent, then everything on it dies): rank 0 names the
  lost rank within the configured peer timeout; every `step_*` folder is a complete checkpoint,
  `latest` names one, and the next save's clean-up leaves no unfinished one.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_helpers import synth_data, two_node_slurm_fixture

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "slurm" / "cpu.sbatch"
MAX_STEPS = 20  # the time-limit signal goes out after step 1; the stop lands a few steps later
# every CPU of a node (tests/slurm_helpers.py gives each 2): more than the template's 1, so a rank
# bound to one CPU shows that srun did not pass the job's --cpus-per-task on
CPUS_PER_RANK = 2
PEER_TIMEOUT_S = 8

cluster = pytest.fixture(scope="function")(two_node_slurm_fixture)


@pytest.fixture(scope="module")
def train_data(tmp_path_factory) -> str:
    from iga_ds.train.pretrain import default_tiny_base

    default_tiny_base(progress=False, log=lambda *_: None)  # built once here, not by both nodes at once
    return synth_data(tmp_path_factory.mktemp("data"))


@pytest.fixture
def processes():
    """Processes a test starts beside the cluster; killed at the end if still running."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def submit(cluster, tmp_path: Path, *trainer_args: str, **env: str) -> str:
    """The template as a user submits it, on both nodes (its 2 ranks, ``CPUS_PER_RANK`` each)."""
    job_env = {
        "IGA_PYTHON": sys.executable,
        "IGA_LOG_DIR": str(tmp_path / "logs"),
        "IGA_OUTPUT_DIR": str(tmp_path / "out"),
        "HF_HOME": str(tmp_path / "hf"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "IGA_SELFCHECK_ARGS": "--skip-ops",
        # both nodes' CPUs are the same 2 cores of this machine: OpenMP threads that spin while
        # waiting would take them from the other rank
        "OMP_WAIT_POLICY": "PASSIVE",
        **env,
    }
    res = cluster.run("sbatch", "--parsable", "--nodes=2", f"--cpus-per-task={CPUS_PER_RANK}",
                      f"--output={tmp_path}/%x-%j.out", str(TEMPLATE), *trainer_args, cwd=REPO, env=job_env)
    return res.stdout.strip().split(";")[0]


def wait_for(predicate, timeout: float, what: str, cluster) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.2)
    raise TimeoutError(f"{what} not seen after {timeout:.0f} s; {cluster.logs_tail()}")


def metric_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:  # the line being written now
            break
    return steps


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"<{path.name} missing>"


def bridge_bytes(cluster, node: str) -> int:
    return cluster.network.link_bytes(node)


def check_ranks_on_their_nodes(logs: list[str], cpus: int) -> None:
    for rank, log in enumerate(logs):
        # one rank per node, each bound to the CPUs of its task (the selfcheck's count of the CPUs
        # it may run on), rendezvous at node1
        head = re.findall(rf"selfcheck rank {rank}/2 local 0/1 host (\S+) source slurm: ok .* cpus (\d+)", log)
        assert head and all(h == (f"node{rank + 1}", str(cpus)) for h in head), log[-3000:]
    assert re.search(r"rendezvous: node1:\d+", logs[0]), logs[0][-3000:]
    assert "ranks on hosts: node1, node2" in logs[0]


def start_single_process_run(tmp_path: Path, *trainer_args: str) -> subprocess.Popen:
    """The same config in one process, without any launcher (rank 0 of 1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf-single"))
    return subprocess.Popen([sys.executable, "launch/train.py", "--config", "configs/tiny_cpu.yaml",
                             "--deepspeed", "ds_configs/zero2_fp32.json", *trainer_args,
                             f"output_dir={tmp_path / 'single'}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_train_requeue_resume_and_match_one_process(cluster, tmp_path, train_data, processes):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "out"
    before = bridge_bytes(cluster, "node2")
    args = (f"data.train={train_data}", f"schedule.max_steps={MAX_STEPS}")
    job = submit(cluster, tmp_path, *args)
    wait_for(lambda: len(metric_steps(out)) >= 1, 300, "a first step", cluster)
    cluster.run("scancel", "--signal=USR1", "--batch", job)  # as Slurm does before the time limit
    single = start_single_process_run(tmp_path, *args)  # meanwhile: the requeued job waits its turn
    processes.append(single)
    wait_for(lambda: cluster.job_field(job, "Restarts") == "1", 120, "the requeue", cluster)
    state, exit_code = cluster.wait_done(job, 300)
    batch_log = read(tmp_path / f"iga-cpu-{job}.out")
    logs = [read(tmp_path / "logs" / f"iga-cpu-{job}.rank{r}.out") for r in (0, 1)]
    assert (state, exit_code) == ("COMPLETED", 0), batch_log + logs[0][-3000:] + logs[1][-3000:]
    assert batch_log.count("start on node[1-2]: 2 ranks") == 2 and "requeueing (restart 1)" in batch_log
    resumed = re.findall(r"resumed from \S+ at step (\d+)", logs[0])
    assert len(resumed) == 1 and 1 <= int(resumed[0]) < MAX_STEPS, logs[0][-3000:]
    assert metric_steps(out) == list(range(1, MAX_STEPS + 1))  # every step once across both runs
    for log in logs:
        assert log.count("selfcheck rank") == 2 and "Traceback" not in log, log[-3000:]
    check_ranks_on_their_nodes(logs, cpus=CPUS_PER_RANK)
    # the ranks talked across the bridge: node2 has no other way to node1
    assert bridge_bytes(cluster, "node2") - before > 1_000_000

    single_log = single.communicate(timeout=300)[0]
    assert single.returncode == 0, single_log[-3000:]
    two_nodes = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    one = load_file(str(tmp_path / "single" / "adapter" / "adapter_model.safetensors"))
    assert two_nodes.keys() == one.keys() and any(k.endswith("lora_B.weight") for k in one)
    for key in one:
        assert two_nodes[key].dtype == torch.float32
        torch.testing.assert_close(two_nodes[key], one[key], rtol=0, atol=1e-5, msg=key)
    assert any(one[k].abs().max() > 1e-3 for k in one if k.endswith("lora_B.weight"))  # training moved it


def complete_checkpoint(folder: Path, world: int = 2) -> list[str]:
    """What a checkpoint folder lacks to resume on ``world`` ranks (empty: complete)."""
    missing = [name for name in ("meta.json", "optimizer_full.safetensors", "adapter/adapter_model.safetensors")
               if not (folder / name).is_file()]
    missing += [f"rng rank {r}" for r in range(world) if not (folder / f"rng_rank{r:05d}.pt").is_file()]
    zero = sorted(folder.glob("*optim_states.pt"))
    if len(zero) != world:
        missing.append(f"ZeRO optimizer partitions ({len(zero)} of {world})")
    if not list(folder.glob("*model_states.pt")):
        missing.append("model states")
    return missing


def test_a_powered_off_node_is_named_within_the_peer_timeout(cluster, tmp_path, train_data):
    from iga_ds.train.checkpoint import PARTIAL_PREFIX, TAG_PREFIX, remove_partial_checkpoints

    ds = json.loads((REPO / "ds_configs" / "zero2_fp32.json").read_text())
    ds["iga"]["timeout_s"] = PEER_TIMEOUT_S  # the configured timeout: the hook's collectives and the peer watch
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "out"
    job = submit(cluster, tmp_path, f"data.train={train_data}", "schedule.max_steps=100000",
                 "checkpoint.every_steps=1", "checkpoint.keep_last=2", IGA_DS_CONFIG=str(tmp_path / "ds.json"))
    wait_for(lambda: len(metric_steps(out)) >= 2, 300, "two steps", cluster)
    rank0_log = tmp_path / "logs" / f"iga-cpu-{job}.rank0.out"
    cluster.power_off("node2")
    seconds = wait_for(lambda: "lost contact with rank 1 on node2" in read(rank0_log), 120,
                       "rank 0 naming the lost rank", cluster)
    log = read(rank0_log)
    assert seconds < PEER_TIMEOUT_S + 5, f"{seconds:.1f} s; {log[-2000:]}"
    line = next(x for x in log.splitlines() if "lost contact with rank 1 on node2" in x)
    assert "rank 0/2 on node1" in line and f"peer timeout is {PEER_TIMEOUT_S} s" in line, line
    # rank 0 ended: nothing of the trainer still runs on node1
    wait_for(lambda: not trainer_processes(cluster, "node1"), 30, "rank 0 to end", cluster)
    ckpts = out / "checkpoints"
    latest = (ckpts / "latest").read_text().strip()
    assert int(latest.split("_")[-1]) <= max(metric_steps(out))
    # a save the power-off cut short is only a partial-* folder: every step_* folder is whole
    steps = sorted(ckpts.glob(f"{TAG_PREFIX}*"))
    assert ckpts / latest in steps
    assert {folder.name: complete_checkpoint(folder) for folder in steps} == {folder.name: [] for folder in steps}
    assert not list(ckpts.glob(f"{TAG_PREFIX}*/**/*.tmp"))
    # and the next run's first save removes it before writing
    remove_partial_checkpoints(ckpts)
    assert sorted(ckpts.glob(f"{TAG_PREFIX}*")) == steps and not list(ckpts.glob(f"{PARTIAL_PREFIX}*"))
    cluster.run("scancel", job, check=False)


def trainer_processes(cluster, node: str) -> list[int]:
    """Trainer ranks still running on ``node`` (the Python processes, not the srun that started them)."""
    found = []
    for pid in cluster.network.pids(node):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(cmdline[0].decode()).name.startswith("python") and any(
                part.endswith(b"launch/train.py") for part in cmdline):
            found.append(pid)
    return found


def test_namespaces_left_by_a_killed_test_run_are_removed():
    """A test process killed before its clean-up leaves namespaces behind; the next run removes
    those whose creator is gone, and only those."""
    from netns_helpers import NAME_PREFIX, missing_netns_support, sweep_stale_namespaces

    why_not = missing_netns_support()
    if why_not:
        pytest.skip(why_not)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names no process
    stale, alive = f"{NAME_PREFIX}{dead.pid}xabc-node1", f"{NAME_PREFIX}{os.getpid()}xabc-node1"
    for name in (stale, alive):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        removed = sweep_stale_namespaces()
        listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True, timeout=30).stdout
        assert stale in removed and stale not in listed
        assert alive not in removed and alive in listed
    finally:
        for name in (stale, alive):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def test_system_deps_installs_every_tool_the_nodes_are_built_with():
    """A tool .ci/system-deps neither checks nor installs would turn the two-node tests into skips on CI."""
    from netns_helpers import TOOL_PACKAGES

    script = (REPO / ".ci" / "system-deps").read_text()
    checked = re.search(r"^needed=\((.*)\)$", script, re.MULTILINE).group(1).split()
    joined = script.replace("\\\n", " ")  # continued lines as one
    installed = re.search(r"^apt-get install (.*)$", joined, re.MULTILINE).group(1).split()
    assert set(TOOL_PACKAGES) <= set(checked), set(TOOL_PACKAGES) - set(checked)
    assert set(TOOL_PACKAGES.values()) <= set(installed), set(TOOL_PACKAGES.values()) - set(installed)
