"""workers/runtime/gc_policy.py: what `serving()` changes in the collector while a run's roles run, and that it undoes it."""

from __future__ import annotations

import gc
import weakref

from rolledger.workers.runtime import gc_policy


def test_serving_freezes_what_exists_and_restores_on_exit() -> None:
    before = gc.get_threshold()
    built = [object() for _ in range(3)], {"a": [1]}  # something tracked, alive when serving() is entered
    with gc_policy.serving():
        assert gc.get_freeze_count() > 0
        assert gc.is_tracked(built[1])
        assert gc.get_threshold() == (gc_policy.YOUNG_THRESHOLD, gc_policy.OLDER_RATIO, gc_policy.OLDER_RATIO)
        with gc_policy.serving():  # an inner one changes nothing, and undoes nothing on its exit
            assert gc.get_threshold()[0] == gc_policy.YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == gc_policy.YOUNG_THRESHOLD
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before


class _Node:
    me: object = None


def test_a_cycle_made_while_serving_is_still_collected() -> None:
    with gc_policy.serving():
        node = _Node()
        node.me = node
        gone = weakref.ref(node)
        del node
        assert gone() is not None  # a cycle: reference counting alone does not free it
        gc.collect(0)  # a young collection, as the collector runs them while serving
        assert gone() is None


def test_it_is_undone_when_the_body_raises() -> None:
    before = gc.get_threshold()
    try:
        with gc_policy.serving():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
