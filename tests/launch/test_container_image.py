"""The container image, built from the real Dockerfile and run (issue 48, item 6).

podman builds the Dockerfile on a stand-in for the NGC base (which cannot be pulled here):
Debian minbase with Python 3 and a venv, made by docker/standin-base.sh once per machine and
reused while its tag is in podman's storage. torch is the CPU build of the version this suite
runs on, and every package comes from a wheelhouse downloaded on the host with the host's own pip
settings (local indexes, certificates) and mounted into the build (`podman build -v`): the
host's file:// indexes are not visible inside a build and PyPI's proxy certificate is not in the
stand-in's store, so the build itself needs no network. Then launch/docker_run.sh, with podman as
the engine, runs `iga-ds selfcheck` and a 2-rank CPU training run (gloo, DS_ACCELERATOR=cpu) in
the image, writing into a mounted workspace: as the image's non-root user (a root caller), and as
a uid the image does not know (what any other caller runs as); the outputs are the caller's.

Skips with the reason where podman cannot build or run containers. The two settings podman needs
on these machines (the runc runtime, `default_ulimits = []`) are .ci/system-deps's drop-in
containers.conf. Times of each phase are printed (`pytest -s`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STANDIN_BASE = "localhost/iga-ds-standin-base:bookworm-1"  # bump the suffix when docker/standin-base.sh changes
STANDIN_PYTHON = (3, 11)  # bookworm's: the wheelhouse is downloaded by this interpreter for it
IMAGE_UID = 1000  # the Dockerfile's IGA_UID default
CACHE_TAG = "localhost/iga-ds-test:cache"  # the last image built, kept so its layers cache the next build
# machine-wide: the stand-in base and the wheelhouse are built once per machine, under a lock
CACHE = Path(os.environ.get("IGA_CONTAINER_TEST_CACHE", "/var/tmp/iga-ds-container-test"))
TINY_RUN = ["--config", "configs/tiny_cpu.yaml", "schedule.max_steps=2", "model.tiny.steps=4", "model.tiny.warmup_steps=1", "model.tiny.corpus_groups=10",
            "logging.progress=false", "logging.tensorboard=false"]

# the first test also builds the base and the image: minutes on a fresh machine, seconds after
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _podman(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, **kw)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


@contextlib.contextmanager
def _machine_lock(name: str):
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cpu_torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0] + "+cpu"


def _wheelhouse_requirements(torch_version: str) -> list[str]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deepspeed = re.search(r"^ARG DEEPSPEED_VERSION=(\S+)$", (REPO / "Dockerfile").read_text(), re.M).group(1)
    return [f"torch=={torch_version}", f"deepspeed=={deepspeed}", "setuptools>=68", "wheel",
            *project["dependencies"]]


def _start_wheelhouse(torch_version: str) -> tuple[Path, subprocess.Popen | None]:
    """The wheelhouse folder, and the download filling it (None when it is complete already)."""
    requirements = _wheelhouse_requirements(torch_version)
    constraints = (REPO / "docker" / "constraints.txt").read_text()
    key = hashlib.sha256("\n".join([*requirements, constraints]).encode()).hexdigest()[:16]
    folder = CACHE / f"wheels-{key}"
    if (folder / ".complete").exists():
        return folder, None
    for old in CACHE.glob("wheels-*"):  # an earlier set of pins
        shutil.rmtree(old, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)  # a download cut short resumes
    (folder / "requirements.txt").write_text("\n".join(requirements) + "\n")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", str(folder), "-c", str(REPO / "docker" / "constraints.txt"),
           "-r", str(folder / "requirements.txt")]
    env = dict(os.environ, IGA_BASE_TORCH_VERSION=torch_version, PIP_DISABLE_PIP_VERSION_CHECK="1")
    log = open(folder / "download.log", "w")
    return folder, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _finish_wheelhouse(folder: Path, download: subprocess.Popen | None, torch_version: str) -> None:
    if download is None:
        return
    rc = download.wait(timeout=900)
    log = (folder / "download.log").read_text()
    if rc == 0 and any(folder.glob(f"torch-{torch_version}-*.whl")):
        (folder / ".complete").write_text("")
        return
    shutil.rmtree(folder, ignore_errors=True)
    if "torch" in log and ("No matching distribution" in log or "Could not find a version" in log):
        pytest.skip(f"torch {torch_version} (a CPU build) is not available to pip on this machine: {_last_line(log)}")
    pytest.fail(f"pip download of the image's packages failed (exit {rc}): {_last_line(log)}")


def _ensure_standin_base() -> float:
    """Build the stand-in base unless podman has it; return the seconds it took (0 if reused)."""
    if _podman("image", "exists", STANDIN_BASE).returncode == 0:
        return 0.0
    if shutil.which("debootstrap") is None and not Path("/usr/sbin/debootstrap").exists():
        pytest.skip("debootstrap not installed (Debian debootstrap; .ci/system-deps installs it): "
                    "no stand-in base image can be made")
    start = time.monotonic()
    proc = subprocess.run([str(REPO / "docker" / "standin-base.sh"), STANDIN_BASE], capture_output=True,
                          text=True, timeout=1200)
    if proc.returncode != 0:
        pytest.skip(f"the stand-in base could not be built (docker/standin-base.sh exit {proc.returncode}): "
                    f"{_last_line(proc.stderr + proc.stdout)}")
    return time.monotonic() - start


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """Build the real Dockerfile on the stand-in base; yield (tag, timings); remove the tag after."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("podman builds here as root only (rootful podman; debootstrap needs root)")
    if shutil.which("podman") is None:
        pytest.skip("podman not installed (Debian podman and runc; .ci/system-deps installs them)")
    if sys.version_info[:2] != STANDIN_PYTHON:
        pytest.skip(f"the wheelhouse is downloaded by this interpreter for the stand-in's Python "
                    f"{'.'.join(map(str, STANDIN_PYTHON))}; this is {sys.version.split()[0]}")
    timings: dict[str, float] = {}
    torch_version = _cpu_torch_version()
    with _machine_lock("standin"):
        wheels, download = _start_wheelhouse(torch_version)  # downloads while debootstrap runs
        try:
            timings["base"] = _ensure_standin_base()
        except BaseException:
            if download is not None:
                download.kill()
            raise
        start = time.monotonic()
        _finish_wheelhouse(wheels, download, torch_version)
        timings["wheelhouse_wait"] = time.monotonic() - start
    trial = _podman("run", "--rm", STANDIN_BASE, "python", "-c", "print('ok')")
    if trial.returncode != 0 or trial.stdout.strip() != "ok":
        pytest.skip(f"podman cannot run containers here (a trial `podman run` failed, exit {trial.returncode}: "
                    f"{_last_line(trial.stderr)}); .ci/system-deps writes the runc runtime and "
                    f"`default_ulimits = []` into /etc/containers/containers.conf.d")

    tag = f"localhost/iga-ds-test:{uuid.uuid4().hex[:12]}"  # parallel runs never share a tag
    log = tmp_path_factory.mktemp("build") / "build.log"
    cmd = ["podman", "build", "--network=host", "--layers", "-t", tag, "-v", f"{wheels}:/wheels:ro",
           "--build-arg", f"BASE_IMAGE={STANDIN_BASE}", "--build-arg", f"TORCH_VERSION={torch_version}",
           "--build-arg", "IGA_EXTRAS=", "--build-arg", "PIP_FIND_LINKS=/wheels", "--build-arg", "PIP_NO_INDEX=1",
           str(REPO)]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=1500)
    timings["build"] = time.monotonic() - start
    text = log.read_text()
    assert proc.returncode == 0, f"podman build failed (exit {proc.returncode}):\n{text[-4000:]}"
    try:
        yield tag, timings, text
    finally:
        # Keep the newest image under one tag: podman drops an image's untagged build layers with
        # it, and they are the next build's cache. The previous one goes (its layers shared with
        # this one stay); then this run's own tag.
        previous = _podman("image", "inspect", "--format", "{{.Id}}", CACHE_TAG).stdout.strip()
        _podman("tag", tag, CACHE_TAG)
        _podman("rmi", tag)
        current = _podman("image", "inspect", "--format", "{{.Id}}", CACHE_TAG).stdout.strip()
        if previous and previous != current:
            _podman("rmi", previous)  # refused while a parallel run uses it: fine
        print("container image test, seconds:", ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))


