"""What every sbatch template must carry, and what a rank sees when a template starts it.

The CPU template also runs on real Slurm clusters (test_slurm_cpu.py, test_two_node_slurm.py);
the GPU ones cannot run here, so their text is held to the same rules and each template runs
once with stand-ins for srun, Apptainer and scontrol on PATH. The stand-ins record their command
line and environment and apply each container runtime's documented environment rule (Apptainer:
a variable the image sets wins over the host's unless given as APPTAINERENV_<NAME> or --env;
pyxis: likewise unless named in --container-env), so the test sees the environment a rank would
get inside the container: its caches, PYTHONPATH and OMP_NUM_THREADS, and the CPUs srun gives it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_dockerfile import image_environment

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = sorted((REPO / "slurm").glob("*.sbatch"))
# templates that start the trainer on every rank (others, e.g. data-building arrays, may appear)
TRAINING_TEMPLATES = [t for t in TEMPLATES if "launch/train.py" in t.read_text()]
GPU_TEMPLATES = [t for t in TRAINING_TEMPLATES if t.name != "cpu.sbatch"]
CONTAINER_VARS = ("XDG_CACHE_HOME", "HF_HOME", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "IGA_DS_CACHE",
                  "PYTHONPATH", "OMP_NUM_THREADS")
CACHE_VARS = CONTAINER_VARS[:5]


def sbatch_directives(text: str) -> list[str]:
    """#SBATCH lines as sbatch reads them: only those before the first command count."""
    directives = []
    for line in text.splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            directives.append(stripped[len("#SBATCH"):].strip())
        elif stripped and not stripped.startswith("#"):
            break
    return directives


def ignored_directives(text: str) -> list[str]:
    seen = set(sbatch_directives(text))
    return [line for line in text.splitlines() if line.strip().startswith("#SBATCH")
            and line.strip()[len("#SBATCH"):].strip() not in seen]


def test_the_training_templates_are_found():
    assert {"cpu.sbatch", "pyxis.sbatch", "apptainer.sbatch"} <= {t.name for t in TRAINING_TEMPLATES}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_every_template_is_bash_and_no_directive_is_ignored(template):
    text = template.read_text()
    assert text.startswith("#!") and "bash" in text.splitlines()[0]
    assert not ignored_directives(text)


@pytest.mark.parametrize("template", TRAINING_TEMPLATES, ids=lambda p: p.name)
def test_training_templates_stop_on_the_first_error(template):
    text = template.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text


@pytest.mark.parametrize("template", TRAINING_TEMPLATES, ids=lambda p: p.name)
def test_header_says_how_to_submit_and_which_variables(template):
    text = template.read_text()
    header = text.split("#SBATCH", 1)[0]
    assert "sbatch slurm/" + template.name in header
    assert "Variables" in header
    # every IGA_* variable the script reads is documented in the header
    used = set(re.findall(r"\$\{?(IGA_[A-Z_]+)", text.split("set -euo pipefail", 1)[1]))
    undocumented = sorted(v for v in used if v not in header and v not in ("IGA_WORKDIR", "IGA_CPUS_PER_RANK"))
    assert not undocumented, undocumented


@pytest.mark.parametrize("template", TRAINING_TEMPLATES, ids=lambda p: p.name)
def test_requeue_signal_logs(template):
    text = template.read_text()
    directives = sbatch_directives(text)
    assert "--requeue" in directives
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", d) for d in directives), directives
    assert "--open-mode=append" in directives  # a requeued run appends to its log
    assert any(d.startswith("--output=") and "%j" in d for d in directives)
    assert "--output=\"$IGA_LOG_DIR/%x-%j.rank%t.out\"" in text  # one log per rank
    assert "iga_install_traps" in text and "iga_maybe_requeue" in text
    assert "resume=auto" in text and "iga_rendezvous" in text


@pytest.mark.parametrize("template", TRAINING_TEMPLATES, ids=lambda p: p.name)
def test_selfcheck_runs_before_training(template):
    text = template.read_text()
    selfcheck = text.find("iga_ds.cli selfcheck")
    train = text.find("$IGA_TRAIN_SCRIPT") if "$IGA_TRAIN_SCRIPT\"" in text else text.find("launch/train.py \\")
    assert 0 < selfcheck < train, template.name
    # a failed selfcheck stops the job before training
    assert re.search(r"if ! .*iga_run_step[\s\S]*?selfcheck[\s\S]*?exit 1", text)


