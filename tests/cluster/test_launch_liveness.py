"""iga_ds.cluster.liveness with real gloo processes: a rank that goes silent (SIGSTOP: its sockets
stay open and nothing answers, as when a node dies) or crashes (SIGKILL: its kernel resets the
connections) is named by the others within the timeout; a rank that finished early, or a failure
that no lost rank explains, raises no alarm. tests/launch/test_two_node_slurm.py powers off a node of a
real two-node Slurm."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dist_helpers import free_port
from iga_ds.cluster.liveness import EXIT_PEER_LOST

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2.0
INTERVAL_S = 0.25

WORKER = textwrap.dedent("""
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    from iga_ds.cluster.liveness import PeerWatch
    from iga_ds.cluster.ranks import resolve_dist_env
    from iga_ds.errors import UserError

    timeout, interval = float(sys.argv[1]), float(sys.argv[2])
    env = resolve_dist_env()
    # the process group's own timeout is long: only the watch can end the wait in time
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    watch = PeerWatch(env, timeout, interval).start()
    pair = dist.new_group([0, 1])
    if env.rank == 2:  # finished early, and said so
        watch.stop()
        os._exit(0)
    if env.rank == 1 and env.world_size == 3:
        # a failure while every rank still beats (or has left) is not blamed on anyone
        watch.raise_if_lost(RuntimeError("an error that is not about a lost rank"))
        print("no alarm", flush=True)
    print("ready", flush=True)
    try:
        while True:
            dist.all_reduce(torch.ones(4), group=pair)
            time.sleep(0.01)
    except Exception as exc:
        try:
            watch.raise_if_lost(exc)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            os._exit(err.exit_code)
        print(f"not a lost rank: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
""")


def start_ranks(tmp_path: Path, world: int) -> list[subprocess.Popen]:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, str(worker), str(TIMEOUT_S), str(INTERVAL_S)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait_line(proc: subprocess.Popen, expected: str) -> None:
    line = proc.stdout.readline()
    assert line.strip() == expected, line + proc.stderr.read()


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    start = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out + err, time.monotonic() - start


@pytest.fixture
def ranks(tmp_path):
    procs: list[subprocess.Popen] = []
    yield lambda world: procs.extend(start_ranks(tmp_path, world)) or procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # also ends a stopped process
            proc.wait()


def test_silent_store_host_is_named_and_a_rank_that_left_is_not(ranks):
    """Rank 2 finishes early; rank 1 sees a failure that no lost rank explains; then rank 0, which
    hosts the heartbeat store, goes silent while rank 1 waits for it in a collective."""
    procs = ranks(3)
    wait_line(procs[1], "no alarm")
    wait_line(procs[0], "ready")
    wait_line(procs[1], "ready")
    assert procs[2].wait(timeout=30) == 0
    time.sleep(0.3)
    os.kill(procs[0].pid, signal.SIGSTOP)
    rc, log, seconds = finish(procs[1], timeout=30)
    assert rc == EXIT_PEER_LOST, log
    assert f"rank 1/3 on {socket.gethostname()} lost contact with rank 0 on {socket.gethostname()}" in log, log
    assert "rank 2" not in log and "Traceback" not in log, log
    assert seconds < TIMEOUT_S + 4 * INTERVAL_S + 2, seconds


def test_a_crashed_rank_is_named_when_the_collective_fails(ranks):
    procs = ranks(2)
    for proc in procs:
        wait_line(proc, "ready")
    time.sleep(0.3)
    procs[1].kill()  # its kernel resets the connections: the collective fails at once
    rc, log, seconds = finish(procs[0], timeout=30)
    assert rc == EXIT_PEER_LOST, log
    assert "rank 0/2" in log and "lost contact with rank 1" in log and "the collective failed with:" in log, log
    assert seconds < TIMEOUT_S + 4 * INTERVAL_S + 2, seconds