def test_image_is_a_cpu_build_and_runs_as_its_non_root_user(image):
    tag, timings, build_log = image
    start = time.monotonic()
    probe = ("import os, pwd, torch, deepspeed, iga_ds, importlib.metadata as m; "
             "print(os.getuid(), pwd.getpwuid(os.getuid()).pw_name, torch.__version__, deepspeed.__version__, "
             "sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].lower().startswith('nvidia')))")
    proc = _podman("run", "--rm", tag, "python", "-c", probe, timeout=300)
    timings["probe"] = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    # the last line: importing deepspeed logs its accelerator on stdout first
    uid, user, torch_version, _ds, nvidia = proc.stdout.strip().splitlines()[-1].split(" ", 4)
    assert (int(uid), user) == (IMAGE_UID, "iga")
    assert torch_version == _cpu_torch_version() and nvidia.strip() == "[]"  # no CUDA package pulled
    size = int(_podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())
    timings["image_gib"] = size / 2**30
    assert size < 3 * 2**30, f"the CPU image is {size / 2**30:.2f} GiB"


# (IGA_CONTAINER_USER, the uid that owns the workspace and every output): a root caller gets the
# image's own user; any other caller runs as itself (docker_run.sh passes --user UID:GID, a uid
# the image's passwd does not know), so what it writes stays its own
CALLERS = [pytest.param(None, IMAGE_UID, id="root-caller"), pytest.param("4321:4321", 4321, id="user-4321")]


