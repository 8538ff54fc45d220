"""The step table of docs/PERFORMANCE.md's "Where it stands", generated from archived runs.

Every ``docs/results/*/machine-<letter>-bench_step_<n>gpu.json`` (the JSON ``bench_step.py``
writes, archived with its log) becomes rows: machine, card, GPUs, rounds, and per method the
step time, its ratio to DeepSpeed's ERM with the 90% bootstrap interval, peak memory ratio, and
the method and "other" columns. The table sits between two markers in the doc:

    python bench/where_it_stands.py            # rewrite the table in docs/PERFORMANCE.md
    python bench/where_it_stands.py --check    # exit 1 when the doc differs from the archive

``tests/test_where_it_stands.py`` runs the check, so a number in the table is always the one in
an archived JSON.
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
RESULTS = ROOT / "docs" / "results"
BEGIN, END = "<!-- where-it-stands:begin (bench/where_it_stands.py) -->", "<!-- where-it-stands:end -->"
# machines are lettered A to Z, then AA, AB, ...
NAME = re.compile(r"machine-(?P<machine>[A-Z]{1,2})-bench_step_(?P<gpus>\d+)gpu\.json$")
HEADER = ("| machine | card | GPUs | rounds x steps | method | step ms | step / DeepSpeed's ERM (90% interval) "
          "| peak / ERM | method ms | other ms | log |")


def archived_runs(results: Path = RESULTS) -> list[tuple[str, int, Path]]:
    """(machine letters, GPUs, file) of every archived step run, in machine then GPU order."""
    runs = []
    for path in results.glob("*/machine-*-bench_step_*gpu.json"):
        match = NAME.search(path.name)
        if match:
            runs.append((match["machine"], int(match["gpus"]), path))
    return sorted(runs, key=lambda run: (len(run[0]), run[0], run[1]))


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def rows(machine: str, gpus: int, path: Path, results: Path = RESULTS) -> list[str]:
    """The table rows of one archived run, one per method."""
    run = json.loads(path.read_text())
    settings, card = run["settings"], run["env"]["card"]
    log = path.parent.relative_to(results.parent).as_posix() + "/README.md"
    out = []
    for r in run["results"]:
        interval = r.get("ratio_step_interval90")
        ratio = "-" if r["method"] == "erm" else (
            f"{r['ratio_step']:.3f}" + (f" ({interval[0]:.3f}-{interval[1]:.3f})" if interval else ""))
        out.append(f"| {machine} | {card} | {gpus} | {settings['rounds']} x {settings['steps']} | {r['method']} "
                   f"| {r['step_ms']:.1f} | {ratio} | {_cell(r.get('ratio_peak'), '.3f')} "
                   f"| {_cell(r.get('method_ms') if r['method'] != 'erm' else None, '.1f')} "
                   f"| {_cell(r.get('boundary_other_ms') if r['method'] != 'erm' else None, '.1f')} | [log]({log}) |")
    return out


def table(results: Path = RESULTS) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for machine, gpus, path in archived_runs(results):
        lines += rows(machine, gpus, path, results)
    return "\n".join(lines)


def render(doc_text: str, generated: str) -> str:
    """``doc_text`` with the text between the markers replaced by ``generated``."""
    start, end = doc_text.find(BEGIN), doc_text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{DOC.relative_to(ROOT)}: the markers {BEGIN!r} and {END!r} are missing")
    return doc_text[:start + len(BEGIN)] + "\n" + generated + "\n" + doc_text[end:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the doc's table differs from the archive")
    args = p.parse_args(argv)
    current = DOC.read_text()
    wanted = render(current, table())
    if args.check:
        if wanted != current:
            print(f"{DOC.relative_to(ROOT)}: the step table is stale; run python bench/where_it_stands.py",
                  file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        atomic_write_text(DOC, wanted)
    print(f"{DOC.relative_to(ROOT)}: {len(archived_runs())} archived runs in the step table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
