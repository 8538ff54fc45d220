"""`iga-ds demo` (what `make demo` runs): ERM against IGA on isomers with a planted shortcut.

Nothing is downloaded. Steps: synthesize isomer groups whose training split carries a
domain-specific cue sentence that predicts the answer (``shortcut``); hold out some of those
groups as the in-distribution (ID) test set, and use the generator's shortcut-free test split
as the out-of-distribution (OOD) set; pretrain (or load from the cache) the tiny LLaMA base;
fine-tune LoRA with each method through the same DeepSpeed ZeRO-2 engine (CPU, one process);
decode greedily, extract answers, and print accuracy ID and OOD, the Delta-gap (ID - OOD, in
points, smaller is more robust) and wall time; draw ``figure.png`` (the accuracies and each
method's training loss; ``iga-ds report`` links it). Sized for a few minutes on 2 CPU cores.
Progress is a bar on a terminal and a few plain lines in a log (:mod:`iga_ds.progress`);
``progress=False`` (``iga-ds demo --quiet``) leaves the step lines and the table alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

from iga_ds.config.deepspeed import default_ds_config
from iga_ds.config.run import TinyBaseConfig, config_from_dict
from iga_ds.data.splits import synthetic_eval_splits
from iga_ds.data.synth import synthesize
from iga_ds.evaluation.generation import eval_prompt_format, load_model
from iga_ds.evaluation.records import isomer_eval_items
from iga_ds.evaluation.runner import evaluate
from iga_ds.experiments.figures import demo_figure
from iga_ds.experiments.results import DEMO_FIGURE, load_run
from iga_ds.files import atomic_write_json, atomic_write_text, read_jsonl
from iga_ds.metrics.accuracy import format_percent
from iga_ds.progress import is_terminal
from iga_ds.train.pretrain import default_tiny_base
from iga_ds.train.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    groups: int = 300  # generated groups; 20% become the shortcut-free OOD split
    seed: int = 1
    shortcut: float = 0.9  # training-split probability that the cue names the answer
    id_groups: int = 20  # training-split groups held out as the ID test set
    ood_groups: int = 20
    steps: int = 50
    groups_per_step: int = 4
    lr: float = 2e-3  # the tiny base needs more than the paper's 2e-4 in 50 steps
    lora_r: int = 8
    max_new_tokens: int = 96


def format_table(rows: Sequence[dict]) -> str:
    head = f"{'method':<8} {'acc ID %':>9} {'acc OOD %':>10} {'delta-gap':>10} {'train s':>8} {'eval s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['method']:<8} {format_percent(r['id_accuracy'], '-', ''):>9} "
            f"{format_percent(r['ood_accuracy'], '-', ''):>10} {format_percent(r['delta_gap'], '-', ''):>10} "
            f"{r['train_seconds']:>8.0f} {r['eval_seconds']:>7.0f}"
        )
    return "\n".join(lines)


def _run_config(s: DemoSettings, method: str, out: Path, base: Path, train_file: Path, progress: bool) -> dict:
    return {
        "output_dir": str(out / method),
        "deepspeed": default_ds_config(),
        "model": {"name_or_path": str(base)},
        "lora": {"r": s.lora_r, "alpha": 2.0 * s.lora_r},
        "data": {"train": str(train_file), "groups_per_step": s.groups_per_step,
                 "groups_per_micro_batch": s.groups_per_step, "max_length": 256},
        "schedule": {"lr": s.lr, "max_steps": s.steps, "warmup_ratio": 0.1},
        "method": {"name": method},
        "resume": "never",
        "seed": s.seed,
        "logging": {"progress": progress},
    }


def _train_and_evaluate(s: DemoSettings, method: str, out: Path, base: Path, train_file: Path, items,
                        progress: bool = True) -> dict:
    """One row of the table: LoRA with ``method``, then greedy decoding of ``items``."""
    result = Trainer(config_from_dict(_run_config(s, method, out, base, train_file, progress))).run()
    n_id = sum(item.split == "id" for item in items)
    print(f"[4/4] greedy decoding on {n_id} ID + {len(items) - n_id} OOD instances", flush=True)
    t0 = time.perf_counter()
    model, tokenizer = load_model(base, result.adapter_dir, device="cpu", dtype="float32")
    fmt = eval_prompt_format(tokenizer, result.adapter_dir)  # plain: the tiny base has no chat template
    settings = {"benchmark": "synthetic", "base": str(base), "adapter": str(result.adapter_dir),
                "max_new_tokens": s.max_new_tokens, "greedy": True}
    ev = evaluate(items, model, tokenizer, out / method / "eval.json", settings, fmt.prompt,
                  max_new_tokens=s.max_new_tokens, batch_size=48, progress=progress, restart=True,
                  add_special_tokens=fmt.add_special_tokens)
    return {
        "method": method,
        "id_accuracy": ev["id_accuracy"],
        "ood_accuracy": ev["ood_accuracy"],
        "delta_gap": ev["delta_gap"],
        "train_seconds": result.wall_seconds,
        "eval_seconds": time.perf_counter() - t0,
        "final_loss": result.history[-1]["loss"] if result.history else None,
        "per_domain": {d: v.get("accuracy") for d, v in ev["per_domain"].items()},
    }


def run_demo(out_dir: str | os.PathLike = "demo_out", methods: Sequence[str] = ("erm", "iga"),
             steps: int | None = None, settings: DemoSettings | None = None,
             base_config: TinyBaseConfig | None = None, pretrain_groups: int | None = None,
             progress: bool = True) -> list[dict]:
    """Run the demo; ``base_config`` and ``pretrain_groups`` shrink the tiny base (tests);
    ``progress=False`` silences the progress of pretraining, training and decoding."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    s = settings or DemoSettings()
    if steps is not None:
        s = dataclasses.replace(s, steps=steps)
    t_all = time.perf_counter()
    out = Path(out_dir)
    print(f"[1/4] synthetic isomers: {s.groups} groups, shortcut {s.shortcut} in training", flush=True)
    synthesize(out / "data", groups=s.groups, seed=s.seed, shortcut=s.shortcut)
    fit, id_test, ood_test = synthetic_eval_splits(out / "data", s.id_groups, s.ood_groups)
    items = isomer_eval_items(read_jsonl(id_test), read_jsonl(ood_test), "synthetic")

    print("[2/4] tiny LLaMA base (pretrained from scratch once, then cached)", flush=True)
    base = default_tiny_base(base_config, progress=progress,
                             **({"groups": pretrain_groups} if pretrain_groups else {}))

    rows = []
    with _library_bars(progress and is_terminal(sys.stderr)):
        for i, method in enumerate(methods):
            print(f"[3/4] LoRA fine-tuning with {method} ({i + 1}/{len(methods)})", flush=True)
            rows.append(_train_and_evaluate(s, method, out, base, fit, items, progress))
    table = format_table(rows)
    total = time.perf_counter() - t_all
    atomic_write_json(out / "results.json", {"settings": dataclasses.asdict(s), "rows": rows, "total_seconds": total})
    atomic_write_text(out / "results.txt", table + "\n")
    figure = write_figure(out, rows)
    print("\n" + table)
    print(f"\ntotal {total:.0f}s; details in {out}/results.json and {out}/<method>/eval.json")
    print(f"figure: {figure} (accuracy ID and OOD, training loss); report: iga-ds report {out}")
    print(path_hint())
    return rows


def write_figure(out: Path, rows: Sequence[dict]) -> Path:
    """``out/figure.png``: each method's accuracy in and out of distribution and its training loss
    (its run's metrics.jsonl)."""
    runs = {r["method"]: load_run(out / r["method"]).cell for r in rows}
    demo_figure(rows, runs, out / DEMO_FIGURE)
    return out / DEMO_FIGURE


@contextlib.contextmanager
def _library_bars(show: bool):
    """Transformers' own bar ("Loading weights", at each model load) only where ours is a bar."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not show:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def path_hint() -> str:
    """The demo's last line: how to reach ``iga-ds`` for the commands README.md lists next
    (``make demo`` runs it from .venv, which is not on PATH until activated)."""
    if shutil.which("iga-ds"):
        return "next: iga-ds --help (README.md, Entry points)"
    activate = Path(sys.prefix) / "bin" / "activate"
    if sys.prefix != sys.base_prefix and activate.is_file():
        shown = os.path.relpath(activate) if activate.is_relative_to(Path.cwd()) else str(activate)
        return f"iga-ds is not on your PATH: . {shown}   (or pip install -e . into your own environment)"
    return "iga-ds is not on your PATH: pip install -e . into your environment"