@pytest.mark.parametrize("container_user, owner", CALLERS)
def test_docker_run_sh_with_podman_trains_two_cpu_ranks_into_the_workspace(image, tmp_path, container_user, owner):
    tag, timings, _ = image
    ws = tmp_path / "ws"
    ws.mkdir()
    for folder in ("launch", "configs", "ds_configs"):  # the checkout's files the run reads (iga_ds: the image's)
        shutil.copytree(REPO / folder, ws / folder, symlinks=True)
    synth = subprocess.run([sys.executable, "-m", "iga_ds.cli", "data", "synth", "--out", str(ws / "data" / "synth"),
                            "--groups", "40", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert synth.returncode == 0, synth.stderr
    (ws / "cache").mkdir()
    # the workspace is the container user's, as a checkout is its owner's
    for path in [ws, *ws.rglob("*")]:
        os.chown(path, owner, owner, follow_symlinks=False)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "IGA_CONTAINER_USER")}
    if container_user is not None:  # what docker_run.sh derives for a caller of that uid (test_launch_docker_run.py)
        env["IGA_CONTAINER_USER"] = container_user
    env.update(IGA_ENGINE="podman", IGA_ACCELERATOR="cpu", IGA_NUM_GPUS="2", IGA_IMAGE=tag,
               IGA_CACHE_DIR=str(ws / "cache"), OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.run([str(ws / "launch" / "docker_run.sh"), *TINY_RUN], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=900)
    timings[f"docker_run_{owner}"] = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # selfcheck first (its report), then both ranks of the deepspeed launcher
    assert "selfcheck" in out.lower(), out[-3000:]
    assert "world size 2" in out and "dist_world_size=2" in out, out[-3000:]
    run = ws / "runs" / "tiny_cpu"
    written = list(run.rglob("*"))
    for name in ("config.resolved.yaml", "metrics.jsonl", "checkpoints/latest", "checkpoints/step_00000002",
                 "adapter/adapter_model.safetensors"):
        assert (run / name).exists(), (name, sorted(str(p.relative_to(run)) for p in written))
    owners = {p.lstat().st_uid for p in [run, *written]}
    assert owners == {owner}, owners  # written by the container's non-root user, the workspace's owner
    assert ws.stat().st_uid == owner
