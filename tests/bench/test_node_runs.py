"""bench/node_runs.sh (the one-node check list) in its dry run, and bench/node_summary.py on small files."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import bench_step  # bench/ is on the path: pytest's pythonpath option (pyproject.toml)
import node_summary

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "node_runs.sh"
SUMMARY = REPO / "bench" / "node_summary.py"


def dry_run(out: Path, *args: str, **env: str) -> tuple[str, list[str]]:
    """The dry run's output and its commands (the '+ ' lines, the marker cut off)."""
    base = {k: v for k, v in os.environ.items() if k not in ("NODE_GPUS", "DRY_RUN")}
    base["CUDA_VISIBLE_DEVICES"] = ""  # no GPU visible, whatever this machine has
    res = subprocess.run(["bash", str(SCRIPT), str(out), *args], cwd=REPO, env={**base, **env},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout, [line[2:] for line in res.stdout.splitlines() if line.startswith("+ ")]


def template_ds_config() -> str:
    text = (REPO / "slurm" / "pyxis.sbatch").read_text()
    return re.search(r"IGA_DS_CONFIG=\$\{IGA_DS_CONFIG:-([^}]+)\}", text).group(1)


def test_dry_run_without_gpus_plans_all_three_parts_for_eight(tmp_path):
    out = tmp_path / "node"
    text, commands = dry_run(out, "--dry-run")
    assert not out.exists(), "a dry run must not create anything"
    assert "plans for 8" in text
    assert all(c.startswith("timeout ") for c in commands[:-1])  # each stage under its own time limit
    # 1. the step benchmark on 1, 2, 4, 8 GPUs, ERM and IGA, each its own JSON
    for g in (1, 2, 4, 8):
        [bench] = [c for c in commands if f"bench/bench_step.py --gpus {g} " in c]
        assert "--methods erm,iga_fused" in bench and "--rounds 2" in bench
        assert bench.endswith(f"--out {out}/bench_step_{g}gpu.json")
    # 2. the equivalence test at world size 8, its JSON in OUT
    [equiv] = [c for c in commands if "tests/engine/test_ds_hook_gpu.py" in c]
    assert f"IGA_DS_RESULTS={out}" in equiv and "IGA_DS_GPU_WORLD=8" in equiv and "-m gpu" in equiv
    # 3. the template's launch line under torchrun on 8 GPUs, twice (the first in the background,
    # signalled), then the check of the step count
    runs = [c for c in commands if "launch/train.py" in c]
    assert len(runs) == 2 and runs[0] == runs[1] + " &", runs
    assert "torch.distributed.run --standalone --nproc_per_node 8 launch/train.py" in runs[1]
    assert f"--deepspeed {template_ds_config()}" in runs[1] and "resume=auto" in runs[1]
    assert f"output_dir={out}/train" in runs[1]
    lines = text.splitlines()
    signal = next(i for i, line in enumerate(lines) if "kill -USR1" in line)
    first, second = (lines.index("+ " + r) for r in runs)
    assert first < signal < second
    [check] = [c for c in commands if "--check-train" in c]
    assert "bench/node_summary.py" in check and "--train-steps 300" in check
    assert commands[-1].endswith(f"bench/node_summary.py {out} --train-steps 300")


def test_dry_run_training_overrides_are_valid_for_the_trainer(tmp_path):
    from iga_ds.train.batching import check_batch_layout
    from iga_ds.config.run import load_run_config

    for gpus in ("8", "3"):
        _, commands = dry_run(tmp_path / "node", "resume", NODE_GPUS=gpus, DRY_RUN="1")
        [run] = [c for c in commands if "launch/train.py" in c and not c.endswith("&")]
        argv = shlex.split(run)
        argv = argv[argv.index("launch/train.py") + 1:]
        config = argv[argv.index("--config") + 1]
        deepspeed = argv[argv.index("--deepspeed") + 1]
        overrides = [a for a in argv if "=" in a and not a.startswith("-")]
        cfg = load_run_config(REPO / config, overrides + [f"deepspeed={deepspeed}"])
        assert cfg.model.name_or_path == "builtin:tiny" and cfg.schedule.max_steps == 300
        assert check_batch_layout(cfg.data.groups_per_step, cfg.data.groups_per_micro_batch, int(gpus)) >= 1
        assert (REPO / deepspeed).exists() and json.loads((REPO / deepspeed).read_text())["bf16"]["enabled"]


def test_dry_run_on_fewer_gpus_says_what_it_skips(tmp_path):
    text, commands = dry_run(tmp_path / "node", "--dry-run", NODE_GPUS="2")
    assert [g for g in (1, 2, 4, 8) if any(f"--gpus {g} " in c for c in commands)] == [1, 2]
    assert "skipped bench_step_4gpu" in text and "skipped bench_step_8gpu" in text
    assert any("IGA_DS_GPU_WORLD=2" in c for c in commands)
    assert any("--nproc_per_node 2 launch/train.py" in c for c in commands)
    text, commands = dry_run(tmp_path / "node", "--dry-run", NODE_GPUS="1")
    assert "skipped equivalence" in text and not any("test_ds_hook_gpu.py" in c for c in commands)
    assert any("--nproc_per_node 1 launch/train.py" in c for c in commands)


def test_bad_arguments_exit_2(tmp_path):
    for args in ([], ["--dry-run"], [str(tmp_path), "--bogus"], [str(tmp_path), "other", "--dry-run"]):
        res = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert res.returncode == 2, (args, res.stdout, res.stderr)


# -- node_summary.py ---------------------------------------------------------------------------

SETTINGS = dict(micro=4, seq=512, gas=4, rank=16, alpha=32.0, dtype="bf16", tau=0.5, normalize="mean", warmup=3,
                steps=10, layers=None, hidden=None, config=None, grad_ckpt=False)


def bench_report(world: int, step_ms: dict[str, float], peak: dict[str, float],
                 fwd_bwd_ms: dict[str, float] | None = None) -> dict:
    """A report as bench_step.py writes it (its own summarize() builds the ratios); with
    ``fwd_bwd_ms``, the step's phases too (the boundary is the rest of the step)."""
    tokens = SETTINGS["micro"] * SETTINGS["seq"] * SETTINGS["gas"] * world
    results = [{"method": m, "step_ms": ms, "step_ms_all": [ms] * SETTINGS["steps"],
                "tokens_per_s": tokens / (ms / 1e3), "tokens_per_s_per_gpu": tokens / (ms / 1e3) / world,
                "peak_gib": peak[m], "method_ms": 0.0 if m == "erm" else 12.0, "comm_ms": 0.0 if m == "erm" else 3.0,
                "trainable_params": 16_777_216,
                **({"fwd_bwd_ms": fwd_bwd_ms[m], "boundary_ms": ms - fwd_bwd_ms[m]} if fwd_bwd_ms else {})}
               for m, ms in step_ms.items()]
    env = {"card": "NVIDIA H100 80GB HBM3", "world_size": world, "torch": "2.x", "cuda": "12.x", "deepspeed": "0.x",
           "transformers": "4.x", "peft": "0.x", "triton": "3.x", "python": "3.x"}
    return bench_step.summarize(results, env, SimpleNamespace(**SETTINGS))


def table_row(text: str, gpus: int, method: str) -> list[str]:
    [line] = [line for line in text.splitlines() if line.startswith(f"| {gpus} | {method} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_summary_scaling_efficiency_and_ratios(tmp_path):
    one = {"erm": 800.0, "iga_fused": 820.0}
    two = {"erm": 880.0, "iga_fused": 910.0}
    (tmp_path / "bench_step_1gpu.json").write_text(json.dumps(bench_report(1, one, {"erm": 20.0, "iga_fused": 20.5})))
    (tmp_path / "bench_step_2gpu.json").write_text(json.dumps(
        bench_report(2, two, {"erm": 18.0, "iga_fused": 18.4}, fwd_bwd_ms={"erm": 700.0, "iga_fused": 740.0})))
    res = subprocess.run([sys.executable, str(SUMMARY), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "summary.md").read_text()
    assert res.stdout.strip() == text.strip()
    tokens = 4 * 512 * 4  # per GPU and step
    for method in one:
        # tokens/s per GPU on 2 over on 1: the same tokens per GPU, so the step-time ratio inverted
        per_gpu_1 = tokens / (one[method] / 1e3)
        per_gpu_2 = 2 * tokens / (two[method] / 1e3) / 2
        assert table_row(text, 2, method)[6] == f"{per_gpu_2 / per_gpu_1:.3f}"
        assert abs(per_gpu_2 / per_gpu_1 - one[method] / two[method]) < 1e-12
        assert table_row(text, 1, method)[6] == "1.000"
        assert table_row(text, 2, method)[4] == f"{per_gpu_2:,.0f}"
        assert table_row(text, 2, method)[2] == f"{two[method]:.1f}"
    row = table_row(text, 2, "iga_fused")
    # ratios, then the method (12 ms), the capture (740 - 700) and the rest of the boundary
    # ((910 - 740) - (880 - 700) - 12 - 3)
    assert row[7:] == [f"{910 / 880:.3f}", f"{880 / 910:.3f}", f"{18.4 / 18.0:.3f}", "12.0", "40.0", "-25.0"]
    assert table_row(text, 2, "erm")[7:] == ["-"] * 6
    assert table_row(text, 1, "iga_fused")[11:] == ["-", "-"]  # a report without phases
    # the parts that did not run are named as such
    assert "No gpu_equivalence.json" in text and "Not run." in text


def test_summary_without_the_one_gpu_run_leaves_efficiency_blank(tmp_path):
    reports = {2: bench_report(2, {"erm": 880.0, "iga_fused": 910.0}, {"erm": 18.0, "iga_fused": 18.4})}
    rows = node_summary.scaling_rows(reports)
    assert [r["efficiency"] for r in rows] == [None, None]
    assert rows[1]["ratio_step"] == pytest.approx(910 / 880)


def test_summary_of_the_equivalence_json(tmp_path):
    record = {"card": "NVIDIA H100", "torch": "2.x", "dtype": "bf16", "steps": 3, "lr": 0.01, "world_size": 8,
              "sequences_per_step": 48, "metric": "||theta_W8 - theta_W1|| / ||theta_W1 - theta_0||",
              "methods": {"erm": {"w8_vs_w1": 0.05, "w8_bf16_vs_fp32_reference": 0.2},
                          "iga": {"w8_vs_w1": 0.0, "w8_bf16_vs_fp32_reference": 0.6},
                          "pcgrad": {"w8_vs_w1": 0.09, "w8_bf16_vs_fp32_reference": 0.2}}}
    (tmp_path / "gpu_equivalence.json").write_text(json.dumps(record))
    eq = node_summary.equivalence(tmp_path)
    assert eq["world_size"] == 8 and eq["ok"] and eq["bound"] == pytest.approx(0.1)
    text = node_summary.render(tmp_path)
    assert "world size 8 vs 1" in text and "| pcgrad | 0.09 | 0.2 |" in text and "PASS" in text
    record["methods"]["pcgrad"]["w8_vs_w1"] = 0.11
    (tmp_path / "gpu_equivalence.json").write_text(json.dumps(record))
    assert not node_summary.equivalence(tmp_path)["ok"]
    # a file from before the world_size field: 2 GPUs
    old = {"methods": {"erm": {"w2_vs_w1": 0.04}, "iga": {"w2_vs_w1": 0.0}}}
    (tmp_path / "gpu_equivalence.json").write_text(json.dumps(old))
    assert node_summary.equivalence(tmp_path)["world_size"] == 2 and node_summary.equivalence(tmp_path)["ok"]


def write_training(out: Path, steps: list[int], stopped: int | None, resumed: int | None, total: int = 10):
    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "train" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps))
    start = f"training LoRA r=8: 1 trainable of 2 parameters; method iga; 240 groups, {total} steps, world size 2\n"
    (out / "train_run1.log").write_text(
        start + (f"stopping (signal SIGUSR1): checkpoint saved at step {stopped}; rerun with resume: auto to "
                 "continue\n" if stopped else ""))
    (out / "train_run2.log").write_text(
        (f"resumed from {out}/train/checkpoints/step_{resumed:08d} at step {resumed}\n" if resumed else "") + start)


def check(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SUMMARY), str(out), "--check-train", *args], capture_output=True,
                          text=True, timeout=60)


