"""The README's walkthrough, run as written in a fresh shell (no virtual environment active, no
variable of this session): `make demo`, then train, evaluate, report and export, in a copy of
the repository that shares its `.venv`. The demo's table is the one the README shows. Then the
block's `train` and `export` again, as a second run of the block meets them."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEADING = "## After the demo"
TABLE_ROW = re.compile(r"^(\w+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)\s+\d+\s+\d+$", re.M)


def walkthrough(readme: str) -> str:
    section = readme.split(HEADING, 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def demo_rows(text: str) -> dict[str, tuple[str, str, str]]:
    """method -> (acc ID, acc OOD, delta-gap) of the demo's table; the seconds vary by machine."""
    return {m[0]: m[1:4] for m in TABLE_ROW.findall(text)}


def copy_of_repo(dest: Path) -> Path:
    """The tracked files, their times kept (so that make sees `.venv` as up to date), and the
    repository's `.venv` linked in."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, names.decode().split("\0")):
        src, dst = REPO / name, dest / name
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    (dest / ".venv").symlink_to(REPO / ".venv")
    return dest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_walkthrough_runs_in_a_fresh_shell(tmp_path):
    stamp = REPO / ".venv" / ".installed"
    if not stamp.is_file() or stamp.stat().st_mtime < (REPO / "pyproject.toml").stat().st_mtime:
        pytest.skip("needs `make install`'s .venv, up to date with pyproject.toml")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    work = copy_of_repo(tmp_path / "repo")
    # a fresh login's environment: no virtual environment, no DS_ACCELERATOR, the user's own cache
    env = {"HOME": os.environ["HOME"], "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + walkthrough(readme)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    shown = demo_rows(readme.split(HEADING, 1)[0])
    assert shown and demo_rows(proc.stdout) == shown, proc.stdout[-3000:]
    assert (work / "demo_out" / "figure.png").stat().st_size > 0
    assert "read as a demo folder" in proc.stdout
    assert (work / "runs" / "tiny_cpu" / "eval.json").is_file()
    assert "read as a training run" in proc.stdout
    merged = work / "runs" / "tiny_cpu-merged"
    assert (merged / "config.json").is_file() and any(merged.glob("*.safetensors"))
    for method, (acc_id, acc_ood, gap) in shown.items():  # `iga-ds report demo_out` prints its table
        assert re.search(rf"^{method}\s+{re.escape(acc_id)}\s+{re.escape(acc_ood)}\s+{re.escape(gap)}\s", proc.stdout,
                         re.M), proc.stdout[-3000:]
    _run_again(work, env, readme)


def _run_again(work: Path, env: dict[str, str], readme: str) -> None:
    """The block's `train` and `export` a second time, as a second run of the block meets them:
    the run is complete (nothing trained, its log kept), the merged model replaced."""
    lines = [line for line in walkthrough(readme).splitlines() if line.startswith(("iga-ds train", "iga-ds export"))]
    assert len(lines) == 2, lines
    merged = work / "runs" / "tiny_cpu-merged" / "config.json"
    before = merged.stat().st_mtime_ns
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n. .venv/bin/activate\n" + "\n".join(lines)], cwd=work,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (work / "runs" / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11)), steps
    assert "train iga: " not in proc.stderr, proc.stderr[-3000:]  # no step's progress line: none ran
    assert "already complete: all 10 steps ran before; nothing trained" in proc.stdout, proc.stdout[-3000:]
    assert merged.stat().st_mtime_ns > before
