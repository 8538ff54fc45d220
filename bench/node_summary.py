"""The table of bench/node_runs.sh: OUT_DIR/summary.md from the JSON files and logs its stages left.

    python bench/node_summary.py OUT_DIR                                  # writes OUT_DIR/summary.md
    python bench/node_summary.py OUT_DIR --check-train --train-steps 300  # the resume check alone

Reads, where present: ``bench_step_<N>gpu.json`` (bench/bench_step.py's output: ``env``,
``settings``, one row per method in ``results``), ``gpu_equivalence.json``
(tests/engine/test_ds_hook_gpu.py), ``train/metrics.jsonl`` with ``train_run1.log`` and
``train_run2.log`` (the interrupted and the resumed training run), ``stages.tsv`` (stage, exit
status) and ``skipped.txt`` (stage, reason).

Scaling efficiency of a method on N GPUs: its tokens/s per GPU on N GPUs over its tokens/s per
GPU on 1 (1.0 is linear scaling; the global batch grows with N, micro-batch and accumulation
per GPU stay). IGA/ERM ratios are those of the same number of GPUs.
Exit status: summary mode 0 (1 when OUT_DIR does not exist); --check-train 1 when the check fails.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from iga_ds.errors import DataError
from iga_ds.files import iter_jsonl

BENCH_NAME = re.compile(r"bench_step_(\d+)gpu\.json$")
# the trainer says why it stopped: "stopping (signal SIGUSR1): checkpoint saved at step 150; ..."
STOPPED = re.compile(r"stopping(?: \([^)]*\))?: checkpoint saved at step (\d+)")
RESUMED = re.compile(r"resumed from .* at step (\d+)")
STARTED = re.compile(r"(\d+) steps, world size (\d+)")


def load_bench(out: Path) -> dict[int, dict]:
    """{number of GPUs: bench_step.py report} for the bench_step_<N>gpu.json files in ``out``."""
    reports = {}
    for path in sorted(out.glob("bench_step_*gpu.json")):
        match = BENCH_NAME.search(path.name)
        if match is None:
            continue
        report = json.loads(path.read_text())
        world = int(report.get("env", {}).get("world_size") or match.group(1))
        reports[world] = report
    return dict(sorted(reports.items()))


def _ratio(a, b):
    return a / b if a is not None and b else None


def scaling_rows(reports: dict[int, dict]) -> list[dict]:
    """One row per (number of GPUs, method): step time, throughput, memory, efficiency, IGA/ERM."""
    base = {r["method"]: r for r in reports.get(1, {}).get("results", [])}
    rows = []
    for gpus, report in reports.items():
        results = report.get("results", [])
        erm = next((r for r in results if r["method"] == "erm"), None)
        for r in results:
            one = base.get(r["method"])
            row = {
                "gpus": gpus,
                "method": r["method"],
                "step_ms": r["step_ms"],
                "tokens_per_s": r["tokens_per_s"],
                "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                "peak_gib": r.get("peak_gib"),
                "efficiency": _ratio(r["tokens_per_s_per_gpu"], one["tokens_per_s_per_gpu"] if one else None),
                "ratio_step": None,
                "ratio_tokens_per_s": None,
                "ratio_peak": None,
                # IGA's extra time by phase (bench_step.py: capture and the rest of the boundary
                # are differences against ERM's phases; absent in reports without the phases)
                "method_ms": r.get("method_ms") if r["method"] != "erm" else None,
                "capture_ms": r.get("capture_ms"),
                "other_ms": r.get("boundary_other_ms"),
            }
            if erm is not None and r["method"] != "erm":
                row["ratio_step"] = r.get("ratio_step", _ratio(r["step_ms"], erm["step_ms"]))
                row["ratio_tokens_per_s"] = r.get("ratio_tokens_per_s", _ratio(r["tokens_per_s"], erm["tokens_per_s"]))
                row["ratio_peak"] = r.get("ratio_peak", _ratio(r.get("peak_gib"), erm.get("peak_gib")))
            rows.append(row)
    return rows


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def bench_section(reports: dict[int, dict]) -> list[str]:
    lines = ["## 1. Optimizer step, ERM against IGA (bench/bench_step.py)", ""]
    if not reports:
        return lines + ["No bench_step_<N>gpu.json found.", ""]
    first = next(iter(reports.values()))
    env, s = first.get("env", {}), first.get("settings", {})
    lines += [
        f"{env.get('card', '?')}; torch {env.get('torch')}, CUDA {env.get('cuda')}, DeepSpeed {env.get('deepspeed')}, "
        f"transformers {env.get('transformers')}, peft {env.get('peft')}.",
        f"Model: {s.get('config') or 'LLaMA-2-7B shape'}"
        + (f", {s['layers']} layers" if s.get("layers") else "")
        + (f", hidden {s['hidden']}" if s.get("hidden") else "")
        + f"; LoRA r {s.get('rank')}, ZeRO-2, {s.get('dtype')}; micro-batch {s.get('micro')} x {s.get('seq')} tokens, "
        f"accumulation {s.get('gas')} per GPU; median of {s.get('steps')} steps after {s.get('warmup')}.",
        "Scaling efficiency: tokens/s per GPU on N GPUs / on 1 GPU, same method. IGA/ERM: same N. "
        "Capture: IGA's forward+backward phase - ERM's; other: IGA's boundary phase - ERM's - method - "
        "communication.",
        "",
        "| GPUs | method | step ms | tokens/s | tokens/s/GPU | peak GiB | scaling eff. | step IGA/ERM "
        "| tokens/s IGA/ERM | peak IGA/ERM | method ms | capture ms | other ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in scaling_rows(reports):
        lines.append(
            f"| {row['gpus']} | {row['method']} | {_cell(row['step_ms'], '.1f')} "
            f"| {_cell(row['tokens_per_s'], ',.0f')} "
            f"| {_cell(row['tokens_per_s_per_gpu'], ',.0f')} | {_cell(row['peak_gib'], '.2f')} "
            f"| {_cell(row['efficiency'], '.3f')} | {_cell(row['ratio_step'], '.3f')} "
            f"| {_cell(row['ratio_tokens_per_s'], '.3f')} | {_cell(row['ratio_peak'], '.3f')} "
            f"| {_cell(row['method_ms'], '.1f')} | {_cell(row['capture_ms'], '.1f')} | {_cell(row['other_ms'], '.1f')} |"
        )
    return lines + [""]


def equivalence(out: Path) -> dict | None:
    """gpu_equivalence.json with a verdict: every method's world-size difference <= max(2 x ERM's, 1e-3)."""
    path = out / "gpu_equivalence.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    world = int(record.get("world_size", 2))  # files written before the field existed: 2 GPUs
    key = f"w{world}_vs_w1"
    methods = record.get("methods", {})
    erm = methods.get("erm", {}).get(key)
    bound = None if erm is None else max(2 * erm, 1e-3)
    ok = bound is not None and all(m.get(key, float("inf")) <= bound for name, m in methods.items() if name != "erm")
    return {"world_size": world, "key": key, "methods": methods, "bound": bound, "ok": ok, "record": record}


def equivalence_section(eq: dict | None) -> list[str]:
    lines = ["## 2. ZeRO-2 bf16 equivalence, world size N against 1 (tests/engine/test_ds_hook_gpu.py)", ""]
    if eq is None:
        return lines + ["No gpu_equivalence.json (not run, skipped, or failed before writing it).", ""]
    world, key = eq["world_size"], eq["key"]
    rec = eq["record"]
    lines += [
        f"{rec.get('card', '?')}, torch {rec.get('torch')}; {rec.get('steps')} AdamW steps at lr {rec.get('lr')}"
        + (f", {rec['sequences_per_step']} sequences per step" if "sequences_per_step" in rec else "")
        + f". Figure: {rec.get('metric')}.",
        "",
        f"| method | world size {world} vs 1 (bf16) | bf16 world size {world} vs the fp32 reference |",
        "|---|---:|---:|",
    ]
    for name, m in eq["methods"].items():
        fp32 = m.get(f"w{world}_bf16_vs_fp32_reference")
        lines.append(f"| {name} | {_cell(m.get(key), '.4g')} | {_cell(fp32, '.4g')} |")
    verdict = "PASS" if eq["ok"] else "FAIL"
    bound = _cell(eq["bound"], ".4g")
    lines += ["", f"{verdict}: every other method within max(2 x ERM's difference, 1e-3) = {bound}.", ""]
    return lines


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def logged_steps(metrics: Path, problems: list[str]) -> list[int]:
    """The step of each record of metrics.jsonl, read as the package reads JSON Lines (a last
    line cut off by a kill is skipped). A record without a step is a problem; so is a line that
    is not JSON, which ends the reading."""
    steps = []
    try:
        for lineno, record in iter_jsonl(metrics, objects=False):
            try:
                steps.append(int(record["step"]))
            except (ValueError, KeyError, TypeError):
                problems.append(f"metrics.jsonl line {lineno}: not a step record")
    except DataError as exc:
        problems.append(str(exc))
    return steps


def check_train(out: Path, train_steps: int | None = None) -> dict:
    """The interrupted run stopped on its signal, the second resumed there, every step logged once to the end."""
    metrics = out / "train" / "metrics.jsonl"
    first, second = _read(out / "train_run1.log"), _read(out / "train_run2.log")
    result = {"ran": metrics.exists() or bool(first), "ok": False, "problems": [], "stopped_at": None,
              "resumed_at": None, "last_step": None, "steps_logged": 0, "world_size": None, "train_steps": train_steps}
    if not result["ran"]:
        result["problems"].append("no training output")
        return result
    problems = result["problems"]
    started = STARTED.findall(second) or STARTED.findall(first)
    if started:
        total, world = map(int, started[-1])
        result["world_size"] = world
        if train_steps is None:
            result["train_steps"] = train_steps = total
        elif total != train_steps:
            problems.append(f"the trainer planned {total} steps, not {train_steps}")
    if metrics.exists():
        steps = logged_steps(metrics, problems)
    else:
        steps = []
        problems.append("no train/metrics.jsonl")
    result["steps_logged"] = len(steps)
    result["last_step"] = steps[-1] if steps else None
    stopped = STOPPED.findall(first)
    resumed = RESUMED.findall(second)
    result["stopped_at"] = int(stopped[-1]) if stopped else None
    result["resumed_at"] = int(resumed[-1]) if resumed else None
    if result["stopped_at"] is None:
        problems.append("the first run did not report a checkpoint on the signal ('stopping (...): checkpoint saved at step')")
    if result["resumed_at"] is None:
        problems.append("the second run did not report a resume ('resumed from ... at step')")
    elif result["stopped_at"] is not None and result["resumed_at"] != result["stopped_at"]:
        problems.append(f"stopped at step {result['stopped_at']} but resumed at step {result['resumed_at']}")
    if train_steps is None:
        problems.append("the number of steps asked for is unknown (pass --train-steps)")
    else:
        if result["stopped_at"] is not None and not 0 < result["stopped_at"] < train_steps:
            problems.append(f"the signal's checkpoint at step {result['stopped_at']} is not inside 1..{train_steps - 1}")
        if steps != list(range(1, train_steps + 1)):
            dup = len(steps) - len(set(steps))
            problems.append(f"metrics.jsonl steps are not 1..{train_steps} once each ({len(steps)} lines, "
                            f"last {result['last_step']}, {dup} repeated)")
    result["ok"] = not problems
    return result


def train_section(train: dict) -> list[str]:
    lines = ["## 3. Launch line under torchrun: SIGUSR1 midway, then resume (launch/train.py)", ""]
    if not train["ran"]:
        return lines + ["Not run.", ""]
    lines += [
        f"World size {_cell(train['world_size'], 'd')}; {_cell(train['train_steps'], 'd')} steps asked for; "
        f"the signalled run saved at step {_cell(train['stopped_at'], 'd')}, the second run resumed at step "
        f"{_cell(train['resumed_at'], 'd')} and logged up to step {_cell(train['last_step'], 'd')} "
        f"({train['steps_logged']} lines in metrics.jsonl).",
        "",
        "PASS: every step logged once, continuing from the signal's checkpoint to the last step."
        if train["ok"] else "FAIL: " + "; ".join(train["problems"]) + ".",
        "",
    ]
    return lines


def _table_file(path: Path) -> list[tuple[str, str]]:
    return [tuple(line.split("\t", 1)) for line in _read(path).splitlines() if "\t" in line]


def stages_section(out: Path) -> list[str]:
    lines = ["## Stages", ""]
    stages = _table_file(out / "stages.tsv")
    if stages:
        lines += ["| stage | exit |", "|---|---:|"] + [f"| {name} | {rc} |" for name, rc in stages]
        if any(rc.strip() == "124" for _, rc in stages):
            lines += ["", "Exit 124: the stage ran past its time limit."]
    else:
        lines.append("No stages.tsv.")
    skipped = _table_file(out / "skipped.txt")
    if skipped:
        lines += ["", "Skipped:"] + [f"- {name}: {why}" for name, why in skipped]
    return lines + [""]


def render(out: Path, train_steps: int | None = None) -> str:
    lines = [f"# One-node checks: {out.name}", ""]
    lines += bench_section(load_bench(out))
    lines += equivalence_section(equivalence(out))
    lines += train_section(check_train(out, train_steps))
    lines += stages_section(out)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="the OUT_DIR of bench/node_runs.sh")
    p.add_argument("--train-steps", type=int, help="steps the training run was asked for (default: from its log)")
    p.add_argument("--check-train", action="store_true", help="only the resume check; exit 1 when it fails")
    args = p.parse_args(argv)
    if not args.out_dir.is_dir():
        print(f"node_summary.py: {args.out_dir}: no such directory", file=sys.stderr)
        return 1
    if args.check_train:
        train = check_train(args.out_dir, args.train_steps)
        print("\n".join(train_section(train)))
        return 0 if train["ok"] else 1
    text = render(args.out_dir, args.train_steps)
    (args.out_dir / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