def test_check_train_passes_a_resumed_run_and_fails_broken_ones(tmp_path):
    good = tmp_path / "good"
    write_training(good, list(range(1, 11)), stopped=4, resumed=4)
    res = check(good, "--train-steps", "10")
    assert res.returncode == 0 and "PASS" in res.stdout, res.stdout
    assert check(good).returncode == 0  # the step count from the log
    assert check(good, "--train-steps", "12").returncode == 1
    cases = {
        "repeated": (list(range(1, 5)) + list(range(3, 11)), 4, 4),  # steps logged twice
        "short": (list(range(1, 9)), 4, 4),  # did not reach the requested step
        "no_signal": (list(range(1, 11)), None, 4),
        "fresh_start": (list(range(1, 11)), 4, None),  # the second run started over
        "other_step": (list(range(1, 11)), 4, 3),
    }
    for name, (steps, stopped, resumed) in cases.items():
        write_training(tmp_path / name, steps, stopped, resumed)
        res = check(tmp_path / name, "--train-steps", "10")
        assert res.returncode == 1 and "FAIL" in res.stdout, (name, res.stdout)


def test_check_train_reads_metrics_as_the_package_reads_json_lines(tmp_path):
    write_training(tmp_path, list(range(1, 11)), stopped=4, resumed=4)
    metrics = tmp_path / "train" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 11, "lo')  # a last line cut off by a kill: skipped
    result = node_summary.check_train(tmp_path, 10)
    assert result["ok"] and result["last_step"] == 10, result["problems"]
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:4]) + '{"loss": 1.0}\n' + "".join(lines[4:10]))
    result = node_summary.check_train(tmp_path, 10)
    assert "metrics.jsonl line 5: not a step record" in result["problems"] and result["steps_logged"] == 10
    metrics.write_text("".join(lines[:4]) + '{"step": 5, "lo\n' + "".join(lines[4:10]))
    result = node_summary.check_train(tmp_path, 10)
    assert not result["ok"] and any("metrics.jsonl:5: not valid JSON" in p for p in result["problems"])


