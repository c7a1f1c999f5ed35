"""apply.GcPause: the collector stays off over nested critical sections and comes back after the last."""

from __future__ import annotations

import gc

from oobleck.operator.apply import GcPause


def test_pauses_nest_and_the_collector_comes_back():
    assert gc.isenabled()
    with GcPause() as outer:
        assert not gc.isenabled()
        with GcPause() as inner:
            inner.end()
            inner.end()  # twice: still one pause less, not two
            assert not gc.isenabled(), "the outer pause still holds"
        assert not gc.isenabled()
        outer.end()
        assert gc.isenabled(), "ended early: the collector is back inside the block"
    assert gc.isenabled()


def test_overlapping_pauses_of_concurrent_reconciles():
    first, second = GcPause(), GcPause()
    first.__enter__()
    second.__enter__()
    first.end()  # the first job finishes while the second is still patching
    assert not gc.isenabled()
    second.end()
    assert gc.isenabled()


def test_a_collector_disabled_by_someone_else_stays_disabled():
    gc.disable()
    try:
        with GcPause():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_garbage_made_during_a_pause_is_collected_after_it():
    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the cyclic collector frees it

    gc.collect()
    with GcPause():
        for _ in range(1000):
            Node()
        assert gc.get_count()[0] >= 1000, "no automatic collection while paused"
    assert gc.collect() >= 1000
