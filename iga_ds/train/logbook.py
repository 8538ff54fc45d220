"""What rank 0 writes about each step: ``metrics.jsonl``, TensorBoard events, a progress bar,
and the same scalars to Weights & Biases and MLflow where ``logging.report_to`` names them
(:mod:`iga_ds.train.trackers`).

A resumed run first drops the lines a killed run wrote after its last checkpoint, and
TensorBoard purges its events past that step, so each step is logged once.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from iga_ds.config.run import LoggingConfig
from iga_ds.files import read_jsonl, write_jsonl
from iga_ds.progress import progress
from iga_ds.train.trackers import Trackers, scalars

METRICS_FILE = "metrics.jsonl"


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metric lines after ``last_step`` (left by a run killed after its last checkpoint),
    so a resumed run's metrics.jsonl has each step once."""
    if path.is_file():
        write_jsonl(path, [row for row in read_jsonl(path) if row.get("step", 0) <= last_step])


class Logbook:
    """Opened by every rank; only rank 0 (``active``) writes or shows anything."""

    def __init__(self, out: Path, settings: LoggingConfig, start_step: int, total_steps: int, label: str,
                 active: bool, quiet: bool = False):
        self.settings = settings
        self.total_steps = total_steps
        self.last_step = start_step
        # first: a missing client stops every rank before anything is opened
        self.trackers = Trackers(out, settings, resumed=start_step > 0, active=active, quiet=quiet)
        self.metrics = (out / METRICS_FILE).open("a", encoding="utf-8") if active else None
        self.writer = None
        if active and settings.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # loads TensorBoard's writer only when asked

            # purge_step drops events after the resumed step, so a resumed curve has no duplicates
            self.writer = SummaryWriter(log_dir=str(out / "tensorboard"),
                                        purge_step=start_step + 1 if start_step else None)
        self.bar = progress(total_steps, label, "step", initial=start_step,
                            enabled=active and settings.progress and not quiet)

    def write(self, record: dict[str, Any]) -> None:
        if self.metrics is None:
            return
        step = self.last_step = record["step"]
        if step % self.settings.every_steps == 0 or step == self.total_steps:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
            if self.writer is not None:
                for key, value in scalars(record).items():
                    self.writer.add_scalar(key.replace(".", "/"), value, step)
            self.trackers.log(record)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}")

    def close(self) -> None:
        """At the end, on a stop (signal, stop file, ``stop_at_step``) and on an error: called in
        the trainer's ``finally``, where ``sys.exc_info()`` is the error on its way out, if any."""
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.writer is not None:
            self.writer.close()
        error = sys.exc_info()[0]
        if error is not None and not issubclass(error, KeyboardInterrupt):
            self.trackers.close("FAILED")
        else:
            self.trackers.close("FINISHED" if error is None and self.last_step >= self.total_steps else "KILLED")
