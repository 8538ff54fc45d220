"""The hook's frozen garbage collector (iga_ds.engine.collector) against Python's own."""
from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from iga_ds.engine.collector import FrozenCollector


class Node:
    """An object in a reference cycle: only a collection frees it."""

    def __init__(self):
        self.me = self


def cycle() -> weakref.ref:
    return weakref.ref(Node())


@pytest.fixture(autouse=True)
def nothing_frozen():
    gc.unfreeze()
    yield
    assert FrozenCollector._holders == 0
    gc.unfreeze()


def tracked(obj) -> bool:
    """Whether a collection would scan ``obj`` (frozen objects are left out of get_objects)."""
    return any(o is obj for o in gc.get_objects())


def test_objects_alive_at_start_are_left_out_until_stop():
    before = Node()
    collector = FrozenCollector()
    collector.start()
    after = Node()
    assert gc.get_freeze_count() > 0
    assert not tracked(before) and tracked(after)
    collector.stop()
    assert gc.get_freeze_count() == 0 and tracked(before)


def test_garbage_before_start_is_collected_not_frozen():
    old = cycle()
    collector = FrozenCollector()
    collector.start()
    try:
        assert old() is None
    finally:
        collector.stop()


def test_garbage_made_while_frozen_is_still_collected():
    collector = FrozenCollector()
    collector.start()
    try:
        new = cycle()
        assert new() is not None
        gc.collect()
        assert new() is None
    finally:
        collector.stop()


def test_the_last_holder_to_stop_unfreezes():
    first, second = FrozenCollector(), FrozenCollector()
    first.start()
    second.start()
    second.start()  # a second start of one holder counts once
    first.stop()
    assert gc.get_freeze_count() > 0
    first.stop()  # and so does a second stop
    assert gc.get_freeze_count() > 0
    second.stop()
    assert gc.get_freeze_count() == 0


def test_a_holder_stopped_after_the_exit_handler_unfroze_keeps_the_count_at_zero():
    from iga_ds.engine.collector import _unfreeze_at_exit

    collector = FrozenCollector()
    collector.start()
    _unfreeze_at_exit()
    assert gc.get_freeze_count() == 0 and FrozenCollector._holders == 0
    collector.stop()
    assert FrozenCollector._holders == 0
    again = FrozenCollector()
    again.start()  # a later hook freezes again
    assert gc.get_freeze_count() > 0
    again.stop()
    assert gc.get_freeze_count() == 0


EXIT_PROGRAM = """
import gc
from iga_ds.engine.collector import FrozenCollector

class Node:
    def __init__(self):
        self.me = self

    def __del__(self):
        print("finalized", flush=True)

node = Node()
FrozenCollector().start()  # never stopped
del node
"""


def test_objects_left_frozen_are_finalized_at_exit():
    """A hook never detached: what it froze is unfrozen at exit, so the interpreter's last
    collection (which skips frozen objects) finalizes it, as it does without the freeze."""
    proc = subprocess.run([sys.executable, "-c", EXIT_PROGRAM], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "finalized", (proc.stdout, proc.stderr)
