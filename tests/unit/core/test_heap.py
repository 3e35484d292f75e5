"""Objects alive at start-up are frozen out of the cyclic collector's reach."""

from __future__ import annotations

import gc

from tidal.core.heap import freeze_startup_objects


def test_freeze_startup_objects_takes_live_objects_out_of_collections():
    survivors = [[i] for i in range(100)]  # lists: always tracked by the collector
    try:
        freeze_startup_objects()
        walked = {id(obj) for obj in gc.get_objects()}  # what a full collection would walk
        assert not any(id(obj) in walked for obj in survivors)
        assert gc.get_freeze_count() >= len(survivors)
        later = [0]  # created after start-up: collected as usual
        assert id(later) in {id(obj) for obj in gc.get_objects()}
    finally:
        gc.unfreeze()  # the rest of the test session collects normally
