"""Real processes: `iga-ds train` stopped by SIGTERM, 2 ranks stopped by the stop file, and a
2-rank run resumed on 1 rank."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dist_helpers import free_port
from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
# taken at import: in-process runs of other tests export RANK, LOCAL_WORLD_SIZE, ... later
_CLEAN_ENV = dict(os.environ)
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "CROSS_RANK", "CROSS_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
              "OMPI_COMM_WORLD_SIZE")


def _env(**extra):
    env = dict(_CLEAN_ENV, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    for key in _RANK_VARS:
        env.pop(key, None)
    env.update(extra)
    return env


def _write_config(tmp_path, data, base, name, **over) -> Path:
    cfg = run_config_dict(tmp_path, data, output_dir=str(tmp_path / name), **over)
    cfg["model"] = {"name_or_path": str(base)}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _steps(out: Path) -> list[int]:
    f = out / "metrics.jsonl"
    return [json.loads(x)["step"] for x in f.read_text().splitlines()] if f.is_file() else []


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("procs")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=8, seed=2)
    return tmp, data, tiny_base(tmp, data)


@pytest.mark.timeout(180)
def test_sigterm_saves_exits_zero_and_resumes(setup):
    tmp, data, base = setup
    cfg = _write_config(tmp, data, base, "sig", **{"schedule.max_steps": 100000})
    out = tmp / "sig"
    proc = subprocess.Popen([str(REPO / ".venv/bin/iga-ds"), "train", "--config", str(cfg)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not _steps(out) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, log[-2000:]
    stopped_at = _steps(out)[-1]
    assert "stopped at step" in log
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"
    # resume: continues after the checkpoint, each step logged once
    res = subprocess.run(
        [str(REPO / ".venv/bin/iga-ds"), "train", "--config", str(cfg), f"checkpoint.stop_at_step={stopped_at + 2}"],
        env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert _steps(out) == list(range(1, stopped_at + 3))


def _two_ranks(cfg: Path, extra_env=None, **popen):
    port = str(free_port())
    return [
        subprocess.Popen(
            [sys.executable, str(REPO / "launch/train.py"), "--config", str(cfg)],
            env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port, **(extra_env or {})),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen,
        )
        for r in range(2)
    ]


@pytest.mark.timeout(240)
def test_stop_file_stops_both_ranks_at_one_step_and_resume_completes(setup):
    tmp, data, base = setup
    over = {"data.groups_per_step": 2, "data.groups_per_micro_batch": 1}
    cfg = _write_config(tmp, data, base, "stopfile", **over, **{"schedule.max_steps": 100000})
    out = tmp / "stopfile"
    procs = _two_ranks(cfg)
    deadline = time.time() + 150
    while len(_steps(out)) < 2 and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    (out / "STOP").write_text("")  # no signal to anyone
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    stopped_at = _steps(out)[-1]
    assert "stopping (stop file STOP)" in logs[0], logs[0][-2000:]
    # the one-node check (bench/node_runs.sh) reads this line to find the step the run stopped at
    sys.path.insert(0, str(REPO / "bench"))
    import node_summary

    assert [int(m) for m in node_summary.STOPPED.findall(logs[0])] == [stopped_at]
    ckpt = out / "checkpoints" / f"step_{stopped_at:08d}"
    assert (out / "checkpoints" / "latest").read_text().strip() == ckpt.name
    assert len(list(ckpt.glob("*optim_states.pt"))) == 2  # both ranks saved the same step
    assert not (out / "STOP").exists()
    # resumed to finish two steps later: a changed schedule, which the run must be told to accept
    res = subprocess.run(
        [str(REPO / ".venv/bin/iga-ds"), "train", "--config", str(cfg), f"schedule.max_steps={stopped_at + 2}",
         "checkpoint.allow_schedule_change=true"],
        env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert _steps(out) == list(range(1, stopped_at + 3))


# the disk of rank 1 fills at its second checkpoint: its random-state file cannot be written
FULL_DISK_ON_RANK_1 = """\
import os
if os.environ.get("RANK") == "1":
    import torch
    real_save, calls = torch.save, []
    def save(obj, f, *args, **kwargs):
        if "rng_rank00001" in str(f):
            calls.append(f)
            if len(calls) == 2:
                raise OSError(28, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)
    torch.save = save
