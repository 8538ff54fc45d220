"""launch/docker_run.sh with a stand-in for docker on PATH: what it asks docker to run. The base
image's entrypoint stays (no --entrypoint), the commands are given in full, every cache variable
points into the mounted /cache, and no DeepSpeed op is demanded of the image."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKER = r'''
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
'''
VALUE_OPTIONS = {"-v", "-e", "-w", "--user", "--gpus", "--ulimit"}


def split_run(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """``docker run OPTIONS IMAGE COMMAND...`` -> (options, image, command)."""
    assert argv[0] == "run", argv
    i = 1
    while argv[i].startswith("-"):
        i += 2 if argv[i] in VALUE_OPTIONS else 1
    return argv[1:i], argv[i], argv[i + 1:]


def test_docker_run_keeps_the_entrypoint_and_mounts_the_caches(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f"#!{sys.executable}\n{DOCKER}")
    (bin_dir / "docker").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", STUB_LOG=str(tmp_path / "calls.jsonl"),
               IGA_CACHE_DIR=str(tmp_path / "cache"), IGA_IMAGE="iga-ds:test", HF_TOKEN="secret-value")
    subprocess.run([str(REPO / "launch" / "docker_run.sh"), "--config", "configs/tiny_cpu.yaml",
                    "schedule.max_steps=2"], cwd=REPO, env=env, check=True, timeout=60)
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2
    (opts1, image1, selfcheck), (opts2, image2, train) = (split_run(c) for c in calls)
    assert image1 == image2 == "iga-ds:test"
    assert selfcheck == ["iga-ds", "selfcheck"]  # no --require-ops: the trainer uses torch's AdamW
    assert train == ["deepspeed", "launch/train.py", "--config", "configs/tiny_cpu.yaml", "schedule.max_steps=2"]
    for opts in (opts1, opts2):
        assert not any(o.startswith("--entrypoint") for o in opts)
        assert f"{tmp_path / 'cache'}:/cache" in opts
        pairs = dict(opts[i + 1].partition("=")[::2] for i, o in enumerate(opts) if o == "-e")
        for name in ("XDG_CACHE_HOME", "HF_HOME", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "IGA_DS_CACHE"):
            assert pairs[name].startswith("/cache"), (name, pairs.get(name))
        assert pairs["PYTHONPATH"] == "/workspace" and pairs["HF_TOKEN"] == ""  # by name: no value on the line
        assert "secret-value" not in " ".join(opts)
