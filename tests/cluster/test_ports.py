"""Every test that starts a rendezvous takes a port free on this host (``dist_helpers.free_port``:
bind to port 0, pass it as ``MASTER_PORT`` or ``--master_port``): DeepSpeed's and torchrun's
default port is one for the whole machine, and two pytest-xdist workers, or a test and a job
next to it, that both take it fail at random on "address already in use"."""
from __future__ import annotations

import re
from pathlib import Path

from iga_ds.cluster.ranks import DEFAULT_MASTER_PORT

TESTS = Path(__file__).resolve().parents[1]
# a launcher started from a test: torchrun's module, DeepSpeed's runner or its local launcher
LAUNCHER = re.compile(r"-m torch\.distributed\.run\b|\bdeepspeed\.launcher\.(runner|launch)\b.*--")
OWN_PORT = re.compile(r"--standalone|--master[_-]port|--rdzv[_-]endpoint")


def _test_sources() -> list[Path]:
    files = [p for p in TESTS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    texts = []
    for path in files:
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a binary fixture
            continue
        texts.append(path)
    return texts


def test_no_test_names_the_default_rendezvous_port():
    default = str(DEFAULT_MASTER_PORT)
    assert default == "".join(("295", "00"))  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT, torchrun's too
    found = [f"{path.relative_to(TESTS.parent)}:{number}"
             for path in _test_sources()
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(rf"(?<!\d){default}(?!\d)", line)]
    assert not found, f"take a free port (dist_helpers.free_port) instead of {default}: {found}"


def test_launchers_started_by_tests_get_a_port_of_their_own():
    found = [f"{path.relative_to(TESTS.parent)}:{number}"
             for path in _test_sources() if path.suffix == ".py"
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if LAUNCHER.search(line) and not OWN_PORT.search(line)]
    assert not found, f"pass --standalone or --master_port <a free port> to the launcher: {found}"
