"""What every sbatch template must carry (the CPU one also runs on a real Slurm in
test_slurm_cpu.py; the GPU ones cannot run here, so their text is held to the same rules)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = sorted((REPO / "slurm").glob("*.sbatch"))
GPU_TEMPLATES = [t for t in TEMPLATES if t.name != "cpu.sbatch"]


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


def test_three_templates():
    assert {t.name for t in TEMPLATES} == {"cpu.sbatch", "pyxis.sbatch", "apptainer.sbatch"}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_header_says_how_to_submit_and_which_variables(template):
    text = template.read_text()
    header = text.split("#SBATCH", 1)[0]
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "sbatch slurm/" + template.name in header
    assert "Variables" in header
    # every IGA_* variable the script reads is documented in the header
    used = set(re.findall(r"\$\{?(IGA_[A-Z_]+)", text.split("set -euo pipefail", 1)[1]))
    undocumented = sorted(v for v in used if v not in header and v not in ("IGA_WORKDIR",))
    assert not undocumented, undocumented


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_requeue_signal_logs_and_no_ignored_directives(template):
    text = template.read_text()
    directives = sbatch_directives(text)
    assert not ignored_directives(text)
    assert "--requeue" in directives
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", d) for d in directives), directives
    assert "--open-mode=append" in directives  # a requeued run appends to its log
    assert any(d.startswith("--output=") and "%j" in d for d in directives)
    assert "--output=\"$IGA_LOG_DIR/%x-%j.rank%t.out\"" in text  # one log per rank
    assert "iga_install_traps" in text and "iga_maybe_requeue" in text
    assert "resume=auto" in text and "iga_rendezvous" in text


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
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
    assert "--backend nccl" in text and "--require-ops fused_adam" in text


def test_pyxis_and_apptainer_runtimes():
    pyxis = (REPO / "slurm" / "pyxis.sbatch").read_text()
    assert "--container-image=\"$IGA_IMAGE\"" in pyxis and "--container-mounts=" in pyxis
    apptainer = (REPO / "slurm" / "apptainer.sbatch").read_text()
    assert "apptainer exec --nv" in apptainer and "--cleanenv" not in apptainer.split("set -euo", 1)[1]


def test_job_lib_sets_nccl_error_handling_and_timeout():
    lib = (REPO / "slurm" / "job_lib.sh").read_text()
    for var in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "DEEPSPEED_TIMEOUT"):
        assert re.search(rf"export {var}=\$\{{{var}:-\d+\}}", lib), var
    for var in ("HF_HOME", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR"):
        assert f"export {var}=" in lib


def test_directive_parser_stops_at_first_command():
    text = "#!/bin/bash\n#SBATCH --a\n# note\n#SBATCH --b\necho hi\n#SBATCH --c\n"
    assert sbatch_directives(text) == ["--a", "--b"]
    assert ignored_directives(text) == ["#SBATCH --c"]
