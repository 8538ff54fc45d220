"""Real Slurm clusters for tests: munged, slurmctld and slurmd in a temp dir.

:class:`LocalSlurm` is one node on localhost; :class:`NamespacedSlurm` puts each node in its own
network namespace with its own address and host name (tests/netns_helpers.py), so a job spans
"nodes" that talk to each other only across a bridge the test built.

Debian's ``slurm-wlm`` and ``munge`` are enough (``.ci/system-deps`` installs them). Everything the
daemons write (key, sockets, state, spool, logs) stays under the given directory; ports are picked
free so that two test runs on one machine do not collide. Clients reach this cluster through the
``SLURM_CONF`` variable in :attr:`LocalSlurm.env`.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dist_helpers import free_port, port_is_free

DAEMONS = ("munged", "slurmctld", "slurmd")
FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED"}
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")



def synth_data(tmp_path: Path) -> str:
    """A small isomer data set from the project's own generator (no external data)."""
    out = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "iga_ds.cli", "data", "synth", "--out", str(out), "--groups", "40",
                    "--no-progress"], check=True, capture_output=True, timeout=120,
                   cwd=Path(__file__).resolve().parents[1])
    return str(out / "train.jsonl")


# 2 ranks x 2 groups per micro-batch = the tiny config's 4 groups per step
TRAINER_OVERRIDES = ()  # the template trains its default config as documented

def missing_slurm_tools() -> list[str]:
    """Names of the programs this module needs that are not on PATH (empty when all are)."""
    search = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [name for name in DAEMONS + CLIENTS if shutil.which(name, path=search) is None]


def _which(name: str) -> str:
    search = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    found = shutil.which(name, path=search)
    if found is None:
        raise FileNotFoundError(name)
    return found


def _total_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 2048


SLURM_CONF = """\
# Minimal one-node cluster for the test suite; written by tests/slurm_helpers.py.
ClusterName=igatest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
# Job ids from here on: a job's rendezvous port is 20000 + its id % 10000 (slurm/job_lib.sh,
# launch/deepspeed_slurm.sh), so two clusters both counting from 1 would meet on one port.
FirstJobId={first_job_id}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long before it may start again (Slurm's default, 120 s,
# would make the requeue test slow).
AuthInfo=socket={munge_socket},cred_expire=10
SlurmUser={user}
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# Look for startable jobs every 2 s, not every 60 s, so a requeued job starts promptly.
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# Use the CPU count below even when the machine has fewer cores: tests need 2 tasks.
SlurmdParameters=config_overrides
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
# How long a finished job's record stays (the tests read its fields after it ends). It also sets
# how often `sbatch --wait` asks for the job's state: every 2 s where it is at most 5, else every
# 2, then 8, then 32 s (Slurm's _job_wait), so that a job of 12 s returns after 42. 600 unless
# LocalSlurm(min_job_age=...) says otherwise.
MinJobAge={min_job_age}
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


JOB_PORT_BASE = 20000  # a job's rendezvous port: JOB_PORT_BASE + its id % 10000
JOB_IDS = 64  # job ids one test cluster may use, each with its port free when the cluster starts


def first_job_id() -> int:
    """A first job id whose jobs' rendezvous ports are free now: each pytest-xdist worker draws
    from its own thousand ids, so two workers' clusters never share one."""
    import random

    worker = int("".join(c for c in os.environ.get("PYTEST_XDIST_WORKER", "") if c.isdigit()) or 0)
    low = 1000 * (worker % 9) + 1
    for _ in range(200):
        first = random.randrange(low, low + 1000 - JOB_IDS)
        if all(port_is_free(JOB_PORT_BASE + (first + i) % 10000) for i in range(JOB_IDS)):
            return first
    return first  # a busy machine: the last draw, as good as any


