"""The boundary's phases timed on the device's own clock, without a wait while the step is
prepared: the engine hook reports them once the optimizer step is queued.
"""
from __future__ import annotations

import time

import torch


class PhaseClock:
    """Marks in the boundary, timed as the device reaches them: CUDA events on the current
    stream (recording one does not wait for the device), host time on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, object] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, first: str, last: str) -> float:
        """Seconds from mark ``first`` to mark ``last`` (waiting for the device to reach it)."""
        if first == last:
            return 0.0
        a, b = self.marks[first], self.marks[last]
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a
