"""Python's garbage collector while the hook is attached: the objects alive at attach frozen.

A full collection (generation 2) scans every object the collector tracks: about 610,000 in
a 7B run on one GPU, nearly all of them the libraries' modules, functions and types and the
model, alive for the whole run. Python starts one when the objects promoted to generation 2
since the last reach a quarter of those it holds. IGA's capture runs one autograd function
per LoRA layer and micro-batch, whose contexts live from forward to backward and so are
promoted, and now and then a full collection scans all of them: a stall of the host inside a
step that ERM's run does not pay (and at a different step on each rank).

Objects frozen by ``gc.freeze`` are left out of every collection, so a full collection scans
only what was made since the hook attached.
Frozen objects are never freed, not even at exit, so the hook collects once before it
freezes (garbage frozen would stay) and unfreezes at detach, or at exit for a hook never
detached (else objects left frozen are never finalized: no ``__del__``, and native bindings
report them as leaked). With several hooks attached, the first to attach freezes and the last
to detach unfreezes. Objects that something else froze before are unfrozen with the hook's:
freezing changes when memory is scanned, never what a program computes, so the hook always
does it: full collections of the objects alive at attach would otherwise stall boundaries.
"""
from __future__ import annotations

import atexit
import gc


class FrozenCollector:
    """Freeze the process's objects at ``start`` (attach), unfreeze at ``stop`` (detach)."""

    # instances between start and stop: the first freezes, the last unfreezes
    _holders = 0

    def __init__(self):
        self._holding = False

    def start(self) -> None:
        if self._holding:
            return
        if FrozenCollector._holders == 0:
            gc.collect()  # garbage frozen now (an earlier model's cycles) would stay until detach
            gc.freeze()
        FrozenCollector._holders += 1
        self._holding = True

    def stop(self) -> None:
        if not self._holding:
            return
        self._holding = False
        # at 0 already where the exit unfroze first (a hook detached by a later exit handler)
        FrozenCollector._holders = max(0, FrozenCollector._holders - 1)
        if FrozenCollector._holders == 0:
            gc.unfreeze()


def _unfreeze_at_exit() -> None:
    """Runs before the interpreter's last collection, which leaves frozen objects alone."""
    if FrozenCollector._holders:
        FrozenCollector._holders = 0
        gc.unfreeze()


atexit.register(_unfreeze_at_exit)
