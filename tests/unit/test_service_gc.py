"""`shared.service.freeze_startup_heap`: what a service made while starting leaves garbage collection, what it
makes later does not, and the collector is on afterwards (`kvpath serve` runs startup with it off)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from shared.service import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.peer: Node = self


@pytest.fixture
def collector_off() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def test_startup_objects_are_frozen_and_later_garbage_is_collected(collector_off: None) -> None:
    startup_cycle = Node()  # garbage startup left behind: frozen with the rest, never collected
    startup_ref = weakref.ref(startup_cycle)
    kept = [[i] for i in range(1_000)]  # what a started service keeps
    del startup_cycle
    freeze_startup_heap()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(kept)
    # the gauge reads the count when scraped; frozen objects freed meanwhile (anywhere in this process)
    # only lower it, and nothing freezes in between
    before = gc.get_freeze_count()
    scraped = REGISTRY.get_sample_value("kvpath_process_gc_frozen_objects")
    assert scraped is not None and gc.get_freeze_count() <= scraped <= before
    later_cycle = Node()
    later_ref = weakref.ref(later_cycle)
    del later_cycle
    gc.collect()
    assert later_ref() is None
    assert startup_ref() is not None  # the price: startup's own cycles stay (under a megabyte measured)
