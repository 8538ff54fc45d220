"""The latest archived figures per card: docs/PERFORMANCE.md's table, generated from results/.

    python bench/perf_table.py            # print the table
    python bench/perf_table.py --write    # put it between the markers in docs/PERFORMANCE.md
    python bench/perf_table.py --check    # exit 1 when the doc's table differs from the archive

It reads the JSON that ``bench_step.py``, ``bench_method.py`` and ``bench_train.py`` write, archived in the
campaign folders that results/README.md lists (oldest first, each with the commit that archived
it). For each card and benchmark (the step on N GPUs, the method alone, the precision rule,
training throughput per model shape beside its anchors) the
latest campaign that ran it gives the rows, one per archived run. ``tests/bench/test_perf_table.py``
runs the check, so a figure in the doc is always one in an archived JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from iga_ds.files import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "PERFORMANCE.md"
RESULTS = ROOT / "results"
BEGIN, END = "<!-- perf-table:start (bench/perf_table.py) -->", "<!-- perf-table:end -->"
HEADER = "| card | benchmark | figure | campaign | archived |"
# an index row: | [folder](folder/) | date time | commit | ...
INDEX_ROW = re.compile(r"^\| \[(?P<folder>[^\]]+)\]\([^)]*\) \| (?P<date>[\d-]+ [\d:]+) \| (?P<commit>[0-9a-f]{7,40}) \|",
                       re.M)
# the names the runs were archived under: an optional machine prefix, then the script's default
MACHINE_PREFIX = r"machine-(?P<letter>[A-Z]{1,2})-|(?P<short>[A-Z])_"
PREFIX = rf"(?:{MACHINE_PREFIX})?"
STEP = re.compile(PREFIX + r"bench_step_(?P<gpus>\d+)gpu(?:_targets)?\.json$")  # gpu_runs.sh: targetsN
METHOD = re.compile(PREFIX + r"bench_method\.json$")
RULE = re.compile(PREFIX + r"bench_method_rule\.json$")
TRAIN = re.compile(PREFIX + r"bench_train(?:_[A-Za-z0-9-]+)?\.json$")  # e.g. bench_train_smollm2.json
TRAIN_ANCHORS = (("hf_trainer", "HF Trainer"), ("torch", "plain loop"), ("torch_no_cudnn", "cuDNN-off loop"))
# bench_method.py's fused variants, float32 then bf16
METHOD_VARIANTS = ("batched_triton", "batched_triton_bf16", "batched_triton_bf16_q1p16")


def campaigns(results: Path = RESULTS) -> dict[str, tuple[int, str, str]]:
    """folder -> (position in the index, archive date, commit), from results/README.md."""
    text = (results / "README.md").read_text(encoding="utf-8")
    return {m["folder"]: (i, m["date"], m["commit"]) for i, m in enumerate(INDEX_ROW.finditer(text))}


BENCHMARK_FILES = (STEP, METHOD, RULE, TRAIN)


def benchmark(path: Path, run: dict) -> tuple[int, str]:
    """(sort order, name) of the benchmark an archived file holds (a name of ``BENCHMARK_FILES``)."""
    if TRAIN.fullmatch(path.name):
        settings = run["settings"]
        return 200, f"training, {settings.get('shape') or Path(settings['model_dir']).name}"
    if m := STEP.fullmatch(path.name):
        gpus = int(m["gpus"])
        return gpus, f"step, {gpus} GPU" + ("s" if gpus > 1 else "")
    if METHOD.fullmatch(path.name):
        return 100, "method alone"
    return 101, "precision rule"


def _step_figure(run: dict) -> str:
    parts = []
    for r in run["results"]:
        if r["method"] == "erm":
            continue
        interval = r.get("ratio_step_interval90")
        text = f"`{r['method']}`: step / ERM {r['ratio_step']:.3f}"
        text += f" ({interval[0]:.3f}-{interval[1]:.3f})" if interval else ""
        for key, label, fmt in (("ratio_peak", "peak / ERM", ".3f"), ("method_ms", "method", ".1f"),
                                ("boundary_other_ms", "other", ".1f")):
            if r.get(key) is not None:
                text += f", {label} {r[key]:{fmt}}" + (" ms" if key.endswith("_ms") else "")
        parts.append(text)
    steps = f"{run['settings']['rounds']} x {run['settings']['steps']} steps"
    return "; ".join(parts) + f" ({steps})"


def _method_figure(run: dict) -> str:
    timed = [f"`{v}` {run['variants'][v]['median_ms']:.1f} ms" for v in METHOD_VARIANTS if v in run["variants"]]
    ok = "within tolerance" if run.get("within_tolerance") else "OUTSIDE tolerance"
    return ", ".join(timed) + f" (median wall time, {run['modules']} modules; {ok})"


def _rule_figure(run: dict) -> str:
    rule = run["precision_rule"]
    batches = rule["batches"]
    worst = {key: max(b["variants"]["bf16_q1p16"][key]["max"] for b in batches)
             for key in ("error_over_carried_noise", "rank_r_over_optimal")}
    failed = ", ".join(f"`{v}`" for v in rule["failed"]) or "none"
    return (f"{len(batches)} batches of {Path(rule['model']).name}: `bf16_q1p16` error <= "
            f"{worst['error_over_carried_noise']:.3f} of the carried noise, rank-r error <= "
            f"{worst['rank_r_over_optimal']:.4f} of the optimal; offered variants that broke the rule: {failed}")


def _train_figure(run: dict) -> str:
    ran = {r["variant"]: r for r in run["variants"] if "tokens_per_s" in r}
    parts = []
    for name, row in ran.items():
        text = f"`{name}` {row['tokens_per_s']:,.0f} tokens/s"
        if name.startswith("iga_ds"):  # the trainer against what users would run instead
            text += "".join(f", {row['tokens_per_s'] / ran[a]['tokens_per_s']:.2f}x {label}"
                            for a, label in TRAIN_ANCHORS if a in ran)
        if row.get("mfu") is not None:
            text += f", MFU {100 * row['mfu']:.1f}%"
        parts.append(text)
    # the method's cost, paired by step (bench_train.py's "paired"; runs before it have none)
    # (each layout's IGA against its ERM: iga_ds_iga_packed_liger against iga_ds_erm_packed_liger)
    parts += [f"IGA / ERM{p['variant'].removeprefix('iga_ds_iga').replace('_', ' ')} step {p['step_ratio']:.3f} "
              f"({p['interval90'][0]:.3f}-{p['interval90'][1]:.3f}) paired"
              for p in run.get("paired", ()) if p["variant"].startswith("iga_ds_iga")
              and p["baseline"] == p["variant"].replace("iga_ds_iga", "iga_ds_erm", 1)]
    missed = [r["variant"] for r in run["variants"] if r["variant"] not in ran]
    settings = run["settings"]
    rounds = max((row.get("rounds", 1) for row in ran.values()), default=1)
    tail = f"{settings['steps']} steps, {settings['warmup_steps']} left out"
    tail = f"{rounds} rounds of {tail} of each" if rounds > 1 else tail
    return "; ".join(parts) + (f"; not run: {', '.join(missed)}" if missed else "") + f" ({tail})"


def figure(kind: str, run: dict) -> str:
    if kind.startswith("training"):
        return _train_figure(run)
    if kind.startswith("step"):
        return _step_figure(run)
    return _method_figure(run) if kind == "method alone" else _rule_figure(run)


MACHINE = re.compile(MACHINE_PREFIX)


def machine(path: Path) -> str | None:
    """The machine letter a campaign's file name carries (``machine-B-...``, ``B_...``), or None."""
    m = MACHINE.match(path.name)
    return (m["letter"] or m["short"]) if m else None


