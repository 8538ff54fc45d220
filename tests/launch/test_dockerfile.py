"""The Dockerfile without a Docker engine: it parses, names its pins, keeps the base image's
entrypoint, runs as non-root, sets no cache variable a container runtime would keep over the
job's, builds no DeepSpeed op the trainer does not use, its pip line works with
docker/constraints.txt (which keeps the base image's torch), and .dockerignore sends exactly the
copied files as build context. tests/launch/test_container_image.py builds and runs the image with podman
on a stand-in base."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
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


def image_environment(text: str | None = None) -> dict[str, str]:
    """The variables the image sets (every ENV after the last FROM); also used by
    test_slurm_templates.py, whose container stand-ins give them the runtimes' precedence."""
    instructions = parse_dockerfile(DOCKERFILE.read_text() if text is None else text)
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    env: dict[str, str] = {}
    for word, args in instructions[last_from:]:
        if word == "ENV":
            env.update(_env_pairs(args))
    return env


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` out of the build context: the last pattern that matches the
    path or one of its parent folders decides (``!`` lets it back in); ``*`` stays within one
    path element, ``**`` spans any number."""
    excluded = False
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


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
    # BASE_IMAGE swaps the whole base (CI's stand-in); by default it is NGC's PyTorch at the pinned tag
    assert instructions[first_from][1] == "${BASE_IMAGE}"
    assert args_before["BASE_IMAGE"] == "nvcr.io/nvidia/pytorch:${NGC_PYTORCH_TAG}"
    assert re.fullmatch(r"\d{2}\.\d{2}-py3", args_before["NGC_PYTORCH_TAG"]), args_before


def test_torch_is_the_base_image_unless_a_version_is_named(instructions):
    # TORCH_VERSION empty (the default): no torch line runs and NGC's torch stays; set (the CPU
    # stand-in), torch is installed through the same constraints, pinned to exactly that build
    args = dict((a.split("=", 1) + [""])[:2] for w, a in instructions if w == "ARG")
    assert args["TORCH_VERSION"] == "" and args["IGA_EXTRAS"] == "mpi"
    torch_run = next(a for w, a in instructions if w == "RUN" and "TORCH_VERSION" in a)
    assert re.search(r'if \[ -n "\$\{TORCH_VERSION\}" \]; then\s+IGA_BASE_TORCH_VERSION="\$\{TORCH_VERSION\}" '
                     r"pip install -c docker/constraints.txt torch", torch_run), torch_run
    # pip reads these from the environment; declared without a value, they stay unset
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        assert name in args and args[name] == "", name


def test_layers_put_dependencies_before_the_sources(instructions):
    # a change to the package's sources reinstalls only the package, not torch or its dependencies
    words = [(w, a) for w, a in instructions]
    index = {a.split()[0]: i for i, (w, a) in enumerate(words) if w == "COPY"}
    deps_run = next(i for i, (w, a) in enumerate(words) if w == "RUN" and "-r /tmp/iga-requirements.txt" in a)
    package_run = next(i for i, (w, a) in enumerate(words) if w == "RUN" and "--no-deps" in a)
    assert index["pyproject.toml"] < deps_run < index["iga_ds"] < package_run
    assert index["README.md"] > deps_run  # the README changes often; it is only needed by the package


def test_pins_are_named_and_agree_with_constraints_and_pyproject(instructions):
    args = dict(a.split("=", 1) for w, a in instructions if w == "ARG" and "=" in a)
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


def test_pip_lines_use_the_constraints_and_build_no_deepspeed_op(instructions):
    runs = [a for w, a in instructions if w == "RUN"]
    pip_runs = [r for r in runs if "pip install" in r]
    assert pip_runs and all("-c docker/constraints.txt" in r and "IGA_BASE_TORCH_VERSION" in r for r in pip_runs)
    ds = next(r for r in pip_runs if "deepspeed==" in r)
    assert "--no-build-isolation" in ds and "DS_BUILD_OPS=0" in ds
    assert not re.findall(r"DS_BUILD_(?!OPS=0)\w+=1", " ".join(runs))
    # why no op is prebuilt: the trainer's optimizer is torch's AdamW, not DeepSpeed's fused Adam
    import torch

    from iga_ds.train.optim import GroupStepAdamW

    assert issubclass(GroupStepAdamW, torch.optim.AdamW)


def test_copied_files_exist_and_are_in_the_build_context(instructions):
    patterns = dockerignore_patterns()
    for word, args in instructions:
        if word == "COPY":
            *sources, _dest = shlex.split(args)
            for src in sources:
                if src.startswith("--"):
                    continue
                assert (REPO / src).exists(), f"Dockerfile COPY {src}: not in the repository"
                assert not dockerignore_excludes(src, patterns), f"COPY {src}: left out by .dockerignore"


def test_dockerignore_leaves_out_history_environments_and_outputs():
    patterns = dockerignore_patterns()
    for path in (".git/config", ".venv/bin/python", "runs/x/checkpoints/latest", "logs/job.out",
                 "demo_out/report.md", "data/synth/train.jsonl", "iga_ds/__pycache__/cli.cpython-311.pyc",
                 "tests/launch/test_dockerfile.py", "checkpoints/step_00000001/meta.json"):
        assert dockerignore_excludes(path, patterns), path
    for path in ("iga_ds/cli.py", "iga_ds/data/templates/domain_instantiation.txt", "configs/tiny_cpu.yaml",
                 "slurm/job_lib.sh", "docker/constraints.txt"):
        assert not dockerignore_excludes(path, patterns), path


def test_dockerignore_matcher_follows_docker_rules():
    assert dockerignore_excludes("a/b/c.py", ["a"]) and not dockerignore_excludes("a/b/c.py", ["a", "!a/b"])
    assert dockerignore_excludes("x/y/__pycache__/z", ["**/__pycache__"])
    assert not dockerignore_excludes("ab/c", ["a"]) and dockerignore_excludes("ab/c", ["a*"])
    assert not dockerignore_excludes("a/b/c", ["*/c"]) and dockerignore_excludes("a/c", ["*/c"])


def test_runs_as_non_root_and_sets_no_cache_variable(instructions):
    users = [a for w, a in instructions if w == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    env = image_environment()
    # Apptainer and pyxis keep an image's value over the job's: a cache path set here would send
    # downloads and the first Triton compile into the read-only image
    for name in ("HF_HOME", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "IGA_DS_CACHE",
                 "PYTHONPATH", "OMP_NUM_THREADS"):
        assert name not in env, name
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    last_user = max(i for i, (w, _) in enumerate(instructions) if w == "USER")
    made_writable = " ".join(a for w, a in instructions[:last_user] if w == "RUN")
    for mount_point in ("/cache", "/workspace"):  # launch/docker_run.sh mounts these
        assert re.search(rf"chmod \S*1777\b[^&]*{re.escape(mount_point)}(\s|$)", made_writable), mount_point


def test_keeps_the_base_image_entrypoint(instructions):
    # NGC's entrypoint checks the driver and CUDA compatibility before the command runs
    assert not [a for w, a in instructions if w == "ENTRYPOINT"]
    cmd = json.loads([a for w, a in instructions if w == "CMD"][-1])
    assert cmd[0] == "iga-ds"
