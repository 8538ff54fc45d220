"""Faults before the first step, in real `iga-ds train` processes: a stop signal during setup is
one line and exit 5 (it was a silent death, exit 138 for SIGUSR1), and a rank that never comes
to the rendezvous is named by the ranks that did, within IGA_DS_RENDEZVOUS_TIMEOUT_S (exit 3),
instead of a silent wait of DeepSpeed's 10 minutes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dist_helpers import free_port
from test_train_support import run_config_dict, write_isomer_jsonl

REPO = Path(__file__).resolve().parents[2]
# a setup step made to say that it has started and to wait for a line on stdin: the signal then
# arrives while the trainer is at that step, with no sleep to guess when that is
HOLD_AT = """
import sys
from iga_ds.train import trainer
owner = trainer.Trainer if sys.argv[1] == "Trainer" else trainer
original = getattr(owner, sys.argv[2])
def held(*args, **kwargs):
    print("held", flush=True)
    sys.stdin.readline()
    return original(*args, **kwargs)
setattr(owner, sys.argv[2], held)
from iga_ds.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """A run YAML of a tiny CPU run on the built-in base (never built: no test gets that far)."""
    tmp = tmp_path_factory.mktemp("setup-faults")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=2)
    raw = run_config_dict(tmp, data, output_dir=str(tmp / "run"))
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    env.update(extra)
    return env


SETUP_STOPS = [
    ("SIGUSR1", "trainer", "init_distributed", "starting the process group"),
    ("SIGTERM", "Trainer", "_resolve_base", "loading the model"),
    ("SIGINT", "Trainer", "_load_groups", "reading the data"),
]


@pytest.mark.parametrize("name, owner, step, phase", SETUP_STOPS, ids=[row[0] for row in SETUP_STOPS])
def test_a_stop_signal_during_setup_is_one_line_and_exit_5(config, tmp_path, name, owner, step, phase):
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", HOLD_AT, owner, step, "train", "--config", str(config),
                                f"output_dir={out}"], env=_env(), cwd=tmp_path, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held", process.stderr.read()
        process.send_signal(getattr(signal, name))
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 5, stderr
    assert stderr.strip() == (f"iga-ds: error: stopped by {name} while {phase}, before the first step: no step ran "
                              "and nothing was saved (the last checkpoint, if any, is as it was); run the same "
                              "command again to continue"), stderr
    assert not out.exists()


def test_a_rank_that_never_comes_is_named_by_the_rank_that_did(config, tmp_path):
    """A world of 2 with only rank 0 started, and a rendezvous timeout of 2 s."""
    port = free_port()
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               IGA_DS_RENDEZVOUS_TIMEOUT_S="2")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "iga_ds.cli", "train", "--config", str(config),
                           f"output_dir={tmp_path / 'run'}"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip() == (f"iga-ds: error: rank 0/2: rank 1 of 2 did not come to the rendezvous at "
                                   f"127.0.0.1:{port} within 2 s (IGA_DS_RENDEZVOUS_TIMEOUT_S); start every rank, "
                                   f"and check that each reaches 127.0.0.1:{port}"), done.stderr
    assert time.monotonic() - started < 60  # the timeout, not DeepSpeed's 10 minutes


def test_a_rank_whose_rank_0_never_comes_names_rank_0(config, tmp_path):
    port = free_port()
    env = _env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               IGA_DS_RENDEZVOUS_TIMEOUT_S="2")
    done = subprocess.run([sys.executable, "-m", "iga_ds.cli", "train", "--config", str(config),
                           f"output_dir={tmp_path / 'run'}"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().startswith(f"iga-ds: error: rank 1/2: rank 0 did not answer at the rendezvous "
                                          f"127.0.0.1:{port} within 2 s"), done.stderr


def test_a_rendezvous_timeout_that_is_not_a_number_is_one_line(monkeypatch):
    from iga_ds.errors import UserError
    from iga_ds.train.distributed import DEFAULT_RENDEZVOUS_TIMEOUT_S, rendezvous_timeout_s

    monkeypatch.delenv("IGA_DS_RENDEZVOUS_TIMEOUT_S", raising=False)
    assert rendezvous_timeout_s() == DEFAULT_RENDEZVOUS_TIMEOUT_S
    for bad in ("soon", "0", "-1", "inf", "nan"):
        monkeypatch.setenv("IGA_DS_RENDEZVOUS_TIMEOUT_S", bad)
        with pytest.raises(UserError, match=rf"^IGA_DS_RENDEZVOUS_TIMEOUT_S: expected a positive number of seconds, "
                                            rf"got '{bad}'$"):
            rendezvous_timeout_s()
