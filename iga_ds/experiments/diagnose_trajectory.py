"""``iga-ds diagnose --every N``: the diagnostic over a training run's checkpoints.

Each checkpoint ``RUN/checkpoints/step_<S>`` whose step S is a multiple of N is measured as a
single ``iga-ds diagnose --run RUN/checkpoints/step_<S>`` would measure it: the same K groups,
methods and settings, the gradient's shares and the optimizer's update's (from that
checkpoint's own moments). The base loads once; each checkpoint's adapter weights go into it in
turn. The JSON (one entry per step) is rewritten, atomically, after every checkpoint: a killed
trajectory resumes without redoing the steps it has, and a rerun after the run saved more
checkpoints adds theirs. The figure beside it (the JSON's name with ``.png``) draws kept task
and kept cue against the step, one line per method.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from iga_ds.config.run import ADAPTER_CONFIG, RUN_CONFIG
from iga_ds.errors import UserError
from iga_ds.experiments.diagnose import (SPACES, Loaded, Settings, build_methods, load, measure_model, prepare,
                                         resolve_source)
from iga_ds.experiments.figures import diagnose_trajectory_figure
from iga_ds.files import atomic_write_json, read_json
from iga_ds.progress import progress as progress_of
from iga_ds.train.checkpoint import TAG_PREFIX

# what makes two adapters the same shape (the rest of adapter_config.json may name the base
# by a path relative to each folder)
ADAPTER_SHAPE = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_rslora", "peft_type")


def run_checkpoints(run: str, every: int) -> list[tuple[int, Path]]:
    """(step, folder) of each of the run's finished checkpoints at a multiple of ``every`` steps."""
    folder = Path(run).expanduser()
    if not (folder / RUN_CONFIG).is_file():
        raise UserError(f"--run {run}: --every needs a training run's folder (one with {RUN_CONFIG})")
    saved = sorted((int(p.name[len(TAG_PREFIX):]), p) for p in (folder / "checkpoints").glob(f"{TAG_PREFIX}*")
                   if p.is_dir() and p.name[len(TAG_PREFIX):].isdigit())
    chosen = [(step, path) for step, path in saved if step % every == 0]
    if not chosen:
        have = ", ".join(str(step) for step, _ in saved) or "none"
        raise UserError(f"--every {every}: {folder / 'checkpoints'} has no checkpoint at a multiple of {every} "
                        f"steps (its steps: {have}; checkpoint.every_steps sets how often a run saves)")
    return chosen


def trajectory_settings(settings: Settings, every: int) -> dict[str, Any]:
    """What the entries of one trajectory share; a resume must ask for the same."""
    return {"run": str(Path(settings.run).expanduser()), "every": every, "data": settings.data,
            "groups": settings.groups, "methods": list(settings.methods), "max_length": settings.max_length,
            "dtype": settings.dtype}


def finished_steps(out: Path, wanted: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The entries an earlier, killed or outrun, trajectory of the same settings wrote to ``out``."""
    if not out.is_file():
        return {}
    old = read_json(out, objects=True, error=UserError)
    if not isinstance(old.get("settings"), dict) or not isinstance(old.get("steps"), list):
        raise UserError(f"--out {out}: is not a trajectory's JSON (no settings and steps); give another --out")
    if old.get("settings") != wanted:
        differ = sorted(k for k in {*wanted, *old["settings"]} if old["settings"].get(k) != wanted.get(k))
        raise UserError(f"--out {out}: holds a trajectory of other settings ({', '.join(differ)}); "
                        "give another --out, or remove it to start over")
    return {int(entry["step"]): entry for entry in old.get("steps", [])}


def _adapter_shape(adapter: Path) -> dict[str, Any]:
    config = read_json(adapter / ADAPTER_CONFIG, objects=True, error=UserError)
    return {key: config.get(key) for key in ADAPTER_SHAPE}


def load_adapter_weights(loaded: Loaded, adapter: Path, first: Path) -> None:
    """Put ``adapter``'s weights into the model loaded with adapter ``first`` (same base and shape)."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    if _adapter_shape(adapter) != _adapter_shape(first):
        raise UserError(f"{adapter}: another LoRA shape than {first} ({ADAPTER_CONFIG} differs)")
    device = loaded.modules[0].lora_A.weight.device
    result = set_peft_model_state_dict(loaded.model, load_peft_weights(str(adapter), device=str(device)))
    if result.unexpected_keys:
        raise UserError(f"{adapter}: weights the model has no place for ({result.unexpected_keys[0]})")


def trajectory(settings: Settings, every: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Diagnose each chosen checkpoint of ``settings.run`` not yet in ``settings.out``, writing the
    JSON and the figure after each; returns the JSON."""
    build_methods(settings.methods)  # a bad --method fails before anything is read
    wanted = trajectory_settings(settings, every)
    chosen = run_checkpoints(settings.run, every)
    out = Path(settings.out)
    done = finished_steps(out, wanted)
    todo = [(step, path) for step, path in chosen if step not in done]
    figure = out.with_suffix(".png")
    bar = progress_of(len(chosen), "checkpoints", "checkpoint", initial=len(chosen) - len(todo),
                      enabled=settings.progress)
    loaded = first = inputs = None
    try:
        for step, path in todo:
            if loaded is None:  # the groups and the base, once: every checkpoint is of the same run
                source, inputs = prepare(replace(settings, run=str(path)))
                loaded, first = load(source, settings), source.adapter
            else:
                source = resolve_source(str(path))
                load_adapter_weights(loaded, source.adapter, first)
                # afresh: a method that carries statistics over steps starts each checkpoint as a single run does
                inputs = replace(inputs, methods=build_methods(settings.methods))
            log(f"diagnose: step {step} ({path})")
            done[step] = {"step": step, "checkpoint": str(path), **measure_model(loaded, source, inputs, settings, log)}
            _write(out, wanted, done, set(done) >= {s for s, _ in chosen}, figure)
            bar.update(1)
    finally:
        bar.close()
    if not todo:
        _write(out, wanted, done, True, figure)
    return read_json(out, objects=True, error=UserError)


def _write(out: Path, wanted: dict[str, Any], done: dict[int, dict[str, Any]], complete: bool, figure: Path) -> None:
    steps = [done[step] for step in sorted(done)]
    drawn = diagnose_trajectory_figure(steps, figure)
    atomic_write_json(out, {"settings": wanted, "complete": complete, "figure": figure.name if drawn else None,
                            "steps": steps})


def format_trajectory(result: dict[str, Any]) -> str:
    """The printed summary: per step and method, kept task and cue of the gradient and the update."""
    labels = [m["label"] for m in result["steps"][0]["methods"]] if result["steps"] else []
    width = max([len("method"), *(len(label) for label in labels)])
    cols = [f"{s[0].upper()} {w} {k}" for s in SPACES for w in ("grad", "upd") for k in ("task", "cue")]
    head = f"{'step':>8}  {'method':<{width}}  " + "  ".join(c.rjust(12) for c in cols)
    lines = ["kept of each direction as a share of ERM's: grad, the gradient's; upd, the optimizer's update's; "
             "W: weight space, F: factor space", head, "-" * len(head)]
    for entry in result["steps"]:
        for label in labels:
            cells = []
            for space in SPACES:
                for figures in (entry[space], entry["after_optimizer"][space]):
                    cells += [_cell(figures["methods"][label][k]) for k in ("task", "cue")]
            lines.append(f"{entry['step']:>8}  {label:<{width}}  " + "  ".join(c.rjust(12) for c in cells))
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
