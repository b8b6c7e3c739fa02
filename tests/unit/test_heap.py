"""The services freeze their startup heap, so full garbage-collection passes while serving walk
only what serving allocated."""
from __future__ import annotations

import gc
import weakref

from specd.rpc.heap import freeze_startup_heap


class _Node:
    pass


def test_startup_objects_leave_the_collectors_passes_and_still_free_by_refcount():
    startup = [{"i": i} for i in range(50_000)]  # what a model and a tokenizer leave alive
    plain = _Node()
    gone = weakref.ref(plain)
    try:
        frozen = freeze_startup_heap("test")
        assert frozen >= len(startup) and gc.get_freeze_count() == frozen
        served = _Node()
        served.me = served  # a cycle allocated while serving is still found by a full pass
        cycle = weakref.ref(served)
        del served
        gc.collect()
        assert cycle() is None and gc.get_freeze_count() == frozen
        del plain
        assert gone() is None  # a frozen object nothing refers to is still freed
    finally:
        gc.unfreeze()