class LocalSlurm:
    """Start and stop a one-node Slurm rooted at ``root``. Use as a context manager."""

    stop_grace_s = 15.0  # how long stop() waits for a daemon after SIGTERM before SIGKILL

    def __init__(self, root: str | os.PathLike, cpus: int | None = None, min_job_age: int = 600):
        self.root = Path(root)
        self.cpus = max(cpus or os.cpu_count() or 2, 4)
        self.min_job_age = min_job_age  # seconds a finished job stays queryable (MinJobAge)
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "LocalSlurm":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        for sub in ("munge", "state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        self._start_munged()
        self.conf.write_text(
            SLURM_CONF.format(
                host=self.host,
                ctld_port=free_port(),
                slurmd_port=free_port(),
                first_job_id=first_job_id(),
                munge_socket=self.munge_socket,
                user=_current_user(),
                root=self.root,
                cpus=self.cpus,
                memory=max(_total_memory_mb() - 1024, 1024),
                min_job_age=self.min_job_age,
            )
        )
        self._spawn([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        self._spawn([_which("slurmd"), "-D", "-N", self.host, "-f", str(self.conf)], "slurmd.out")
        self.wait_idle(timeout)

    def stop(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    # -- clients -----------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client (``sbatch``, ``scontrol`` ...) against this cluster."""
        env = dict(self.env, **kw.pop("env", {}))
        return subprocess.run(
            [_which(argv[0]), *argv[1:]], env=env, check=check, timeout=timeout,
            capture_output=True, text=True, **kw,
        )

    def job_field(self, job_id: str, field: str) -> str:
        """One ``Key=Value`` field of ``scontrol show job``, e.g. ``JobState`` or ``Restarts``."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        for token in out.split():
            key, _, value = token.partition("=")
            if key == field:
                return value
        raise KeyError(f"{field} not in scontrol output: {out!r}")

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_field(job_id, "JobState")
            if state in states:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s; {self.logs_tail()}")

    def wait_done(self, job_id: str, timeout: float) -> tuple[str, int]:
        """Poll until the job ends (faster than ``sbatch --wait``, which backs off to 30 s polls).

        Returns the final state and the batch script's exit code."""
        state = self.wait_state(job_id, FINISHED_STATES, timeout)
        return state, int(self.job_field(job_id, "ExitCode").split(":")[0])

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            res = self.run("sinfo", "-h", "-o", "%T", check=False, timeout=10)
            last = (res.stdout + res.stderr).strip()
            if res.returncode == 0 and last.startswith("idle"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm node not idle after {timeout:.0f} s (sinfo: {last!r}); {self.logs_tail()}")

    def logs_tail(self, lines: int = 15) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.root / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- internals ---------------------------------------------------------------------------
    def _start_munged(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        subprocess.run(
            [
                _which("munged"), "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--log-file={self.root / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
            check=True, capture_output=True, timeout=30,
        )
        self._munge_pid_file = self.root / "munge" / "munged.pid"
        # munged daemonizes itself; keep a handle through its pid file for stop().
        pid = int(self._munge_pid_file.read_text().strip())
        self._procs.insert(0, _PidHandle(pid))

    def _spawn(self, argv: list[str], log_name: str) -> None:
        log = open(self.root / log_name, "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)
        log.close()
        self._procs.append(proc)

    def _check_alive(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}; {self.logs_tail()}")


class _PidHandle:
    """Minimal Popen look-alike for a daemon that forked away from us (munged)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.args = ["munged", f"pid {pid}"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = 0
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout or 0)
        while self.poll() is None:
            if timeout is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.1)
        return self.returncode or 0

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _current_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


# A stand-in that follows the trainer's contract (--config, --deepspeed and KEY=VALUE overrides
# read by the real config loader, output_dir, resume=auto, SIGUSR1/SIGTERM or output_dir/STOP ->
# checkpoint and exit 0) in a few lines, so the Slurm signal, requeue and resume plumbing is
# tested on its own; the real trainer is tested the same way (test_requeue_with_the_real_trainer).
# A wrong key fails here as it fails the real trainer. Its own knobs come from the environment:
# IGA_TEST_STEP_SECONDS, IGA_TEST_IGNORE_USR1=1 (a rank whose SIGUSR1 handler is gone: the stop
# file must reach it), IGA_TEST_WATCH_STOP_FILE=0 (one that sees only signals).
CONTRACT_TRAINER = r'''
import argparse, json, os, signal, sys, time
from iga_ds.cluster.ranks import resolve_dist_env
from iga_ds.config.run import load_run_config
from iga_ds.errors import UserError

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--deepspeed")
parser.add_argument("overrides", nargs="*")
cli = parser.parse_args()
try:
    cfg = load_run_config(cli.config, cli.overrides + ([f"deepspeed={cli.deepspeed}"] if cli.deepspeed else []))
except UserError as exc:
    print(f"launch/train.py: error: {exc}", file=sys.stderr)
    sys.exit(exc.exit_code)
out = cfg.output_dir
max_steps = cfg.schedule.max_steps or 4
step_seconds = float(os.environ.get("IGA_TEST_STEP_SECONDS", "1"))
env = resolve_dist_env()
os.makedirs(out, exist_ok=True)
ckpt = os.path.join(out, f"checkpoint-rank{env.rank}.json")
stop = []
if os.environ.get("IGA_TEST_IGNORE_USR1") == "1":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
else:
    signal.signal(signal.SIGUSR1, lambda *_: stop.append("SIGUSR1"))
signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))
step = 0
if cfg.resume == "auto" and os.path.exists(ckpt):
    step = json.load(open(ckpt))["step"]
    print(f"rank {env.rank}: resumed at step {step}", flush=True)
print(f"rank {env.rank}/{env.world_size} via {env.source}: starting at step {step}", flush=True)
while step < max_steps:
    if not stop and os.environ.get("IGA_TEST_WATCH_STOP_FILE") != "0" and os.path.exists(os.path.join(out, "STOP")):
        stop.append("stop file")
    if stop:
        # the contract: a stopping rank ignores repeats of the request (the job script signals
        # just after writing the stop file); Python restores the default action, death, at exit
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        tmp = ckpt + ".tmp"
        json.dump({"step": step}, open(tmp, "w"))
        os.replace(tmp, ckpt)
        print(f"rank {env.rank}: {stop[0]} -> checkpoint at step {step}, exiting", flush=True)
        sys.exit(0)
    time.sleep(step_seconds)
    step += 1
    with open(os.path.join(out, f"steps-rank{env.rank}.log"), "a") as f:
        f.write(f"{step}\n")
if env.rank == 0:
    os.makedirs(os.path.join(out, "adapter"), exist_ok=True)
    json.dump({"steps": step}, open(os.path.join(out, "adapter", "adapter_config.json"), "w"))
print(f"rank {env.rank}: done after step {step}", flush=True)
'''


TWO_NODE_CONF = """\
# A cluster of network namespaces on one machine; written by tests/slurm_helpers.py.
ClusterName=igatest
SlurmctldHost={ctl_name}({ctl_address})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=10
SlurmUser={user}
SlurmdUser=root
StateSaveLocation={root}/state
# %n: each slurmd its own spool, pid and log file
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
# task/affinity pins each task to the CPUs its step was given: a rank that srun gives one CPU
# sees one CPU, as on a production cluster
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout={slurmd_timeout}
InactiveLimit=0
KillWait=10
MinJobAge=600
{node_lines}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""


class NamespacedSlurm(LocalSlurm):
    """Slurm on a :class:`netns_helpers.NodeNetwork`: slurmctld in the hub namespace, one slurmd
    per node namespace, each at its own address. munged runs on the machine itself: its socket
    is a filesystem path, which every namespace shares. Clients (``run``) run in the hub.

    The node's CPUs are its first ``cpus_per_node`` processors, bound through task/affinity."""

    # after a node is powered off, slurmd and slurmctld would wait for it; their state is thrown away
    stop_grace_s = 3.0

    def __init__(self, root: str | os.PathLike, network, cpus_per_node: int = 2, slurmd_timeout: int = 30):
        super().__init__(root, cpus=cpus_per_node)
        self.cpus = cpus_per_node
        self.network = network
        self.slurmd_timeout = slurmd_timeout
        self.nodes = [node.name for node in network.nodes]
        self._slurmd: dict[str, subprocess.Popen] = {}

    def start(self, timeout: float = 60.0) -> None:
        for sub in ("munge", "state", *(f"spool/{name}" for name in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        self._start_munged()
        node_lines = "\n".join(
            f"NodeName={n.name} NodeAddr={n.address} CPUs={self.cpus} Boards=1 SocketsPerBoard=1 "
            f"CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory=1024 State=UNKNOWN"
            for n in self.network.nodes)
        self.conf.write_text(TWO_NODE_CONF.format(
            ctl_name=self.network.hub.name, ctl_address=self.network.hub.address, munge_socket=self.munge_socket,
            user=_current_user(), root=self.root, slurmd_timeout=self.slurmd_timeout, node_lines=node_lines,
            node_names=",".join(self.nodes)))
        self._spawn(self.network.argv(self.network.hub.name, [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)]),
                    "slurmctld.out")
        for name in self.nodes:
            self.start_node(name)
        self.wait_idle(timeout)

    def start_node(self, name: str) -> None:
        """Start (or restart, after :meth:`power_off`) the slurmd of node ``name``."""
        self._spawn(self.network.argv(name, [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)]),
                    f"slurmd-{name}.out")
        self._slurmd[name] = self._procs[-1]

    def power_off(self, name: str) -> None:
        """Node ``name`` fails: its link goes silent, then its slurmd and every job process on it die."""
        self.network.power_off(name)
        self._slurmd[name].wait(timeout=15)
        self._procs.remove(self._slurmd.pop(name))

    def run(self, *argv: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        env = dict(self.env, **kw.pop("env", {}))
        return subprocess.run(
            self.network.argv(self.network.hub.name, [_which(argv[0]), *argv[1:]]), env=env, check=check,
            timeout=timeout, capture_output=True, text=True, **kw,
        )

    def node_states(self) -> dict[str, str]:
        res = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10)
        return dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            states = self.node_states()
            if sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s ({states}); {self.logs_tail()}")

    def logs_tail(self, lines: int = 15) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)


def local_slurm_fixture(tmp_path_factory, min_job_age: int = 600):
    """Body of the module-scoped ``local_slurm`` fixture: skip cleanly where Slurm is absent."""
    import pytest

    missing = missing_slurm_tools()
    if missing:
        pytest.skip(f"Slurm not installed (missing {', '.join(missing)}); "
                    "Debian slurm-wlm and munge, installed on CI by .ci/system-deps")
    root = tmp_path_factory.mktemp("slurm")
    with LocalSlurm(root, min_job_age=min_job_age) as cluster:
        yield cluster


def two_node_slurm_fixture(tmp_path_factory, slurmd_timeout: int = 30):
    """Body of a module-scoped fixture: a :class:`NamespacedSlurm` of two nodes, skipped cleanly
    where Slurm or network namespaces are missing; daemons and namespaces go away at the end,
    also when a test or the start fails."""
    import pytest

    from netns_helpers import NodeNetwork, missing_netns_support

    missing = missing_slurm_tools()
    if missing:
        pytest.skip(f"Slurm not installed (missing {', '.join(missing)}); "
                    "Debian slurm-wlm and munge, installed on CI by .ci/system-deps")
    why_not = missing_netns_support()
    if why_not:
        pytest.skip(f"two-node Slurm: {why_not}")
    root = tmp_path_factory.mktemp("slurm2")
    with NodeNetwork(root / "net") as network, NamespacedSlurm(root, network, slurmd_timeout=slurmd_timeout) as cluster:
        yield cluster
