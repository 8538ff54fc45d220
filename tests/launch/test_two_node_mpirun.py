"""launch/mpirun.sh across two nodes without Slurm, as at sites that start ranks with mpirun and
ssh: each node a network namespace with its own address and host name (tests/netns_helpers.py),
ssh replaced by a stand-in that runs the command on that node. One rank per node from the
hostfile; the rendezvous is the hostfile's first host, node1, which rank 1 reaches only across
the bridge the test built."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helpers import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def network(tmp_path):
    from netns_helpers import NodeNetwork, missing_netns_support

    why_not = missing_netns_support()
    if why_not:
        pytest.skip(why_not)
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian openmpi-bin; .ci/system-deps installs it)")
    with NodeNetwork(tmp_path / "net") as net:
        yield net


def test_mpirun_script_runs_one_rank_per_node_across_the_namespaces(network, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    agent = network.write_remote_shell(tmp_path / "remote-shell")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_")) and k not in ("MASTER_ADDR", "MASTER_PORT")}
    # a port of the test's own, not launch/mpirun.sh's default (every test takes a free one)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", IGA_PYTHON=sys.executable, MASTER_PORT=str(free_port()),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
               MPIRUN_ARGS=f"--mca plm_rsh_agent {agent} --output-filename {tmp_path / 'out'}")
    before = network.link_bytes("node2")
    command = [str(REPO / "launch" / "mpirun.sh"), "-np", "2", "--hostfile", str(hostfile), "--",
               sys.executable, "-m", "iga_ds.cli", "selfcheck", "--json", "--skip-ops", "--timeout", "60"]
    res = subprocess.run(network.argv("node1", command), cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    reports = []
    for path in sorted((tmp_path / "out").rglob("stdout")):
        reports += [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]
    reports.sort(key=lambda r: r["dist"]["rank"])
    assert [r["dist"]["rank"] for r in reports] == [0, 1], res.stdout[-3000:]
    for report in reports:
        assert report["ok"], report["error"]
        assert report["dist"]["source"] == "openmpi" and report["dist"]["world_size"] == 2
        assert report["dist"]["local_world_size"] == 1 and report["dist"]["master_addr"] == "node1"
        assert report["all_reduce"]["sum"] == 3.0 and report["all_reduce"]["hosts"] == ["node1", "node2"]
    assert [r["host"] for r in reports] == ["node1", "node2"]
    assert network.link_bytes("node2") > before  # the all-reduce crossed the bridge
