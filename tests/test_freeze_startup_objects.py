"""engine serve and engine bench put their start-up objects out of the collector's sight
(engine.engine.llm_engine.freeze_startup_objects): frozen, and yet a cycle dropped after one
call is collected by the next, so a process building engines one after another keeps no
garbage frozen."""

from __future__ import annotations

import gc
import weakref

from engine.engine.llm_engine import freeze_startup_objects


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_freezes_and_a_later_call_collects_what_was_dropped():
    try:
        node = Node()
        alive = weakref.ref(node)
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None, "a frozen cycle stays out of the collector's sight"
        freeze_startup_objects()
        assert alive() is None, "the next call looks at the frozen objects again"
    finally:
        gc.unfreeze()