"""


@pytest.mark.timeout(240)
def test_a_checkpoint_one_rank_cannot_write_stops_every_rank_and_keeps_the_last(setup):
    """Rank 1's disk fills while it writes its part of step 2's checkpoint: both ranks stop at
    once with an error (rank 0 naming rank 1) instead of waiting for each other, and step 1's
    checkpoint stays the one `latest` names, with no partial folder beside it."""
    tmp, data, base = setup
    inject = tmp / "full_disk"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FULL_DISK_ON_RANK_1)
    cfg = _write_config(tmp, data, base, "fulldisk", **{"schedule.max_steps": 4, "checkpoint.every_steps": 1})
    out = tmp / "fulldisk"
    procs = _two_ranks(cfg, extra_env={"PYTHONPATH": str(inject)})
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode not in (0, None) for p in procs), logs[0][-2000:] + logs[1][-2000:]
    assert "No space left on device" in logs[1], logs[1][-2000:]
    assert "writing the checkpoint of step 2: rank 1 could not write its part" in logs[0], logs[0][-2000:]
    for log in logs:
        assert "the last complete checkpoint" in log and "step_00000001, is intact" in log, log[-2000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step_00000001"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_two_ranks_then_resume_on_one_matches_single_rank_run(setup, optimizer):
    import torch
    from safetensors.torch import load_file

    from iga_ds.config.run import load_run_config
    from iga_ds.train.trainer import Trainer

    tmp, data, base = setup
    over = {"schedule.max_steps": 4, "data.groups_per_step": 2, "data.groups_per_micro_batch": 1,
            "schedule.optimizer": optimizer, **({"schedule.lr": 0.5} if optimizer == "sgd" else {})}
    name = f"ws_{optimizer}"
    cfg2 = _write_config(tmp, data, base, name, **over, **{"checkpoint.stop_at_step": 2})
    procs = _two_ranks(cfg2)
    logs = [p.communicate(timeout=200)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    ckpt = tmp / name / "checkpoints" / "step_00000002"
    assert sorted(x.name for x in ckpt.glob("*optim_states.pt")) and len(list(ckpt.glob("*optim_states.pt"))) == 2

    # the same run on one rank: accumulation over 2 micro-batches replaces the second rank; the
    # optimizer state (Adam's moments, SGD's momentum) comes from the gathered full state
    resumed = Trainer(load_run_config(cfg2, ["checkpoint.stop_at_step=null"]), quiet=True).run()
    single = Trainer(load_run_config(_write_config(tmp, data, base, f"{name}1", **over)), quiet=True).run()
    assert resumed.status == single.status == "completed"
    two_rank_losses = [json.loads(x)["loss"] for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    assert len(two_rank_losses) == 4
    assert two_rank_losses == pytest.approx([h["loss"] for h in single.history], rel=1e-5)
    a = load_file(str(resumed.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(single.adapter_dir / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)
    # and training moved the adapter away from its initialization (lora_B starts at zero)
    assert any(k.endswith("lora_B.weight") and a[k].abs().max() > 0 for k in a)


@pytest.mark.timeout(240)
def test_iga_ema_state_of_two_owner_ranks_resumes_on_one(setup):
    """IGA with ``variance: ema`` under ZeRO-2: each rank keeps the averages of the modules it
    combines and saves its share; a resume on one rank merges the shares and continues as a
    single-rank run of every step does."""
    import torch
    from safetensors.torch import load_file

    from iga_ds.config.run import load_run_config
    from iga_ds.train.checkpoint import read_method_state
    from iga_ds.train.trainer import Trainer

    tmp, data, base = setup
    over = {"schedule.max_steps": 4, "data.groups_per_step": 2, "data.groups_per_micro_batch": 1,
            "method.name": "iga", "method.params": {"variance": "ema", "variance_decay": 0.5}}
    cfg2 = _write_config(tmp, data, base, "ema-ws", **over, **{"checkpoint.stop_at_step": 2})
    procs = _two_ranks(cfg2)
    logs = [p.communicate(timeout=200)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    ckpt = tmp / "ema-ws" / "checkpoints" / "step_00000002"
    shares = [load_file(str(f)) for f in sorted(ckpt.glob("method_state_rank*.safetensors"))]
    assert len(shares) == 2 and all(shares)  # both ranks own modules, and saved theirs only
    assert not set(shares[0]) & set(shares[1])
    assert {k.split(".")[0] for k in read_method_state(ckpt)} == {k.split(".")[0] for s in shares for k in s}

    resumed = Trainer(load_run_config(cfg2, ["checkpoint.stop_at_step=null"]), quiet=True).run()
    single = Trainer(load_run_config(_write_config(tmp, data, base, "ema-ws1", **over)), quiet=True).run()
    assert resumed.status == single.status == "completed"
    two_rank = [json.loads(x) for x in (tmp / "ema-ws" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in two_rank] == pytest.approx([h["loss"] for h in single.history], rel=1e-5)
    assert [r["hook.mask_mean"] for r in two_rank] == pytest.approx([h["hook.mask_mean"] for h in single.history],
                                                                     rel=1e-4)
    a = load_file(str(resumed.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(single.adapter_dir / "adapter_model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)
