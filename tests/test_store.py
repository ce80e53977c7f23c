"""events.store against the session's real redis-server: appends, idempotent retries, conditional appends, replay,
tail, dead letters for malformed entries, durability check."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgpack
import msgspec
import pytest
import redis
from logbuilder import payload_of

from rolledger.events.codec import encode, named_form
from rolledger.events.connection import connect
from rolledger.events.embedded import EmbeddedRedis
from rolledger.events.envelope import make_event
from rolledger.events.keys import dead_letter_key, log_key
from rolledger.events.outage import RedisUnavailable
from rolledger.events.store import (
    ConcurrencyConflict,
    EventLog,
    RunClosed,
    StoredEvent,
    as_str,
    dead_letter,
    read_dead_letters,
)
from rolledger.schemas.events import AdmissionPaused, AppendMark, Event, RunFinished, SampleScored
from rolledger.schemas.statuses import AdmissionReason, RunStatus


def scored(i: int, run_id: str = "r") -> Event:
    return make_event(
        SampleScored(sample_id=f"g{i}/0", group_id=f"g{i}", reward=i / 10, correct=i % 2 == 0),
        run_id=run_id,
        producer="test",
        policy_version=0,
    )


def test_append_and_read_back_in_order(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    assert log.key == log_key(run_id)
    assert log.last_id() is None and log.length() == 0
    events = [scored(i) for i in range(7)]
    ids = [log.append(events[0]), log.append(events[1])] + log.append_many(events[2:4]) + log.append_many(events[4:])
    order = [tuple(map(int, s.split("-"))) for s in ids]
    assert order == sorted(order) and len(set(ids)) == 4  # one entry per append call: 1, 1, 2 and 3 events
    assert ids[2] == ids[3] and ids[4] == ids[5] == ids[6] and ids[3] != ids[4]
    assert log.length() == 4 and log.last_id() == ids[-1]
    assert list(log.read(batch=3)) == [StoredEvent(i, e) for i, e in zip(ids, events)]  # pages of 3 entries, then 1
    assert [s.event for s in log.read(ids[1], ids[2])] == events[1:4]  # an entry is read whole
    fields = redis_client.xrange(log.key, ids[0], ids[0])[0][1]  # type: ignore[index]  # redis-py types replies Any | Awaitable
    first = AppendMark(origin=log.origin, n=1, acked=0)  # the writer's mark, in an append's first event
    assert fields == {b"e": encode(events[0], first), b"t": b"SampleScored"}
    fields = redis_client.xrange(log.key, ids[4], ids[4])[0][1]  # type: ignore[index]
    fourth = [encode(events[4], AppendMark(origin=log.origin, n=4, acked=3)), *(encode(e) for e in events[5:])]
    assert fields == {
        b"b": msgpack.packb(fourth, use_bin_type=True),  # the events' bytes, in order
        b"t": b"SampleScored,SampleScored,SampleScored",
    }
    assert log.append_many([]) == []


def test_idempotent_retry_returns_original_id(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    first, other = scored(1), scored(2)
    a = log.append_idempotent(first)
    log.append(other)
    assert log.append_idempotent(first) == a  # the retry after a "lost reply"
    assert log.append_idempotent(msgspec.structs.replace(first)) == a
    assert log.length() == 2
    assert [s.event for s in log.read()] == [first, other]


def test_conditional_append_conflict(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    with pytest.raises(ConcurrencyConflict) as info:
        log.append_if([scored(0)], "1-1")  # expects an entry, the log is empty
    assert (info.value.expected, info.value.actual) == ("1-1", None)

    ids = log.append_if([scored(1), scored(2)], None)  # None = expect an empty log
    assert log.last_id() == ids[-1] == ids[0]  # one entry
    # Two coordinators decided from the same state; only the first may append.
    winner, loser = [scored(3)], [scored(4)]
    won = log.append_if(winner, ids[-1])
    with pytest.raises(ConcurrencyConflict) as info:
        log.append_if(loser, ids[-1])
    assert info.value.expected == ids[-1] and info.value.actual == won[0]
    assert log.length() == 2

    # A retry of the call that won (its reply was lost) gets the original ids back, without a conflict.
    assert log.append_if(winner, ids[-1]) == won
    # Deduped by event id: an already recorded event inside a new batch keeps its id, the new one is appended.
    mixed = log.append_if([winner[0], scored(5)], won[0])
    assert mixed[0] == won[0] and log.length() == 3
    assert [payload_of(s.event, SampleScored).sample_id for s in log.read()] == ["g1/0", "g2/0", "g3/0", "g5/0"]


def test_append_if_and_idempotent_share_dedupe(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    event = scored(1)
    sid = log.append_idempotent(event)
    assert log.append_if([event], "0-1") == [sid]  # all recorded: a retry, no version check
    assert log.length() == 1


def test_read_dead_letters_malformed_entries_once(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    good1 = log.append(scored(1))
    garbage = as_str(redis_client.xadd(log.key, {b"e": b"\xc1 not msgpack", b"t": b"?"}))
    raw = named_form(encode(scored(2)))
    unknown = as_str(redis_client.xadd(log.key, {b"e": msgpack.packb({**raw, "t": "Bogus"})}))
    newer = as_str(redis_client.xadd(log.key, {b"e": msgpack.packb({**raw, "v": 7})}))
    no_field = as_str(redis_client.xadd(log.key, {b"x": b"1"}))
    good2 = log.append(scored(3))

    for _ in range(2):  # the second replay must not dead-letter again
        assert [s.stream_id for s in log.read(batch=2)] == [good1, good2]
    letters = read_dead_letters(redis_client, run_id)
    assert [d.source for d in letters] == [garbage, unknown, newer, no_field]
    reasons = [d.reason for d in letters]
    assert reasons[0].startswith("not msgpack")
    assert "unknown event type 'Bogus'" in reasons[1]
    assert "newer than this rolledger" in reasons[2]
    assert "no b'e' or b'b' field" in reasons[3]
    assert letters[0].raw == b"\xc1 not msgpack" and letters[0].consumer == "reader"


def test_dead_letter_function(redis_client: redis.Redis, run_id: str) -> None:
    a = dead_letter(redis_client, run_id, stream_id="5-0", raw=b"xx", reason="because", consumer="c")
    assert dead_letter(redis_client, run_id, stream_id="5-0", raw=b"xx", reason="again", consumer="c") == a
    b = dead_letter(redis_client, run_id, stream_id=None, raw=None, reason="no source", consumer="c")
    assert a != b and redis_client.xlen(dead_letter_key(run_id)) == 2
    letters = read_dead_letters(redis_client, run_id)
    assert letters[1].source is None and letters[1].raw is None and letters[1].reason == "no source"


def test_tail_blocks_then_returns_new_entries(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    first = log.append(scored(1))
    assert log.tail(first, block_ms=20) == []  # nothing after it yet: the block times out
    e2, e3 = scored(2), scored(3)
    ids = log.append_many([e2, e3])
    assert log.tail(first, block_ms=1000) == [StoredEvent(ids[0], e2), StoredEvent(ids[1], e3)]
    assert ids[0] == ids[1]  # one entry: `count` counts entries, and an entry is read whole
    assert log.tail(first, block_ms=1000, count=1) == [StoredEvent(ids[0], e2), StoredEvent(ids[1], e3)]


def test_types_other_than_scored(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    event = make_event(
        AdmissionPaused(reason=AdmissionReason.BYTES, queued_bytes=10), run_id=run_id, producer="adm", policy_version=3
    )
    sid = log.append_idempotent(event)
    assert list(log.read()) == [StoredEvent(sid, event)]


def test_wait_durable_reports_aof(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    log.append(scored(1))
    major, minor, _ = log.server_version
    assert (major, minor) >= (6, 2)
    assert log.wait_durable(timeout_ms=2000) is True  # the fixture's server runs with appendonly yes


def test_wait_durable_false_without_aof(tmp_path: Path, run_id: str) -> None:
    with EmbeddedRedis(tmp_path / "r") as server:  # a private server: switching AOF off must not touch the shared one
        client = connect(server.url)
        client.config_set("appendonly", "no")
        log = EventLog(client, run_id)
        log.append(scored(1))
        assert log.wait_durable(timeout_ms=100) is False
        client.close()


def test_read_filters_by_type_before_decoding(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    paused = make_event(
        AdmissionPaused(reason=AdmissionReason.LAG, lag=2), run_id=run_id, producer="adm", policy_version=1
    )
    ids = [log.append(scored(1)), *log.append_many([paused, scored(2)])]  # the second entry holds both types
    garbage_typed = as_str(redis_client.xadd(log.key, {b"e": b"\xc1", b"t": b"SampleScored"}))
    assert list(log.read(types={"AdmissionPaused"})) == [StoredEvent(ids[1], paused)]  # one event of a batch
    assert read_dead_letters(redis_client, run_id) == []  # the skipped garbage was never decoded
    assert [s.stream_id for s in log.read(types=["SampleScored"])] == [ids[0], ids[2]]
    assert [d.source for d in read_dead_letters(redis_client, run_id)] == [garbage_typed]
    assert log.tail(ids[0], block_ms=100, types={"AdmissionPaused"}) == [StoredEvent(ids[1], paused)]


def test_tail_moves_past_skipped_entries_instead_of_returning_early(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    first = log.append(scored(1))
    bad = as_str(redis_client.xadd(log.key, {b"e": b"\xc1"}))
    assert log.tail(first, block_ms=30) == []  # only garbage after `first`: waits out the block, no early []
    assert log.last_scanned_id == bad
    good = log.append(scored(2))
    assert [s.stream_id for s in log.tail(first, block_ms=1000)] == [good]
    assert [d.source for d in read_dead_letters(redis_client, run_id)] == [bad]  # dead-lettered once
    with pytest.raises(ValueError, match="block_ms"):
        log.tail(first, block_ms=0)


def finished(run_id: str = "r") -> Event:
    return make_event(
        RunFinished(status=RunStatus.COMPLETED, steps=1), run_id=run_id, producer="test", policy_version=0
    )


def test_append_many_retried_after_a_lost_reply_writes_nothing_twice(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    batch = [scored(1), scored(2)]
    ids = log.append_many(batch)
    log.append(scored(3))
    assert log.append_many(batch) == ids  # the retry: the original ids, nothing written
    assert log.append_many([batch[1], scored(4)])[0] == ids[1]  # a recorded event keeps its id in a mixed batch
    assert log.append(batch[0]) == ids[0]
    assert [payload_of(s.event, SampleScored).sample_id for s in log.read()] == ["g1/0", "g2/0", "g3/0", "g4/0"]
    assert log.length() == 3  # [1, 2], [3], [4]: no copy of 1 or 2


def test_a_batch_of_any_size_costs_three_commands(redis_client: redis.Redis, run_id: str) -> None:
    """One HMGET of the batch's event ids, one XADD of the batch as one entry and one HSET of the new ids per call,
    however many events (issue 12: the hash was two commands per event and the log one XADD per event, most of what
    an event cost Redis). Above 1,000 events the dedupe works in chunks of 1,000 (Lua's stack), and a retry of that
    large batch still writes nothing twice."""

    def calls() -> dict[str, int]:
        stats: dict[str, dict[str, int]] = redis_client.info("commandstats")  # type: ignore[assignment]
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}

    log = EventLog(redis_client, run_id)
    batch = [scored(i) for i in range(50)]
    before = calls()
    ids = log.append_many(batch)
    after = calls()
    spent = {k: after.get(k, 0) - before.get(k, 0) for k in ("hget", "hmget", "hset", "xadd")}
    assert spent == {"hget": 0, "hmget": 1, "hset": 1, "xadd": 1}
    assert log.append_many(batch) == ids and log.length() == 1

    large = [scored(i) for i in range(100, 2600)]
    large_ids = log.append_many(large)
    assert log.append_many(large) == large_ids and log.length() == 2
    assert [s.event.event_id for s in log.read()][50:] == [e.event_id for e in large]


def test_append_once_retried_after_success_returns_the_original_ids(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    batch = [scored(1), scored(2)]
    ids = log.append_once(batch, ["step:1"])
    assert ids is not None and len(ids) == 2
    assert log.append_once(batch, ["step:1"]) == ids  # the same call again (its reply was lost): not None
    assert log.append_once([scored(3)], ["step:1"]) is None  # another batch under a taken key
    assert [s.event for s in log.read()] == batch
    many = [f"group:{i}" for i in range(2500)]  # a step's keys, one per group it consumes: looked up in chunks
    assert log.append_once([scored(4)], many) is not None
    assert log.append_once([scored(5)], ["group:new", many[-1]]) is None  # taken in the last chunk
    assert log.append_once([scored(6)], ["group:new"]) is not None


def test_appends_after_run_finished_are_refused(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    log.append(scored(1))
    end = finished(run_id)
    [end_id] = log.append_many([end])
    assert log.finished_at() == end_id
    assert log.append_many([end]) == [end_id]  # a retry of the RunFinished itself is not refused
    for attempt in (
        lambda: log.append(scored(2)),
        lambda: log.append_many([scored(3)]),
        lambda: log.append_if([scored(4)], end_id),
        lambda: log.append_once([scored(5)], ["k"]),
    ):
        with pytest.raises(RunClosed, match="appends after RunFinished are refused"):
            attempt()
    assert log.length() == 2 and log.last_id() == end_id


def test_client_rides_out_a_redis_restart(tmp_path: Path, run_id: str) -> None:
    from conftest import RedisProcess

    server = RedisProcess(tmp_path / "redis")
    server.start()
    try:
        client = connect(server.url, retry_deadline=30)
        log = EventLog(client, run_id)
        first = log.append(scored(1))
        for kill in (False, True):
            server.stop(kill=kill)
            done: list[str] = []
            event = scored(2 if kill else 3)
            t = threading.Thread(target=lambda d=done, e=event: d.append(log.append(e)))
            t.start()  # the append waits for the server, retrying with backoff
            server.start()
            t.join(timeout=30)
            assert done and log.length() == (3 if kill else 2)
        assert log.read().__next__().stream_id == first
    finally:
        server.stop()


def test_outage_past_the_deadline_raises_redis_unavailable(tmp_path: Path) -> None:
    from conftest import RedisProcess

    server = RedisProcess(tmp_path / "redis")
    server.start()
    client = connect(server.url, retry_deadline=1.0)
    assert client.ping()
    server.stop(kill=True)
    started = time.monotonic()
    with pytest.raises(RedisUnavailable, match="redis unreachable for 1 s"):
        client.ping()
    assert time.monotonic() - started < 10