@pytest.mark.parametrize("template", GPU_TEMPLATES, ids=lambda p: p.name)
def test_gpu_templates_8_h100_per_node_nccl_safety(template):
    text = template.read_text()
    directives = sbatch_directives(text)
    assert "--gpus-per-node=8" in directives and "--ntasks-per-node=8" in directives
    assert "--exclusive" in directives
    assert "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}" in text
    assert "iga_nccl_env" in text and "iga_cache_env" in text
    assert "--backend nccl" in text
    # the trainer steps torch's AdamW: no DeepSpeed op is demanded of the image by default
    assert "--require-ops" not in text.split("set -euo pipefail", 1)[1]


def test_job_lib_sets_nccl_error_handling_and_timeout():
    lib = (REPO / "slurm" / "job_lib.sh").read_text()
    for var in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "DEEPSPEED_TIMEOUT"):
        assert re.search(rf"export {var}=\$\{{{var}:-\d+\}}", lib), var
    for var in CACHE_VARS:
        assert f"export {var}=" in lib
    assert "IGA_CONTAINER_VARS=(" + " ".join(CONTAINER_VARS[:5]) in " ".join(lib.split())


def test_directive_parser_stops_at_first_command():
    text = "#!/bin/bash\n#SBATCH --a\n# note\n#SBATCH --b\necho hi\n#SBATCH --c\n"
    assert sbatch_directives(text) == ["--a", "--b"]
    assert ignored_directives(text) == ["#SBATCH --c"]


# -- the environment a rank sees ---------------------------------------------------------------

# srun: record the command line and environment; pyxis (--container-image) applies the image's
# environment as pyxis documents it; a command that is the Apptainer stand-in is run, any other
# command is only recorded (nothing trains here).
SRUN = r'''
import json, os, sys
argv = sys.argv[1:]
i = 0
while i < len(argv) and argv[i].startswith("-"):
    i += 1
options = dict(a.partition("=")[::2] for a in argv[:i])
command = argv[i:]
env = dict(os.environ)
record = {"tool": "srun", "argv": argv, "env": env, "command": command}
if "--container-image" in options:
    image = json.load(open(os.environ["STUB_IMAGE_ENV"]))
    named = [n for n in options.get("--container-env", "").split(",") if n in os.environ]
    record["rank_env"] = {**env, **image, **{n: os.environ[n] for n in named}}
elif command[:1] != ["apptainer"]:
    record["rank_env"] = env
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(record) + "\n")
if command[:1] == ["apptainer"]:
    os.execvp(command[0], command)
'''

# apptainer exec [options] SIF COMMAND: the image's variables win over the host's; APPTAINERENV_
# and --env win over both.
APPTAINER = r'''
import json, os, sys
argv = sys.argv[1:]
assert argv[0] == "exec", argv
i, env_flags = 1, []
while argv[i].startswith("-"):
    if argv[i] in ("--bind", "-B", "--pwd", "--env"):
        if argv[i] == "--env":
            env_flags += argv[i + 1].split(",")
        i += 2
    else:
        i += 1
image = json.load(open(os.environ["STUB_IMAGE_ENV"]))
env = {k: v for k, v in os.environ.items() if not k.startswith("APPTAINERENV_")}
env.update(image)
env.update({k[len("APPTAINERENV_"):]: v for k, v in os.environ.items() if k.startswith("APPTAINERENV_")})
env.update(dict(e.partition("=")[::2] for e in env_flags))
record = {"tool": "apptainer", "argv": argv, "image": argv[i], "command": argv[i + 1:], "rank_env": env}
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(record) + "\n")
'''

SCONTROL = r'''
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
sys.stdout.write("gpu01\ngpu02\n")
'''

# An image as the issue found it: every variable the job sets also set inside the image.
IMAGE_SETTING_EVERYTHING = {name: f"/image/{name.lower()}" for name in CONTAINER_VARS}


