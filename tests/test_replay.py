"""Replay (pure, workflows/replay.py) over log entries and snapshots, and the snapshot store on a real Redis
(events/snapshots.py): snapshot + tail equals the full replay, a corrupted snapshot is named, a store round-trips."""

from __future__ import annotations

import dataclasses

import msgpack
import redis
from logbuilder import LogBuilder

from rolledger.events.snapshots import Snapshot, latest_snapshot, stored_snapshots, take_snapshot
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.workflows.reducer import replay
from rolledger.workflows.replay import check_replay, rebuild, restore


def log() -> list[ev.Event]:
    b = LogBuilder(group_size=2).start_run()
    b.group()
    first = b.last_group
    b.update(1)
    b.group()
    b.consume([first, b.last_group], lags=(1, 0))
    b.update(2, fail_rank=0)
    return b.finish_run().build()


def entries(events: list[ev.Event]) -> list[tuple[str, ev.Event]]:
    return [(f"{1000 + i}-0", e) for i, e in enumerate(events)]


def snapshot_at(es: list[tuple[str, ev.Event]], k: int, stream_id: str | None = None) -> Snapshot:
    """The snapshot a store would hold after the first k entries (at entry k-1's stream id unless given)."""
    state = replay(e for _, e in es[:k])
    return Snapshot(stream_id or es[k - 1][0], state.last_event_id, state.digest(), msgpack.packb(state.to_dict()))


def test_snapshot_plus_tail_equals_the_full_replay_and_every_snapshot_is_checked() -> None:
    es = entries(log())
    full = replay(e for _, e in es)
    snaps = [snapshot_at(es, 3), snapshot_at(es, len(es) // 2)]
    report = check_replay(es, snaps)
    assert report.ok
    assert report.digest == report.digest_again == full.digest() == report.tail_digest
    assert [c[0] for c in report.snapshot_checks] == [s.event_id for s in snaps]
    assert all(rec == rep for _, rec, rep in report.snapshot_checks)
    assert report.last_stream_id == es[-1][0]
    state, last = rebuild(es, from_snapshot=snaps[-1])  # the whole log handed in: entries up to the snapshot skipped
    assert state.digest() == full.digest() and last == es[-1][0]
    assert rebuild(es[len(es) // 2 :], from_snapshot=snaps[-1])[0].digest() == full.digest()


def test_a_snapshot_whose_digest_disagrees_with_the_replay_is_reported() -> None:
    es = entries(log())
    good = snapshot_at(es, 4)
    bad = dataclasses.replace(good, digest="0" * 32)
    report = check_replay(es, [bad])
    assert not report.ok
    assert report.snapshot_checks == [(good.event_id, "0" * 32, good.digest)]


def test_until_stops_the_replay_and_picks_the_latest_snapshot_before_it() -> None:
    es = entries(log())
    k = len(es) // 2
    until = es[k][1].event_id
    snaps = [snapshot_at(es, 2), snapshot_at(es, k + 3)]  # the second lies after `until`: not used, not checked
    report = check_replay(es, snaps, until=until)
    assert report.last_stream_id == es[k][0]
    assert report.digest == replay(e for _, e in es[: k + 1]).digest() == report.tail_digest
    assert [c[0] for c in report.snapshot_checks] == [snaps[0].event_id]


def test_a_snapshot_between_two_entries_takes_the_tail_from_the_next_one() -> None:
    es = entries(log())
    between = snapshot_at(es, 5, stream_id=es[4][0].replace("-0", "-1"))  # after entry 4, before entry 5
    report = check_replay(es, [between])
    assert report.ok and report.tail_digest == report.digest and report.snapshot_checks == []


def test_no_snapshot_means_no_tail_check() -> None:
    report = check_replay(entries(log()), [])
    assert report.ok and report.tail_digest is None


def test_the_snapshot_store_round_trips_on_redis(redis_client: redis.Redis, run_id: str) -> None:
    log_ = EventLog(redis_client, run_id)
    events = log()
    assert latest_snapshot(redis_client, run_id) is None and stored_snapshots(redis_client, run_id) == []
    ids = [log_.append(e) for e in events]
    half = len(events) // 2
    first = take_snapshot(redis_client, run_id, replay(events[:half]), ids[half - 1])
    second = take_snapshot(redis_client, run_id, replay(events), ids[-1])
    assert stored_snapshots(redis_client, run_id) == [first, second]
    latest = latest_snapshot(redis_client, run_id)
    assert latest == second and latest is not None
    assert restore(latest).digest() == replay(events).digest() == latest.digest
    tail = log_.read("(" + first.stream_id)
    assert rebuild(tail, from_snapshot=first)[0].digest() == latest.digest
    report = check_replay(log_.read(), stored_snapshots(redis_client, run_id))
    assert report.ok and len(report.snapshot_checks) == 2
