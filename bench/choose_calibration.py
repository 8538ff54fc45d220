"""Pick the replication's steps and learning rate from a calibration on ERM and the control only.

    python bench/choose_calibration.py runs/calibration-smollm2
    python bench/choose_calibration.py runs/calibration-smollm2 --set-grid configs/experiments/replication_smollm2.yaml

The calibration grid (configs/experiments/calibration_smollm2.yaml) trains ERM-SFT (the cue is
planted) and the control (the cue is neutral) at a few (learning rate, steps) settings. The rule,
fixed before any run: among the settings whose control is neither at the ceiling nor unlearned
(its OOD accuracy in [60, 95]%), take the one where ERM follows the wrong cue most above the
control (ERM's OOD wrong-cue rate minus the control's); ties go to fewer steps, then the lower
rate. When no setting qualifies, the largest gap wins, and the table says so. No method other
than ERM is looked at. ``--set-grid`` writes the choice into the ``schedule:`` line of the
replication grid marked ``# calibrated``.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path


from iga_ds.errors import UserError
from iga_ds.experiments.results import cell_cue_follow, load_results
from iga_ds.files import atomic_write_text, read_json

CONTROL_OOD = (60.0, 95.0)  # the control's OOD accuracy that counts as learned but not solved
SCHEDULE_LINE = re.compile(r"^(?P<indent>\s*)schedule: \{[^}]*\}(?P<rest>\s*# calibrated.*)$", re.MULTILINE)


@dataclass
class Setting:
    lr: float
    steps: int
    erm: dict[str, float | None]
    control: dict[str, float | None]

    @property
    def gap(self) -> float | None:
        e, c = self.erm.get("cue"), self.control.get("cue")
        return None if e is None or c is None else e - c

    @property
    def eligible(self) -> bool:
        ood = self.control.get("ood")
        return ood is not None and CONTROL_OOD[0] <= ood <= CONTROL_OOD[1] and self.gap is not None


def _schedule(folder: Path) -> tuple[float, int, bool]:
    """(lr, steps, is the control) of a calibration cell, from its cell_spec.json."""
    spec = read_json(folder / "cell_spec.json", objects=True)
    schedule = {**spec["run"].get("schedule", {}), **spec["variant"]["train"].get("schedule", {})}
    return float(schedule["lr"]), int(schedule["max_steps"]), spec["variant"].get("cue") == "neutral"


def settings(root: Path) -> list[Setting]:
    table: dict[tuple[float, int], dict[str, dict]] = {}
    for cell in load_results(root):
        if cell.method != "erm" and cell.info.get("train_method") != "erm":
            continue
        lr, steps, control = _schedule(root / cell.name)
        result = next(iter(cell.evals.values()), {})
        bench = next(iter(cell.evals), None)
        row = {"id": result.get("id_accuracy"), "ood": result.get("ood_accuracy"),
               "cue": cell_cue_follow(cell, bench) if bench else None}
        table.setdefault((lr, steps), {})["control" if control else "erm"] = row
    missing = [f"lr {lr:g}, {steps} steps" for (lr, steps), rows in table.items() if set(rows) != {"erm", "control"}]
    if missing or not table:
        raise UserError(f"{root}: the calibration is incomplete (no ERM and control pair for "
                        f"{'; '.join(missing) or 'any setting'})")
    return [Setting(lr, steps, rows["erm"], rows["control"]) for (lr, steps), rows in sorted(table.items())]


def choose(rows: list[Setting]) -> tuple[Setting, bool]:
    """The chosen setting, and whether it met the control's range (False: the fallback)."""
    pool = [s for s in rows if s.eligible] or [s for s in rows if s.gap is not None]
    if not pool:
        raise UserError("no setting measured the wrong-cue rate of both ERM and the control")
    best = max(pool, key=lambda s: (round(s.gap, 9), -s.steps, -s.lr))
    return best, best.eligible


def table(rows: list[Setting], chosen: Setting) -> str:
    def pct(x: float | None) -> str:
        return "–" if x is None else f"{x:.1f}"

    lines = ["| lr | steps | control ID | control OOD | control wrong cue | ERM ID | ERM OOD | ERM wrong cue "
             "| ERM - control, wrong cue | control in range | chosen |", "|" + "---|" * 11]
    for s in rows:
        lines.append(f"| {s.lr:g} | {s.steps} | {pct(s.control['id'])} | {pct(s.control['ood'])} | "
                     f"{pct(s.control['cue'])} | {pct(s.erm['id'])} | {pct(s.erm['ood'])} | {pct(s.erm['cue'])} | "
                     f"{pct(s.gap)} | {'yes' if s.eligible else 'no'} | {'**yes**' if s is chosen else ''} |")
    return "\n".join(lines)


def set_grid(grid: Path, chosen: Setting) -> None:
    text = grid.read_text(encoding="utf-8")
    match = SCHEDULE_LINE.search(text)
    if match is None:
        raise UserError(f"{grid}: no `schedule: {{...}}  # calibrated` line to write the choice into")
    old = re.search(r"\{(.*)\}", match.group(0)).group(1)
    fields = dict(part.strip().split(": ", 1) for part in old.split(","))
    fields["lr"], fields["max_steps"] = f"{chosen.lr:.1e}", str(chosen.steps)
    line = f"{match['indent']}schedule: {{{', '.join(f'{k}: {v}' for k, v in fields.items())}}}{match['rest']}"
    atomic_write_text(grid, text[:match.start()] + line + text[match.end():])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", help="the calibration grid's results folder")
    parser.add_argument("--set-grid", metavar="GRID", help="write the choice into this grid's calibrated schedule line")
    args = parser.parse_args(argv)
    try:
        rows = settings(Path(args.runs))
        chosen, in_range = choose(rows)
        print(table(rows, chosen))
        print(f"\nchosen: lr {chosen.lr:g}, {chosen.steps} steps"
              + ("" if in_range else f" (no control's OOD accuracy was in {CONTROL_OOD}: the largest gap)"))
        if args.set_grid:
            set_grid(Path(args.set_grid), chosen)
            print(f"wrote lr {chosen.lr:g} and max_steps {chosen.steps} into {args.set_grid}")
    except UserError as exc:
        print(f"choose_calibration: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
