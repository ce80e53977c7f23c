"""Append marks (issue 41): every log writer numbers its appends, and the audit names acknowledged appends the log
lost (what an uncoordinated failover loses) instead of passing the log.

The pure decision (workflows/log_marks.py) on hand-made marks; the writer's side (events/store.EventLog) against the
session's real redis-server: what each append's mark says, that a retry or a refused append claims nothing, and that
entries deleted from under a writer (what a promoted replica that lagged never had) make the audit VIOLATED, naming
the writer, its producer and the missing appends."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import redis
from logbuilder import LogBuilder

from rolledger.events.codec import decode, encode
from rolledger.events.envelope import make_event
from rolledger.events.keys import log_key
from rolledger.events.scan import scan_log
from rolledger.events.store import ConcurrencyConflict, EventLog, LogLostEntries, RunClosed
from rolledger.schemas.events import AppendMark, Event, RunFinished, SampleScored
from rolledger.schemas.statuses import RunStatus
from rolledger.workflows.audit import audit
from rolledger.workflows.audit_report import LOG_INTEGRITY, Verdict
from rolledger.workflows.log_marks import lost_appends


def scored(i: int, producer: str = "reward") -> Event:
    return make_event(
        SampleScored(sample_id=f"g{i}/0", group_id=f"g{i}", reward=0.0, correct=False),
        run_id="r",
        producer=producer,
        policy_version=0,
    )


def marked(i: int, origin: int, n: int, acked: int, producer: str = "reward") -> Event:
    return msgspec.structs.replace(scored(i, producer), append=AppendMark(origin=origin, n=n, acked=acked))


# ---------------------------------------------------------------- the pure decision
def test_a_whole_sequence_of_marks_loses_nothing() -> None:
    events = [marked(n, origin=7, n=n, acked=n - 1) for n in range(1, 6)]
    check = lost_appends(events)
    assert check.lost == () and check.checked == 4  # append 1 claims nothing


def test_appends_missing_below_an_acknowledged_one_are_named_once() -> None:
    kept = [1, 2, 3, 7, 8]  # 4-6 lost; 7 says 6 was acknowledged
    events = [marked(n, origin=7, n=n, acked=n - 1, producer="rank-0/s0") for n in kept]
    (gap,) = lost_appends(events).lost
    assert (gap.origin, gap.first, gap.last, gap.by, gap.producers) == (7, 4, 6, 7, ("rank-0/s0",))
    assert gap.by_event == events[3].event_id and gap.count == 3
    assert gap.message().startswith(
        "log writer 00000007 (producer rank-0/s0): appends 4-6 missing, though its append 7 "
    )
    assert "the log lost acknowledged events" in gap.message()


def test_unused_numbers_are_not_losses() -> None:
    """A refused or unanswered append leaves its number unused: absent, but never claimed acknowledged."""
    events = [marked(1, 9, 1, 0), marked(3, 9, 3, 1), marked(4, 9, 4, 3)]  # 2 never acknowledged
    assert lost_appends(events).lost == ()


def test_concurrent_claims_inside_one_stretch_name_it_once_up_to_the_highest() -> None:
    """Two threads of one writer: append 6 was encoded when 4 was the highest acknowledged, 7 when 5 was; 4 and 5
    are lost (and 3, never acknowledged, with them): one range 3-5."""
    events = [marked(1, 5, 1, 0), marked(2, 5, 2, 1), marked(6, 5, 6, 4), marked(7, 5, 7, 5)]
    (gap,) = lost_appends(events).lost
    assert (gap.first, gap.last, gap.by) == (3, 5, 7)


def test_writers_are_apart_and_the_first_append_of_each_claims_nothing() -> None:
    events = [marked(1, 1, 1, 0), marked(2, 2, 1, 0), marked(3, 2, 3, 2), marked(4, 1, 2, 1)]
    (gap,) = lost_appends(events).lost
    assert (gap.origin, gap.first, gap.last) == (2, 2, 2)
    assert gap.message().startswith("log writer 00000002 (producer reward): append 2 missing")


def test_events_without_marks_are_not_checked() -> None:
    """A log written before issue 41 (and events that are not the first of their append) carry no mark."""
    check = lost_appends([scored(i) for i in range(5)])
    assert check == type(check)(checked=0, lost=())


def test_a_mark_cannot_claim_itself_or_a_later_append() -> None:
    with pytest.raises(ValueError, match="acked: 3 is not below the append's own number 3"):
        AppendMark(origin=1, n=3, acked=3)


def test_the_mark_is_not_part_of_the_event() -> None:
    """Two copies of an event appended by two writers are the same event (the audit's duplicate check says so)."""
    event = scored(1)
    a = msgspec.structs.replace(event, append=AppendMark(origin=1, n=1, acked=0))
    b = msgspec.structs.replace(event, append=AppendMark(origin=2, n=5, acked=4))
    assert a == b == event and hash(a) == hash(b)
    assert not a != b  # noqa: SIM202 - __ne__ is defined apart from __eq__: checked too
    assert a != msgspec.structs.replace(a, producer="other")


def test_the_audit_names_the_loss_under_the_log_s_integrity() -> None:
    built = LogBuilder(group_size=2).start_run().group().finish_run().build()
    events = [msgspec.structs.replace(e, append=AppendMark(origin=3, n=i + 1, acked=i)) for i, e in enumerate(built)]
    assert audit(events).verdict is Verdict.OK
    assert audit(events).checked[LOG_INTEGRITY] >= len(events) - 1
    lossy = events[:4] + events[6:]  # appends 5 and 6 lost: their events with them
    report = audit(lossy)
    assert report.verdict is Verdict.VIOLATED
    gaps = [v for v in report.for_invariant(LOG_INTEGRITY) if "acknowledged" in v.message]
    assert len(gaps) == 1 and "appends 5-6 missing" in gaps[0].message
    assert gaps[0].event_ids == (events[6].event_id,)


# ---------------------------------------------------------------- the wire
def test_the_mark_travels_in_the_envelope_and_an_old_envelope_has_none() -> None:
    event = scored(1)
    mark = AppendMark(origin=0xFFFFFFFF, n=70_000, acked=69_999)
    data = encode(event, mark)
    assert decode(data).append == mark and decode(data) == event
    raw = msgpack.unpackb(data, raw=False)
    assert len(raw[2]) == 8 and raw[2][7] == [0xFFFFFFFF, 70_000, 69_999]
    v1 = msgpack.packb([raw[0], raw[1], raw[2][:7], raw[3]], use_bin_type=True)  # an envelope before issue 41
    assert decode(v1).append is None and decode(v1) == event
    assert len(data) - len(encode(event)) == 15  # a mark at worst (a 32-bit origin and n), against a nil
    assert len(encode(event)) - len(v1) == 1  # an event without one: the nil


# ---------------------------------------------------------------- the writer, against a real Redis
def _marks(client: redis.Redis, run_id: str) -> list[tuple[int, int] | None]:
    return [
        None if s.event.append is None else (s.event.append.n, s.event.append.acked)
        for s in scan_log(client, run_id).entries
    ]


def test_each_append_marks_its_first_event_with_its_number_and_the_last_acknowledged(
    redis_client: redis.Redis, run_id: str
) -> None:
    log = EventLog(redis_client, run_id)
    log.append(scored(1))
    log.append_many([scored(2), scored(3)])
    log.append_if([scored(4)], log.last_id())
    assert log.append_once([scored(5)], ["k"]) is not None
    assert _marks(redis_client, run_id) == [(1, 0), (2, 1), None, (3, 2), (4, 3)]
    assert {s.event.append.origin for s in scan_log(redis_client, run_id).entries if s.event.append} == {log.origin}


def test_a_retry_or_a_refused_append_claims_nothing(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    first = [scored(1), scored(2)]
    log.append_many(first)  # append 1
    log.append_many(first)  # 2: a retry, nothing written, so 2 is not acknowledged
    log.append_many([first[1], scored(3)])  # 3: its first event was recorded: the entry it writes has no mark
    with pytest.raises(ConcurrencyConflict):
        log.append_if([scored(4)], "0-1")  # 4: refused
    fifth = scored(5)
    assert log.append_once([fifth], ["k"]) is not None  # 5
    assert log.append_once([scored(6)], ["k"]) is None  # 6: refused
    log.append(make_event(RunFinished(status=RunStatus.COMPLETED), run_id="r", producer="c", policy_version=0))  # 7
    with pytest.raises(RunClosed):
        log.append(scored(8))  # 8: refused
    log.append(fifth)  # 9: a recorded event: nothing written
    assert _marks(redis_client, run_id) == [(1, 0), None, None, (5, 1), (7, 5)]
    report = audit(s.event for s in scan_log(redis_client, run_id).entries)
    assert not [v for v in report.violations if "acknowledged" in v.message]


def test_entries_lost_under_a_writer_make_the_audit_name_them(redis_client: redis.Redis, run_id: str) -> None:
    """What a replica promoted while it lagged never had: entries the primary acknowledged, gone from the log the
    writer goes on appending to (deleted here, on one Redis). The audit says VIOLATED and names them."""
    log = EventLog(redis_client, run_id)
    built = LogBuilder(group_size=2, run_id=run_id).start_run().group().group().finish_run().build()
    ids = [log.append(e) for e in built]
    assert audit(s.event for s in scan_log(redis_client, run_id).entries).verdict is Verdict.OK
    redis_client.xdel(log_key(run_id), *ids[9:12])  # appends 10-12
    report = audit(s.event for s in scan_log(redis_client, run_id).entries)
    assert report.verdict is Verdict.VIOLATED
    (gap,) = [v for v in report.violations if "acknowledged" in v.message]
    assert gap.invariant == LOG_INTEGRITY
    producers = "test, admission, rollout-0, reward"  # the builder plays every producer through one writer here
    assert f"log writer {log.origin:08x} (producers {producers}): appends 10-12 missing, though its append 13 " in (
        gap.message
    )


def test_a_conditional_append_on_a_log_that_ends_before_what_was_read_is_refused_as_a_loss(
    redis_client: redis.Redis, run_id: str
) -> None:
    """A coordinator's view ahead of the log (it read entries an uncoordinated failover then lost) would re-decide on
    the same view and be refused forever: the conflict names the loss instead."""
    log = EventLog(redis_client, run_id)
    kept = log.append(scored(1))
    read = log.append(scored(2))
    redis_client.xdel(log_key(run_id), read)
    with pytest.raises(LogLostEntries, match=f"the log ends at {kept}, before entry {read} that was read from it"):
        log.append_if([scored(3)], read)
    with pytest.raises(ConcurrencyConflict):  # behind the log's end: an ordinary conflict, re-decided and retried
        log.append_if([scored(3)], "0-1")
    assert log.append_if([scored(3)], kept)


def test_every_log_of_one_client_and_run_is_one_writer(redis_client: redis.Redis, run_id: str) -> None:
    """A worker restarted inside its process (a new EventLog on the process's client) goes on numbering where the
    dead one stopped; another client, or another run, is another writer."""
    first, restarted = EventLog(redis_client, run_id), EventLog(redis_client, run_id)
    first.append(scored(1))
    restarted.append(scored(2))
    assert restarted.origin == first.origin
    assert _marks(redis_client, run_id) == [(1, 0), (2, 1)]
    other = redis.Redis(connection_pool=redis_client.connection_pool)
    try:
        assert EventLog(other, run_id).origin != first.origin
    finally:
        other.close()
    assert EventLog(redis_client, run_id + "-b").origin != first.origin
