"""The garbage-collector settings a serving coordinator (and a simulation) runs with."""

from __future__ import annotations

import gc

from fedlink.server.gc_tuning import YOUNG_THRESHOLD, GcControl


def test_quiet_raises_the_young_threshold_and_restores_it_after_the_last_block() -> None:
    control = GcControl()
    before = gc.get_threshold()
    with control.quiet():
        assert gc.get_threshold()[0] == max(before[0], YOUNG_THRESHOLD)
        with control.quiet():
            pass
        assert gc.get_threshold()[0] == max(before[0], YOUNG_THRESHOLD), "an inner block ended the outer one"
    assert gc.get_threshold() == before


def test_settle_freezes_what_is_alive_only_inside_a_quiet_block_and_the_end_unfreezes() -> None:
    control = GcControl()
    control.settle()
    assert gc.get_freeze_count() == 0, "settle froze the heap outside a quiet block"
    kept = [[i] for i in range(1_000)]
    with control.quiet():
        control.settle()
        assert gc.get_freeze_count() >= len(kept)
    assert gc.get_freeze_count() == 0
