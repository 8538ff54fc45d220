"""launch/docker_run.sh with a stand-in for docker (or podman) on PATH: what it asks the engine to
run. The base image's entrypoint stays (no --entrypoint), the commands are given in full, every
cache variable points into the mounted /cache, no DeepSpeed op is demanded of the image, GPUs are
asked for as each engine names them, and IGA_ACCELERATOR=cpu asks for none. The real run, with
podman on a built image: tests/launch/test_container_image.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKER = r'''
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
'''
VALUE_OPTIONS = {"-v", "-e", "-w", "--user", "--gpus", "--ulimit", "--device"}


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


def _run_stub(tmp_path, engine: str, **variables: str) -> list[tuple[list[str], str, list[str]]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / engine).write_text(f"#!{sys.executable}\n{DOCKER}")
    (bin_dir / engine).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "OMP_NUM_THREADS") and not k.startswith("IGA_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", STUB_LOG=str(tmp_path / "calls.jsonl"),
               IGA_CACHE_DIR=str(tmp_path / "cache"), IGA_IMAGE="iga-ds:test", **variables)
    proc = subprocess.run([str(REPO / "launch" / "docker_run.sh"), "--config", "configs/tiny_cpu.yaml"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [split_run(json.loads(x)) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]


def _values(opts: list[str], name: str) -> list[str]:
    return [opts[i + 1] for i, o in enumerate(opts) if o == name]


def test_cuda_asks_each_engine_for_all_gpus(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "p").mkdir()
    (docker_opts, _, _), _ = _run_stub(tmp_path / "d", "docker")
    assert _values(docker_opts, "--gpus") == ["all"] and "memlock=-1" in _values(docker_opts, "--ulimit")
    (podman_opts, _, _), _ = _run_stub(tmp_path / "p", "podman", IGA_ENGINE="podman")
    # podman has no --gpus: NVIDIA's container toolkit hands the GPUs over as a CDI device
    assert _values(podman_opts, "--device") == ["nvidia.com/gpu=all"] and "--gpus" not in podman_opts
    for opts in (docker_opts, podman_opts):
        assert "DS_ACCELERATOR=cpu" not in _values(opts, "-e")


def test_cpu_with_podman_asks_for_no_gpu_and_sets_the_ranks(tmp_path):
    calls = _run_stub(tmp_path, "podman", IGA_ENGINE="podman", IGA_ACCELERATOR="cpu", IGA_NUM_GPUS="2",
                      OMP_NUM_THREADS="1")
    (opts1, _, selfcheck), (opts2, _, train) = calls
    assert selfcheck == ["iga-ds", "selfcheck"]
    assert train == ["deepspeed", "--num_gpus", "2", "launch/train.py", "--config", "configs/tiny_cpu.yaml"]
    for opts in (opts1, opts2):
        assert "--gpus" not in opts and "--device" not in opts and "--ulimit" not in opts
        assert {"DS_ACCELERATOR=cpu", "OMP_NUM_THREADS"} <= set(_values(opts, "-e"))


def test_user_is_the_caller_or_the_image_user_for_root(tmp_path):
    (opts, _, _), _ = _run_stub(tmp_path, "docker")
    if os.geteuid() == 0:  # a root caller never gets a root process in the container: the image's user
        assert "--user" not in opts
    else:
        assert _values(opts, "--user") == [f"{os.getuid()}:{os.getgid()}"]
    (tmp_path / "calls.jsonl").unlink()
    (opts, _, _), _ = _run_stub(tmp_path, "docker", IGA_CONTAINER_USER="1234:5678")
    assert _values(opts, "--user") == ["1234:5678"]


def test_an_unknown_accelerator_is_refused(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = dict(os.environ, IGA_ACCELERATOR="rocm", IGA_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([str(REPO / "launch" / "docker_run.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "IGA_ACCELERATOR=rocm: expected cuda or cpu" in proc.stderr
