"""One CPU smoke run of bench/bench_step.py, shared by the tests that read it.

tests/test_fused.py (the driver's rounds, the report and the phase split) and
tests/test_bench_profile.py (``--profile`` and ``--deepspeed-checks``) check the same kind of
run: erm and iga_fused on a one-layer LLaMA of width 64, fp32, 2 timed steps after 1 warm-up,
two ranks (gloo), so that the ranks' own records are read too.
Most of its time is start-up (one torch.distributed launch per method and round, each importing
DeepSpeed), so the suite runs it once with both tests' options and each test checks its own
claims on it. The profiled steps come after the timed ones and only in the first round (the
driver strips ``--profile`` from later rounds): the timed steps and the rounds are those of a
run without ``--profile``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

BENCH = Path(__file__).resolve().parents[1] / "bench"
STEPS = 2  # timed steps per method and round
ROUNDS = 2  # the second in reverse order
RANKS = 2  # processes per launch


class SmokeRun(NamedTuple):
    proc: subprocess.CompletedProcess  # the driver's exit status and output
    out: Path  # its --out report
    prof: Path  # its --profile folder


def run_bench_step_smoke(tmp: Path) -> SmokeRun:
    """The run, into folder ``tmp`` (conftest.py's session fixture ``bench_step_smoke`` makes it once)."""
    out, prof = tmp / "step.json", tmp / "prof"
    cmd = [sys.executable, str(BENCH / "bench_step.py"), "--methods", "erm,iga_fused", "--dtype", "fp32",
           "--layers", "1", "--hidden", "64", "--vocab", "128", "--seq", "16", "--steps", str(STEPS),
           "--warmup", "1", "--rounds", str(ROUNDS), "--gpus", str(RANKS), "--out", str(out),
           "--profile", str(prof), "--deepspeed-checks"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    return SmokeRun(proc, out, prof)
