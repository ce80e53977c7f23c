"""Snapshots off the decision thread (events.snapshots.SnapshotWriter): a frozen copy of the state is digested and
written on the writer's thread, the stored snapshot matches the state it was taken of and passes the replay check, and
snapshots fall due by event count or by time."""

from __future__ import annotations

import redis
from logbuilder import LogBuilder

from rolledger.events.snapshots import SnapshotWriter, stored_snapshots
from rolledger.events.store import EventLog
from rolledger.workflows.reducer import replay
from rolledger.workflows.replay import check_replay, restore


def test_a_frozen_state_is_snapshotted_on_the_writers_thread(redis_client: redis.Redis, run_id: str) -> None:
    b = LogBuilder(group_size=2, run_id=run_id).start_run()
    for _ in range(3):
        b.group()
    b.consume([b.last_group])
    log = EventLog(redis_client, run_id)
    ids = [log.append(e) for e in b.build()]
    state = replay(b.build())
    writer = SnapshotWriter(redis_client, run_id, every_events=10)
    frozen = state.frozen()
    writer.submit(frozen, ids[-1], state.events_applied)
    b.group()  # the live state moves on after the copy: the snapshot is of the copy
    later = replay(b.build()[len(ids) :], state)
    assert writer.close(timeout_s=30)
    assert writer.taken == 1 and writer.failed == 0
    [snap] = stored_snapshots(redis_client, run_id)
    assert snap.stream_id == ids[-1] and snap.event_id == b.events[len(ids) - 1].event_id
    assert snap.digest == replay(b.build()[: len(ids)]).digest() != later.digest()
    assert restore(snap).digest() == snap.digest
    report = check_replay(log.read(), stored_snapshots(redis_client, run_id))
    assert report.ok and len(report.snapshot_checks) == 1


def test_a_snapshot_falls_due_by_events_or_by_time(redis_client: redis.Redis, run_id: str) -> None:
    writer = SnapshotWriter(redis_client, run_id, every_events=100, every_s=5.0, events_at_start=40)
    try:
        now = 1e9  # monotonic seconds, handed in: no clock in the test
        writer._at_time = now
        assert not writer.due(139, now)  # 99 new events, no time passed
        assert writer.due(140, now)  # 100 new events
        assert not writer.due(40, now + 60)  # time passed, but nothing new to snapshot
        assert writer.due(41, now + 5)  # one new event and the interval passed
    finally:
        assert writer.close()


def test_a_costly_snapshot_stretches_the_count_but_not_the_time(redis_client: redis.Redis, run_id: str) -> None:
    """A snapshot's cost follows the live state: the count rule waits for enough events that the last snapshot's CPU
    spread over them stays within the budget per event; the time rule still bounds what a restart replays."""
    writer = SnapshotWriter(redis_client, run_id, every_events=100, every_s=5.0, budget_per_event_s=2e-6)
    try:
        now = 1e9
        writer._at_time = now
        writer.last_cost_s = 0.0001  # 0.1 ms: 50 events' budget, under the count, which stands
        assert writer.due(100, now) and not writer.due(99, now)
        writer.last_cost_s = 0.1  # 100 ms: 50,000 events' budget
        assert not writer.due(49_999, now)
        assert writer.due(50_001, now)
        assert writer.due(1, now + 5)  # the time rule is not stretched
    finally:
        assert writer.close()


def test_the_writer_records_what_the_snapshot_cost(redis_client: redis.Redis, run_id: str) -> None:
    b = LogBuilder(group_size=2, run_id=run_id).start_run()
    for _ in range(3):
        b.group()
    log = EventLog(redis_client, run_id)
    ids = [log.append(e) for e in b.build()]
    state = replay(b.build())
    writer = SnapshotWriter(redis_client, run_id, every_events=10)
    writer.submit(state.frozen(), ids[-1], state.events_applied, copy_cost_s=0.5)
    assert writer.close(timeout_s=30)
    assert writer.taken == 1
    assert 0.5 < writer.last_cost_s < 1.5  # the copy's half second plus the writer's own (small) CPU
