"""One CPU smoke run of bench/bench_step.py, read by the tests below.

erm and iga_fused on a one-layer LLaMA of width 64, fp32, 2 timed steps after 1 warm-up, two
rounds (the second in reverse order), two ranks (gloo), with ``--profile``. Most of its time is start-up (one torch.distributed launch per method
and round, each process importing DeepSpeed), so the module runs it once and each test checks
its own claims on it. The profiled steps come after the timed ones and only in the first round
(the driver strips ``--profile`` from later rounds): the timed steps and the rounds are those of
a run without ``--profile``.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
STEPS = 2  # timed steps per method and round
ROUNDS = 2  # the second in reverse order
RANKS = 2  # processes per launch
RANGES = ("forward", "loss", "backward", "optimizer_step")  # the script's own ranges in a profiled step


class SmokeRun(NamedTuple):
    proc: subprocess.CompletedProcess  # the driver's exit status and output
    out: Path  # its --out report
    prof: Path  # its --profile folder


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> SmokeRun:
    tmp = tmp_path_factory.mktemp("bench-step-smoke")
    out, prof = tmp / "step.json", tmp / "prof"
    cmd = [sys.executable, str(BENCH / "bench_step.py"), "--methods", "erm,iga_fused", "--dtype", "fp32",
           "--layers", "1", "--hidden", "64", "--vocab", "128", "--seq", "16", "--steps", str(STEPS),
           "--warmup", "1", "--rounds", str(ROUNDS), "--gpus", str(RANKS), "--out", str(out),
           "--profile", str(prof)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    return SmokeRun(proc, out, prof)


@pytest.mark.slow
def test_the_driver_runs_rounds_and_reports_phases_and_ranks(smoke):
    proc, out, _ = smoke
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    erm, iga = report["results"]
    assert (erm["method"], iga["method"]) == ("erm", "iga_fused")
    assert iga["method_ms"] > 0 and erm["method_ms"] == 0
    assert iga["ratio_step"] == pytest.approx(iga["step_ms"] / erm["step_ms"])
    assert report["env"]["world_size"] == RANKS and "step x" in proc.stdout
    # each step split where the boundary begins: the phases, marked just inside the step's
    # own clock readings, cover it up to the host work between the marks, which a loaded
    # machine can stretch to a few percent (a wrong unit or sign would be far off)
    for row in (erm, iga):
        # each timed step's full garbage collections (host ms; 0 where it held none)
        assert len(row["full_gc_ms_all"]) == len(row["step_ms_all"]) and min(row["full_gc_ms_all"]) >= 0
        # the hook froze the process's objects: few are left to scan
        assert row["gc_frozen"] > 10 * row["gc_tracked"] > 0
        for total, a, b in zip(row["step_ms_all"], row["fwd_bwd_ms_all"], row["boundary_ms_all"]):
            assert a > 0 and b > 0 and a + b <= total and a + b >= 0.8 * total
    assert iga["capture_ms"] == pytest.approx(iga["fwd_bwd_ms"] - erm["fwd_bwd_ms"])
    assert "capture ms" in proc.stdout and "boundary ms" in proc.stdout and "frozen" in proc.stdout
    # two rounds, the second in reverse order: 2 timed steps each, pooled
    assert len(iga["step_ms_all"]) == 4 and len(iga["rounds"]) == 2 and report["settings"]["rounds"] == 2
    assert "[round 2/2]" in proc.stdout and "median step per round" in proc.stdout
    for row in (erm, iga):
        # every rank's own steps, pooled over the rounds as rank 0's are; rank 0's are the row's
        ranks = row["per_rank"]
        assert len(ranks) == RANKS and ranks[0]["boundary_ms_all"] == row["boundary_ms_all"]
        assert all(len(own[k]) == 4 for own in ranks for k in ("fwd_bwd_ms_all", "boundary_ms_all", "lag_ms_all"))
        for step, skew in enumerate(row["skew_ms_all"]):
            lags = [own["lag_ms_all"][step] for own in ranks]
            assert min(lags) == 0 and max(lags) == skew
            # no rank's boundary ends before the last rank reached it: its collectives need that one
            assert all(lag + own["boundary_ms_all"][step] >= skew - 1e-6 for lag, own in zip(lags, ranks))
    assert "the ranks reached the boundary" in proc.stdout and "rank 1: fwd+bwd" in proc.stdout
    launches = [line for line in proc.stdout.splitlines() if line.startswith("+ [round")]
    assert [line.split("--methods ")[1].split()[0] for line in launches] == ["erm", "iga_fused", "iga_fused", "erm"]


@pytest.mark.slow
def test_profile_writes_tables_and_summaries(smoke):
    # --profile: the profiled steps come in the first round only
    proc, out, prof = smoke
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["method"] for r in report["results"]] == ["erm", "iga_fused"]
    for r in report["results"]:
        # the profiled steps are not timed ones: 2 timed steps a round, pooled over the rounds
        assert r["profile_wall_ms"] > 0 and len(r["step_ms_all"]) == STEPS * ROUNDS == 4
        assert r["fused_gradient_checks"] is True
    # each rank profiles its own steps; no Chrome trace without --profile-trace
    assert sorted(p.name for p in prof.iterdir()) == sorted(
        f"{method}_rank{rank}_{kind}" for method in ("erm", "iga_fused") for rank in range(RANKS)
        for kind in ("ops.txt", "summary.json"))
    for method, rank in itertools.product(("erm", "iga_fused"), range(RANKS)):
        assert "Self CPU" in (prof / f"{method}_rank{rank}_ops.txt").read_text()
        summary = json.loads((prof / f"{method}_rank{rank}_summary.json").read_text())
        assert (summary["method"], summary["rank"], summary["steps"], summary["cuda"]) == (method, rank, 2, False)
        assert summary["wall_ms"] > 0 and summary["self_cpu_ms"] > 0 and summary["self_cuda_ms"] == 0
        # 2 steps x 4 micro-batches, each inside every range; the hook's parts of the boundary
        # once per step (its non-finite check once: every flag folded into one verdict)
        boundary = {"boundary/nonfinite_check": 2, "boundary/deepspeed_step": 2}
        if method == "iga_fused":
            # on several ranks the results come packed in the gathered buffer: no "results" range
            boundary.update({f"boundary/{part}": 2 for part in
                             ("combine", "method", "statistics", "write_grads", "reset")})
        assert {k: v["calls"] for k, v in summary["ranges"].items()} == {**{k: 8 for k in RANGES}, **boundary}
        assert 0 < len(summary["top_ops"]) <= 25
        for op in summary["top_ops"]:
            assert isinstance(op["name"], str) and op["calls"] > 0 and op["self_cpu_ms"] >= 0
