"""Where a training step's time goes: torch.profiler around a window of optimizer steps.

The loop asks for it in three lines::

    profiler = StepProfiler(out, steps, after, device, active=rank == 0, log=print)
    with profiler.step(step):          # inside the window: under torch.profiler
        train_step(step)
    profiler.finish()                  # the window ran past the run's end: write what it holds

Steps are counted from 0 over the whole run (a resumed run keeps its count): the window is steps
``[after, after + steps)``; a run that resumes past it profiles nothing. After the window's last
step (or at ``finish()`` when the run ends or stops inside it) rank 0 writes, atomically,
``profile.json`` (every operator of ``key_averages()`` with its self and total CPU and device
times in microseconds, the window's wall time and the device's busy time) and ``profile.txt``
(the top operators by self device time on a GPU, else by self CPU time, under a header line).
The wall time runs from the first profiled step's start to the last one's end, the device
synchronized at both: the loop's own work between the steps (logging, a checkpoint) is in it.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from iga_ds.files import atomic_write_json, atomic_write_text

PROFILE_JSON = "profile.json"
PROFILE_TXT = "profile.txt"
TOP_OPS = 25


class StepProfiler:
    """torch.profiler over steps ``[after, after + steps)`` of a loop; files into ``out_dir``.

    ``active``: whether this process profiles at all (rank 0 only, in the trainer); ``steps`` 0:
    never. ``start_step`` and ``total_steps`` (when known) say which steps this run will take,
    so that a window outside them is named in one line of ``log`` instead of passing silently.
    """

    def __init__(self, out_dir: str | Path, steps: int, after: int, device: Any = "cpu", active: bool = True,
                 log: Callable[[str], Any] | None = None, start_step: int = 0, total_steps: int | None = None):
        self.out_dir = Path(out_dir)
        self.first, self.end = after, after + steps
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.active = active and steps > 0
        self.log = log or (lambda message: None)
        self.profiled: list[int] = []  # the steps profiled so far
        self.paths: tuple[Path, Path] | None = None  # (profile.json, profile.txt) once written
        self._prof = None
        self._t0 = 0.0
        if self.active and not (start_step < self.end and self.first < (total_steps or self.end)):
            where = f"starts at step {start_step}" if start_step >= self.end else f"has {total_steps} steps"
            self.log(f"profile: nothing profiled: this run {where}, the window is steps {self.first + 1}-{self.end}")
            self.active = False

    def in_window(self, step: int) -> bool:
        return self.active and self.first <= step < self.end

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Step ``step`` (0-based), profiled when it falls in the window; the files after its last step."""
        if not self.in_window(step):
            yield
            return
        if self._prof is None:
            self._start()
        yield
        self.profiled.append(step)
        if step + 1 == self.end:
            self.finish()

    def finish(self) -> tuple[Path, Path] | None:
        """Stop the profiler if it runs and write the files of the steps it saw; their paths."""
        if self._prof is None:
            return self.paths
        synchronize(self.device)  # inside the profiler: the last step's kernels are recorded too
        wall_s = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.paths = self._write(prof.key_averages(), wall_s)
        self.log(f"profile: {len(self.profiled)} steps; wrote {self.paths[0]} and {self.paths[1]}")
        return self.paths

    def close(self) -> None:
        """Stop a profiler still running (the loop failed) without writing anything."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        synchronize(self.device)  # the steps before the window are not in it
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def _write(self, averages, wall_s: float) -> tuple[Path, Path]:
        summary = profile_summary(averages, wall_s, len(self.profiled), self.cuda)
        summary.update(first_step=self.profiled[0] + 1, last_step=self.profiled[-1] + 1,
                       device=str(self.device))  # 1-based, as metrics.jsonl counts steps
        self.out_dir.mkdir(parents=True, exist_ok=True)
        json_path, txt_path = self.out_dir / PROFILE_JSON, self.out_dir / PROFILE_TXT
        atomic_write_json(json_path, summary)
        atomic_write_text(txt_path, profile_table(averages, summary, self.cuda))
        return json_path, txt_path


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ranked_ops(averages, cuda: bool) -> list:
    """``key_averages()``'s operators, slowest first: by self device time on a GPU (then self CPU
    time), else by self CPU time. Device-side copies of user ranges (record_function) repeat their
    kernels' time and are left out."""
    ops = [e for e in averages if not (e.device_type != DeviceType.CPU and e.is_user_annotation)]
    key = (lambda e: (e.self_device_time_total, e.self_cpu_time_total)) if cuda else (lambda e: e.self_cpu_time_total)
    return sorted(ops, key=key, reverse=True)


def profile_summary(averages, wall_s: float, steps: int, cuda: bool) -> dict[str, Any]:
    """profile.json's content: the window's totals and every operator, slowest first."""
    ops = ranked_ops(averages, cuda)
    # kernels carry the device's time (the operators launching them repeat it), as in torch's own footer
    busy_us = sum(e.self_device_time_total for e in ops if e.device_type != DeviceType.CPU) if cuda else 0.0
    return {
        "steps": steps, "wall_s": wall_s, "wall_per_step_ms": 1e3 * wall_s / max(steps, 1),
        "device_busy_ms": busy_us / 1e3, "device_busy_per_step_ms": busy_us / 1e3 / max(steps, 1),
        "self_cpu_ms": sum(e.self_cpu_time_total for e in ops) / 1e3,
        "sorted_by": "self_device_time_us" if cuda else "self_cpu_time_us",
        "ops": [{"name": e.key, "count": e.count, "self_cpu_time_us": e.self_cpu_time_total,
                 "cpu_time_total_us": e.cpu_time_total, "self_device_time_us": e.self_device_time_total,
                 "device_time_total_us": e.device_time_total} for e in ops],
    }


def profile_table(averages, summary: dict[str, Any], cuda: bool, top: int = TOP_OPS) -> str:
    """profile.txt: a header line, then torch's table of the ``top`` operators."""
    header = (f"# {summary['steps']} optimizer steps profiled (steps {summary['first_step']}-{summary['last_step']}, "
              f"{summary['device']}): wall {summary['wall_per_step_ms']:.1f} ms per step")
    if cuda:
        header += f", device busy {summary['device_busy_per_step_ms']:.1f} ms per step"
    header += f"; top {top} operators by {'self device' if cuda else 'self CPU'} time\n"
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    return header + averages.table(sort_by=sort_by, row_limit=top, max_name_column_width=80) + "\n"