def latest_runs(results: Path = RESULTS) -> list[tuple[str, int, str, str, dict, str | None]]:
    """(card, order, benchmark, campaign, run, machine letter) of the latest campaign's runs per card
    and benchmark."""
    index = campaigns(results)
    found: dict[tuple[str, int, str], list[tuple[str, dict]]] = {}
    for path in sorted(results.rglob("*.json")):
        if not any(pattern.fullmatch(path.name) for pattern in BENCHMARK_FILES):
            continue
        run = json.loads(path.read_text(encoding="utf-8"))
        kind = benchmark(path, run)
        folder = path.relative_to(results).parts[0]
        if folder not in index:
            raise SystemExit(f"{path}: its campaign {folder!r} is missing from {results / 'README.md'}")
        card = run.get("card") or run.get("env", {}).get("card", "unknown")  # bench_train: at the top
        found.setdefault((card, *kind), []).append((folder, run, machine(path)))
    rows = []
    for (card, order, kind), runs in sorted(found.items()):
        last = max(index[folder][0] for folder, _, _ in runs)
        rows += [(card, order, kind, folder, run, letter) for folder, run, letter in runs if index[folder][0] == last]
    return rows


def table(results: Path = RESULTS) -> str:
    index = campaigns(results)
    lines = [HEADER, "|---|---|---|---|---|"]
    for card, _, kind, folder, run, letter in latest_runs(results):
        _, date, commit = index[folder]
        where = f"[{folder}](../results/{folder}/)" + (f", machine {letter}" if letter else "")
        lines.append(f"| {card} | {kind} | {figure(kind, run)} | {where} | {date}, {commit} |")
    return "\n".join(lines)


def render(doc_text: str, generated: str) -> str:
    """``doc_text`` with the text between the markers replaced by ``generated``."""
    start, end = doc_text.find(BEGIN), doc_text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{DOC.relative_to(ROOT)}: the markers {BEGIN!r} and {END!r} are missing")
    return doc_text[:start + len(BEGIN)] + "\n" + generated + "\n" + doc_text[end:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the table in docs/PERFORMANCE.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when the doc's table differs from the archive")
    args = p.parse_args(argv)
    generated = table()
    if not (args.write or args.check):
        print(generated)
        return 0
    current = DOC.read_text(encoding="utf-8")
    wanted = render(current, generated)
    if args.check:
        if wanted != current:
            print(f"{DOC.relative_to(ROOT)}: the table is stale; run python bench/perf_table.py --write", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        atomic_write_text(DOC, wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