def run_template(template: Path, tmp_path: Path, image_env: dict[str, str]) -> list[dict]:
    """Run ``template`` as the batch script of a 2-node job (12 CPUs per task) with the stand-ins
    on PATH; returns what srun and the container runtime recorded."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", SRUN), ("apptainer", APPTAINER), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{body}")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "image_env.json").write_text(json.dumps(image_env))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SRUN_", "APPTAINER")) and k not in CONTAINER_VARS}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", HOME=str(tmp_path / "home"),
               STUB_LOG=str(tmp_path / "calls.jsonl"), STUB_IMAGE_ENV=str(tmp_path / "image_env.json"),
               SLURM_JOB_ID="4242", SLURM_JOB_NAME=template.stem, SLURM_JOB_NODELIST="gpu[01-02]",
               SLURM_NTASKS="16", SLURM_CPUS_PER_TASK="12", SLURM_SUBMIT_DIR=str(REPO),
               IGA_CACHE_DIR=str(tmp_path / "cache"), IGA_LOG_DIR=str(tmp_path / "logs"),
               IGA_OUTPUT_DIR=str(tmp_path / "out"), IGA_SIF=str(tmp_path / "iga-ds.sif"),
               IGA_IMAGE="registry#org/iga-ds:1", IGA_PYTHON=sys.executable)
    res = subprocess.run(["bash", str(template)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def rank_launches(calls: list[dict]) -> list[dict]:
    """The records that say what a rank sees: one per step (selfcheck, training)."""
    return [c for c in calls if "rank_env" in c]


@pytest.mark.parametrize("template", TRAINING_TEMPLATES, ids=lambda p: p.name)
def test_every_rank_gets_the_cpus_of_its_task(template, tmp_path):
    calls = run_template(template, tmp_path, image_environment())
    sruns = [c for c in calls if c["tool"] == "srun"]
    assert len(sruns) == 2, calls  # selfcheck, then training
    for call in sruns:
        assert "--cpus-per-task=12" in call["argv"], call["argv"]
        assert call["env"]["SRUN_CPUS_PER_TASK"] == "12"
    for launch in rank_launches(calls):
        assert launch["rank_env"]["OMP_NUM_THREADS"] == "12"


@pytest.mark.parametrize("image", ["dockerfile", "sets-everything"])
@pytest.mark.parametrize("template", GPU_TEMPLATES, ids=lambda p: p.name)
def test_a_rank_in_the_container_sees_the_jobs_writable_caches(template, image, tmp_path):
    image_env = image_environment() if image == "dockerfile" else IMAGE_SETTING_EVERYTHING
    calls = run_template(template, tmp_path, image_env)
    launches = rank_launches(calls)
    assert len(launches) == 2, calls
    cache = tmp_path / "cache"
    expected = {"XDG_CACHE_HOME": cache, "HF_HOME": cache / "huggingface",
                "TORCH_EXTENSIONS_DIR": cache / "torch_extensions", "TRITON_CACHE_DIR": cache / "triton",
                "IGA_DS_CACHE": cache / "iga-ds"}
    for launch in launches:
        seen = launch["rank_env"]
        for name, path in expected.items():
            assert seen.get(name) == str(path), (name, seen.get(name))
            assert os.access(path, os.W_OK), f"{name}: {path} is not a writable folder"
        assert seen["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)  # the checkout's code
        assert seen["OMP_NUM_THREADS"] == "12"


def test_the_stand_ins_apply_each_runtimes_rule(tmp_path):
    """The stand-ins themselves: with nothing passed explicitly, the image's value wins (so the
    two tests above can fail)."""
    (tmp_path / "image_env.json").write_text(json.dumps({"HF_HOME": "/image/hf"}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", SRUN), ("apptainer", APPTAINER)):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{body}")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", HF_HOME="/host/hf",
               STUB_LOG=str(tmp_path / "calls.jsonl"), STUB_IMAGE_ENV=str(tmp_path / "image_env.json"))
    script = textwrap.dedent("""
        srun --container-image=x true
        srun --container-image=x --container-env=HF_HOME true
        srun apptainer exec --nv img.sif true
        APPTAINERENV_HF_HOME=/host/hf srun apptainer exec img.sif true
    """)
    subprocess.run(["bash", "-c", script], env=env, check=True, timeout=60)
    seen = [c["rank_env"]["HF_HOME"] for c in map(json.loads, (tmp_path / "calls.jsonl").read_text().splitlines())
            if "rank_env" in c]
    assert seen == ["/image/hf", "/host/hf", "/image/hf", "/host/hf"]
