"""Where a small model's training step goes: the real trainer on a grid's cell, under torch.profiler.

    python tools/profile_train_step.py --grid configs/experiments/replication_smollm2.yaml --out runs/profile-step --methods erm,iga --steps 40

For each method (a key of the grid's methods or ablations) it trains seed 0 of that cell for
``--steps`` steps with the cell's exact run config, profiles ``--active`` steps after
``--warmup``, and prints, per method: the median step wall time (unprofiled steps), the device's busy time per step
(the sum of kernel times), the host's time per step in the largest operator groups, and the
number of kernels launched per step. A step whose device is busy for a small part of its wall
time is bound by the host (Python, launches, syncs), and more processes per GPU will fit.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import yaml



_DEVICE_TOTAL = re.compile(r"Self (?:CUDA|device|XPU) time total: ([0-9.]+)(us|ms|s)\b")
_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def device_busy_ms(table: str) -> float:
    """The device's total kernel time (ms) that torch's own operator table reports (0 on a CPU)."""
    match = _DEVICE_TOTAL.search(table)
    return float(match[1]) * _UNIT_MS[match[2]] if match else 0.0


def profile_method(grid, key: str, out: Path, steps: int, warmup: int, active: int, top: int,
                   overrides: dict[str, object], python_profile: bool = False) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from iga_ds.config.run import config_from_dict
    from iga_ds.experiments.experiment import cell_data, prepare_grid
    from iga_ds.experiments.grid import Cell, cell_run_dict
    from iga_ds.train.trainer import Trainer

    variants = {v.key: v for v in grid.variants}
    if key not in variants:
        raise SystemExit(f"--methods: {key!r} is not a method or ablation of {grid.path}; "
                         f"expected one of {', '.join(variants)}")
    prepared = prepare_grid(grid, out, progress=False, log=lambda m: None)
    cell = Cell(variants[key], grid.seeds[0])
    cell_dir = out / f"profile-{key}"
    cell_dir.mkdir(parents=True, exist_ok=True)
    train_file, _, _ = cell_data(grid, cell, prepared, cell_dir)  # e.g. CoT-Distill's single instances
    run = cell_run_dict(grid, cell, cell_dir, train_file, out)
    run.setdefault("schedule", {})["max_steps"] = steps
    run.setdefault("logging", {}).update(progress=False, tensorboard=False)
    for dotted, value in overrides.items():  # e.g. model.attn_implementation=sdpa
        *parents, last = dotted.split(".")
        node = run
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    cfg = config_from_dict(run)
    if python_profile:
        return python_profile_method(cfg, key, warmup, active, top)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, schedule=schedule(wait=warmup, warmup=1, active=active))
    with prof:
        result = Trainer(cfg, quiet=True, on_step_end=lambda step, record: prof.step()).run()
    walls = _unprofiled_walls(result.history, warmup)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"))
    table = events.table(sort_by="cpu_time_total", row_limit=top)
    busy = device_busy_ms(events.table(row_limit=1)) / active
    return {"method": key, **_wall_summary(walls), "device_busy_ms": busy,
            "kernels_per_step": launches / active, "table": table}


def _unprofiled_walls(history: list[dict], warmup: int) -> list[float]:
    """Step wall times (ms) of the steps after the first two (start-up) and before profiling (the
    profilers slow the steps they watch)."""
    return [r["step_time_s"] * 1e3 for r in history[2:warmup] or history]


def _wall_summary(walls: list[float]) -> dict:
    """The median step and the spread (10th and 90th percentiles) of the steps timed."""
    ordered = sorted(walls)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return {"step_ms": statistics.median(ordered), "p10_ms": pick(0.1), "p90_ms": pick(0.9), "timed_steps": len(ordered)}


def python_profile_method(cfg, key: str, warmup: int, active: int, top: int) -> dict:
    """The Python functions the host spends the step in (cProfile over ``active`` steps after
    ``warmup``): where a host-bound step's time goes, below the operator level."""
    import cProfile
    import io
    import pstats

    from iga_ds.train.trainer import Trainer

    prof = cProfile.Profile()

    def on_step_end(step: int, record) -> None:
        if step == warmup:
            prof.enable()
        elif step == warmup + active:
            prof.disable()

    result = Trainer(cfg, quiet=True, on_step_end=on_step_end).run()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    for order in ("tottime", "cumulative"):
        text.write(f"\n### sorted by {order}\n")
        stats.sort_stats(order).print_stats(top)
    return {"method": key, **_wall_summary(_unprofiled_walls(result.history, warmup)),
            "device_busy_ms": None, "kernels_per_step": None, "table": text.getvalue()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", required=True, help="a grid YAML (its cell's run config is profiled)")
    p.add_argument("--out", required=True, help="folder for the grid's data and the profiled runs")
    p.add_argument("--methods", default="erm,iga", help="comma-separated method or ablation keys of the grid")
    p.add_argument("--steps", type=int, default=40, help="steps per run (warm-up + profiled + the rest)")
    p.add_argument("--warmup", type=int, default=10, help="steps before profiling starts")
    p.add_argument("--active", type=int, default=10, help="profiled steps")
    p.add_argument("--top", type=int, default=25, help="rows of each operator table")
    p.add_argument("--python-profile", action="store_true",
                   help="the Python functions by host time (cProfile) instead of torch's operator table")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run setting of every profiled cell (YAML value), e.g. model.attn_implementation=sdpa")
    args = p.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    if args.warmup + 1 + args.active > args.steps:
        p.error("--steps must cover --warmup + 1 + --active")

    import torch

    from iga_ds.experiments.grid import load_grid

    grid = load_grid(args.grid)
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    rows = [profile_method(grid, key.strip(), Path(args.out), args.steps, args.warmup, args.active, args.top, overrides,
                           args.python_profile)
            for key in args.methods.split(",") if key.strip()]
    what = "Python functions" if args.python_profile else "operators"
    for row in rows:
        print(f"\n## {row['method']}: {what} by host time over {args.active} steps\n{row['table']}")
    print(f"\ncard: {card}; grid {args.grid}; {args.active} profiled steps after {args.warmup}"
          + "".join(f"; {item}" for item in args.set))
    print("| method | step ms (median) | p10-p90 ms | timed steps | device busy ms/step | busy share "
          "| kernel launches/step |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if row["device_busy_ms"] is None:  # cProfile watches the host only
            device = "- | - | -"
        else:
            share = row["device_busy_ms"] / row["step_ms"] if row["step_ms"] else 0.0
            device = f"{row['device_busy_ms']:.1f} | {share:.0%} | {row['kernels_per_step']:.0f}"
        print(f"| {row['method']} | {row['step_ms']:.1f} | {row['p10_ms']:.1f}-{row['p90_ms']:.1f} "
              f"| {row['timed_steps']} | {device} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
