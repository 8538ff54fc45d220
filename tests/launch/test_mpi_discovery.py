"""`mpirun -np 2` with Debian's Open MPI: ranks from OMPI_COMM_WORLD_* and, with those removed,
through mpi4py discovery; each path ends in a real gloo all-reduce (``iga-ds selfcheck``)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dist_helpers import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mpi_env():
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian openmpi-bin; .ci/system-deps installs it)")
    if importlib.util.find_spec("mpi4py") is None:
        if shutil.which("mpicc") is None:
            pytest.skip("mpi4py not installed and libopenmpi-dev (mpicc) absent to build it")
        # mpi4py is in the package's `mpi` extra; install it here only where Open MPI is present.
        res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "mpi4py>=3.1"],
                             capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            pytest.skip(f"pip install mpi4py failed: {res.stderr.strip().splitlines()[-1:]}")
        importlib.invalidate_caches()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               IGA_PYTHON=sys.executable)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    if os.getuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _reports(out_dir: Path) -> list[dict]:
    """Each rank's JSON report, from the per-rank files of mpirun --output-filename (the
    forwarded stdout of two ranks can interleave on one line)."""
    reports = []
    for path in sorted(out_dir.rglob("stdout")):
        reports += [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return sorted(reports, key=lambda r: r["dist"]["rank"])


def _assert_two_ranks_reduced(reports: list[dict], source: str) -> None:
    assert [r["dist"]["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["ok"], r["error"]
        assert r["dist"]["source"] == source and r["dist"]["world_size"] == 2
        # each rank contributes rank + 1: 1 + 2
        assert r["all_reduce"]["sum"] == 3.0
    assert reports[0]["dist"]["master_port"] == reports[1]["dist"]["master_port"]


def test_mpirun_script_runs_selfcheck_through_openmpi_variables(mpi_env, tmp_path):
    res = subprocess.run(
        [str(REPO / "launch" / "mpirun.sh"), "-np", "2", "--", sys.executable, "-m", "iga_ds.cli",
         "selfcheck", "--json", "--skip-ops", "--timeout", "60"],
        # a free port: launch/mpirun.sh's default is DeepSpeed's, which another test may hold
        cwd=REPO, env=dict(mpi_env, MASTER_PORT=str(free_port()), MPIRUN_ARGS=f"--output-filename {tmp_path / 'out'}"),
        capture_output=True, text=True, timeout=180,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    _assert_two_ranks_reduced(_reports(tmp_path / "out"), "openmpi")


WITHOUT_OMPI_VARIABLES = textwrap.dedent("""
    import os, sys
    # Hide Open MPI's own variables, as under MPICH or Intel MPI: only PMIx/PMI remain.
    for key in [k for k in os.environ if k.startswith("OMPI_COMM_WORLD_")]:
        del os.environ[key]
    from iga_ds.cli import main
    sys.exit(main(["selfcheck", "--json", "--skip-ops", "--timeout", "60"]))
""")


def test_mpirun_np2_through_mpi4py_discovery(mpi_env, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WITHOUT_OMPI_VARIABLES)
    res = subprocess.run(
        ["mpirun", "-np", "2", "--oversubscribe", "--output-filename", str(tmp_path / "out"),
         sys.executable, str(worker)],
        cwd=REPO, env=mpi_env, capture_output=True, text=True, timeout=180,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    reports = _reports(tmp_path / "out")
    _assert_two_ranks_reduced(reports, "mpi4py")
    # rank 0 picked the port and broadcast it; loopback because both ranks share this node
    assert reports[0]["dist"]["master_addr"] == "127.0.0.1"
    assert reports[0]["dist"]["local_world_size"] == 2
    assert sorted(r["dist"]["local_rank"] for r in reports) == [0, 1]
