"""The Dockerfile without a Docker engine: it parses, names its pins, runs as non-root with caches
on writable paths, and its pip line works with docker/constraints.txt (which keeps the base
image's torch). CI does not build the image."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
CONSTRAINTS = REPO / "docker" / "constraints.txt"
INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "ENTRYPOINT", "CMD",
                "LABEL", "EXPOSE", "VOLUME", "SHELL", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD"}


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, joining backslash continuations and dropping comments."""
    out: list[tuple[str, str]] = []
    pending = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continuation are dropped by Docker too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        if word.upper() not in INSTRUCTIONS or word != word.upper():
            raise ValueError(f"Dockerfile line {number}: unknown instruction {word!r}")
        out.append((word, rest.strip()))
    if pending:
        raise ValueError("Dockerfile ends inside a line continuation")
    return out


def _env_pairs(args: str) -> dict[str, str]:
    return dict(token.split("=", 1) for token in shlex.split(args))


@pytest.fixture(scope="module")
def instructions():
    return parse_dockerfile(DOCKERFILE.read_text())


def test_parser_rejects_broken_files():
    with pytest.raises(ValueError, match="unknown instruction"):
        parse_dockerfile("FROM x\nRUNN echo\n")
    with pytest.raises(ValueError, match="continuation"):
        parse_dockerfile("FROM x\nRUN echo \\\n")


def test_base_image_is_ngc_pytorch_chosen_by_pinned_build_arg(instructions):
    first_from = next(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    args_before = {a.split("=")[0]: a.split("=", 1)[1] for w, a in instructions[:first_from] if w == "ARG" and "=" in a}
    assert instructions[first_from][1] == "nvcr.io/nvidia/pytorch:${NGC_PYTORCH_TAG}"
    assert re.fullmatch(r"\d{2}\.\d{2}-py3", args_before["NGC_PYTORCH_TAG"]), args_before


def test_pins_are_named_and_agree_with_constraints_and_pyproject(instructions):
    args = dict(a.split("=", 1) for w, a in instructions if w == "ARG" and "=" in a)
    assert args["TORCH_CUDA_ARCH_LIST"] == "9.0"  # H100
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line.replace("${IGA_BASE_TORCH_VERSION}", "0"))
            pins[req.name.lower()] = next(iter(req.specifier)).version
    assert pins["deepspeed"] == args["DEEPSPEED_VERSION"]
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"]:
        req = Requirement(dep)
        if req.name.lower() in pins and req.name.lower() != "torch":
            assert req.specifier.contains(pins[req.name.lower()]), (dep, pins[req.name.lower()])


def test_constraints_keep_the_base_image_torch_when_pip_reads_them():
    # pip expands ${VAR} in constraint files: with the installed torch's version the constraint is
    # already met (nothing to download); with another version pip must refuse.
    import torch

    base = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
           "-c", str(CONSTRAINTS), "torch"]
    ok = subprocess.run(cmd, env=base | {"IGA_BASE_TORCH_VERSION": torch.__version__},
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "already satisfied" in ok.stdout
    other = subprocess.run(cmd, env=base | {"IGA_BASE_TORCH_VERSION": "1.0.0"},
                           capture_output=True, text=True, timeout=120)
    assert other.returncode != 0


def test_pip_lines_use_the_constraints_and_build_fused_adam(instructions):
    runs = [a for w, a in instructions if w == "RUN"]
    pip_runs = [r for r in runs if "pip install" in r]
    assert pip_runs and all("-c docker/constraints.txt" in r and "IGA_BASE_TORCH_VERSION" in r for r in pip_runs)
    ds = next(r for r in pip_runs if "deepspeed==" in r)
    assert "DS_BUILD_FUSED_ADAM=1" in ds and "--no-build-isolation" in ds and "installed_ops" in ds


def test_copied_files_exist(instructions):
    for word, args in instructions:
        if word == "COPY":
            *sources, _dest = shlex.split(args)
            for src in sources:
                if not src.startswith("--"):
                    assert (REPO / src).exists(), f"Dockerfile COPY {src}: not in the repository"


def test_runs_as_non_root_with_writable_caches_and_iga_ds_entrypoint(instructions):
    users = [a for w, a in instructions if w == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    env = {}
    for w, a in instructions:
        if w == "ENV":
            env.update(_env_pairs(a))
    caches = [env[k] for k in ("HF_HOME", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR")]
    assert all(not c.startswith("/root") for c in caches)
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    last_user = max(i for i, (w, _) in enumerate(instructions) if w == "USER")
    made_writable = " ".join(a for w, a in instructions[:last_user] if w == "RUN")
    for cache in caches:
        assert re.search(rf"chmod \S*1777\b[^&]*{re.escape(cache)}(\s|$)", made_writable), cache
    entry = [a for w, a in instructions if w == "ENTRYPOINT"]
    assert entry == ['["iga-ds"]']