def test_summary_lists_stages_and_skips(tmp_path):
    (tmp_path / "stages.tsv").write_text("gpus\t0\nbench_step_1gpu\t0\nequivalence\t124\n")
    (tmp_path / "skipped.txt").write_text("bench_step_4gpu\tneeds 4 GPUs, 2 visible\n")
    text = node_summary.render(tmp_path)
    assert "| equivalence | 124 |" in text and "- bench_step_4gpu: needs 4 GPUs, 2 visible" in text
    assert "ran past its time limit" in text
    # the time-limit note only when a stage hit its limit
    (tmp_path / "stages.tsv").write_text("gpus\t0\ntrain_check\t1\n")
    assert "ran past its time limit" not in node_summary.render(tmp_path)


def test_step_ratio_interval_covers_the_true_ratio_and_narrows_with_steps():
    import random

    rng = random.Random(3)
    erm = [700 * rng.uniform(0.9, 1.2) for _ in range(20)]
    slower = [700 * 1.3 * rng.uniform(0.9, 1.2) for _ in range(20)]
    same = [700 * rng.uniform(0.9, 1.2) for _ in range(20)]
    lo, hi = bench_step.ratio_interval(slower, erm)
    assert lo < 1.3 < hi and lo > 1.0  # a 30% slower method is told apart from ERM
    lo, hi = bench_step.ratio_interval(same, erm)
    assert lo < 1.0 < hi  # the same distribution is not
    assert bench_step.ratio_interval(same, erm) == (lo, hi)  # deterministic
    erm_many = [700 * rng.uniform(0.9, 1.2) for _ in range(400)]
    same_many = [700 * rng.uniform(0.9, 1.2) for _ in range(400)]
    lo_many, hi_many = bench_step.ratio_interval(same_many, erm_many)
    assert hi_many - lo_many < (hi - lo) / 2
    report = bench_report(1, {"erm": 800.0, "iga_fused": 820.0}, {"erm": 20.0, "iga_fused": 20.5})
    assert report["results"][1]["ratio_step_interval90"] == [820.0 / 800.0, 820.0 / 800.0]
