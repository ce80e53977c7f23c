"""workers/runtime/shared_tail.py against the real redis-server: the followers of one process read and decode the log once,
each folds exactly the log, a follower created late reads its gap, and a catch_up sees every entry appended before
it (its own writes included)."""

from __future__ import annotations

import redis
from logbuilder import LogBuilder

from rolledger.events.store import EventLog
from rolledger.schemas.events import Event
from rolledger.workers.runtime.runtime import Follower
from rolledger.workflows.reducer import fold
from rolledger.workflows.state import RunState


def folded(events: list[Event]) -> str:
    state = RunState()
    for e in events:
        fold(state, e)
    return state.digest()


def test_followers_of_one_process_share_one_read_and_fold_exactly_the_log(
    redis_client: redis.Redis, run_id: str
) -> None:
    b = LogBuilder(run_id=run_id).start_run()
    for _ in range(3):
        b.group()
    events = b.build()
    log = EventLog(redis_client, run_id)
    log.append_many(events[:5])
    a, c = Follower(log), Follower(EventLog(redis_client, run_id))
    assert a.tail is c.tail  # one tail per run and connection pool
    assert [s.event for s in a.catch_up()] == events[:5]
    reads = a.tail.reads
    got = c.catch_up()
    assert a.tail.reads == reads  # the second follower was served from the buffer: no read, no decode
    assert [s.event for s in got] == events[:5]
    log.append_many(events[5:])
    assert [s.event for s in c.catch_up()] == events[5:]  # everything appended before the call
    assert [s.event for s in a.poll(block_ms=1000)] == events[5:]
    assert a.tail.reads == reads + 1  # the new entries were read once for both followers
    assert a.state.digest() == c.state.digest() == folded(events)


def test_a_follower_created_after_the_buffer_moved_on_reads_its_gap(redis_client: redis.Redis, run_id: str) -> None:
    b = LogBuilder(run_id=run_id).start_run()
    for _ in range(4):
        b.group()
    events = b.build()
    log = EventLog(redis_client, run_id)
    log.append_many(events)
    first = Follower(log)
    first.catch_up()  # the only registered follower folded everything: the buffer drops it
    late = Follower(log)
    assert [s.event for s in late.catch_up()] == events
    assert late.state.digest() == first.state.digest() == folded(events)


def test_poll_times_out_empty_and_then_sees_a_new_entry(redis_client: redis.Redis, run_id: str) -> None:
    events = LogBuilder(run_id=run_id).start_run().group().build()
    log = EventLog(redis_client, run_id)
    log.append_many(events[:1])
    f, g = Follower(log), Follower(log)
    assert len(f.poll(block_ms=1000)) == 1 and len(g.poll(block_ms=1000)) == 1
    assert f.poll(block_ms=20) == [] and g.catch_up() == []
    log.append_many(events[1:])
    assert [s.event for s in g.poll(block_ms=1000)] == events[1:]
    assert [s.event for s in f.catch_up()] == events[1:]
