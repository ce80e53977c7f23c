"""events.consumer against the real redis-server: work sharing, crash recovery of a SIGKILLed consumer process,
own-PEL recovery, poison entries, malformed entries and lost payloads going to the dead-letter stream, the work
streams (events/work.py) written with the log and trimmed on acknowledgement, reclaim on a timer."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import redis
from _consumer_proc import complete, completions_key, started_key
from logbuilder import LogBuilder, payload_of

from rolledger.events.codec import decode, encode, named_form
from rolledger.events.consumer import Delivery, GroupConsumer
from rolledger.events.envelope import make_event
from rolledger.events.keys import dead_letter_key, work_key
from rolledger.events.store import PAYLOAD_LOST, ConcurrencyConflict, EventLog, as_str, read_dead_letters
from rolledger.schemas.events import Event, SampleScored

REPO = Path(__file__).resolve().parent.parent


def scored(i: int, sample_id: str | None = None) -> Event:
    return make_event(
        SampleScored(sample_id=sample_id or f"g{i}/0", group_id=f"g{i}", reward=0.5, correct=False),
        run_id="r",
        producer="test",
        policy_version=0,
    )


def drain(consumer: GroupConsumer, *, timeout_s: float = 20.0, count: int = 10) -> list[Delivery]:
    """Read (and ack) until a read comes back empty; every wait is a blocking read with its own deadline."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = consumer.read(count=count, block_ms=50)
        if not batch:
            return got
        got += batch
        consumer.ack(*(d.stream_id for d in batch))
    raise TimeoutError("consumer kept receiving entries past the deadline")


def test_two_consumers_share_the_work(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    ids = [log.append(scored(i)) for i in range(30)]  # an entry each
    a = GroupConsumer(redis_client, run_id, "workers", "a")
    b = GroupConsumer(redis_client, run_id, "workers", "b")
    a.ensure_group()
    b.ensure_group()  # idempotent
    seen: dict[str, list[str]] = {"a": [], "b": []}
    for _ in range(20):  # alternate until a round where neither gets anything
        got = 0
        for name, consumer in (("a", a), ("b", b)):
            batch = consumer.read(count=4, block_ms=10)
            seen[name] += [d.stream_id for d in batch]
            assert all(d.deliveries == 1 for d in batch)
            consumer.ack(*(d.stream_id for d in batch))
            got += len(batch)
        if not got:
            break
    assert seen["a"] and seen["b"]
    assert not set(seen["a"]) & set(seen["b"])  # each entry to exactly one consumer
    assert sorted(seen["a"] + seen["b"]) == sorted(ids)
    assert a.pending() == 0


def test_restarted_consumer_gets_its_own_pending_first(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    ids = [log.append(scored(i)) for i in range(8)]  # an entry each
    first = GroupConsumer(redis_client, run_id, "g", "worker-1")
    first.ensure_group()
    assert [d.stream_id for d in first.read(count=3, block_ms=10)] == ids[:3]  # then "crashes": no ack
    assert first.pending_mine() == 3

    again = GroupConsumer(redis_client, run_id, "g", "worker-1")  # same name after restart
    batch = again.read(count=10, block_ms=10)
    assert [(d.stream_id, d.deliveries) for d in batch] == [(i, 2) for i in ids[:3]]
    again.ack(*ids[:3])
    assert [d.stream_id for d in drain(again)] == ids[3:]
    assert again.pending() == 0


def test_sigkilled_consumer_process_is_reclaimed_exactly_once(
    redis_url: str, redis_client: redis.Redis, run_id: str
) -> None:
    log = EventLog(redis_client, run_id)
    ids = [log.append(scored(i)) for i in range(40)]  # an entry each
    GroupConsumer(redis_client, run_id, "workers", "x").ensure_group()

    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "_consumer_proc.py"), redis_url, run_id, "workers", "victim", "10", "4"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30.0)
        assert ready, "consumer process did not report its half-done batch within 30 s"
        line = proc.stdout.readline()
        assert line.startswith("KILLME 10"), line
        os.kill(proc.pid, signal.SIGKILL)  # mid-batch: 4 completed, 1 started, 5 untouched
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    in_flight = redis_client.lrange(started_key(run_id), 0, -1)
    assert [as_str(s) for s in in_flight] == [ids[4]]
    rescuer = GroupConsumer(redis_client, run_id, "workers", "rescuer", claim_idle_ms=50)
    deadline = time.monotonic() + 30.0
    while redis_client.llen(completions_key(run_id)) < len(ids):
        assert time.monotonic() < deadline, "the rescuer did not complete every entry within 30 s"
        for delivery in rescuer.read(count=8, block_ms=100):
            complete(redis_client, rescuer, delivery)

    records = [as_str(r).split("|") for r in redis_client.lrange(completions_key(run_id), 0, -1)]
    counts = Counter(sid for sid, _, _ in records)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}  # none lost, none completed twice
    by_id = {sid: (who, int(n)) for sid, who, n in records}
    assert all(by_id[i] == ("victim", 1) for i in ids[:4])
    assert all(by_id[i] == ("rescuer", 2) for i in ids[4:10])  # reclaimed from the dead process's PEL
    assert all(by_id[i] == ("rescuer", 1) for i in ids[10:])
    assert rescuer.pending() == 0


def test_poison_entry_goes_to_dead_letter_after_max_deliveries(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    good1 = log.append(scored(1))
    poison = log.append(scored(2, sample_id="poison"))
    good2 = log.append(scored(3))
    consumer = GroupConsumer(redis_client, run_id, "g", "c", max_deliveries=3, claim_idle_ms=0)
    consumer.ensure_group()
    attempts: list[int] = []
    done: list[str] = []
    for _ in range(20):
        for d in consumer.read(count=10, block_ms=10):
            if payload_of(d.event, SampleScored).sample_id == "poison":
                attempts.append(d.deliveries)  # the handler raises: no ack
            else:
                done.append(d.stream_id)
                consumer.ack(d.stream_id)
        if redis_client.xlen(dead_letter_key(run_id)):
            break
    assert attempts == [1, 2, 3]
    assert sorted(done) == sorted([good1, good2])
    [letter] = read_dead_letters(redis_client, run_id)
    assert (letter.source, letter.reason, letter.consumer) == (poison, "delivered 4 times", "g/c")
    assert letter.raw == redis_client.xrange(log.key, poison, poison)[0][1][b"e"]  # type: ignore[index]  # redis-py: Any | Awaitable
    assert consumer.pending() == 0
    assert consumer.read(count=10, block_ms=10) == []  # the consumer goes on


def test_nack_redelivers_without_waiting_for_idle(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    sid = log.append(scored(1))
    consumer = GroupConsumer(redis_client, run_id, "g", "c", claim_idle_ms=600_000)
    consumer.ensure_group()
    assert [d.deliveries for d in consumer.read(count=1, block_ms=10)] == [1]
    assert consumer.read(count=1, block_ms=10) == []  # not idle long enough to be reclaimed
    consumer.nack(sid)
    assert [(d.stream_id, d.deliveries) for d in consumer.read(count=1, block_ms=10)] == [(sid, 2)]


def test_malformed_entries_dead_lettered_and_consumer_goes_on(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    raw = named_form(encode(scored(9)))
    good1 = log.append(scored(1))
    garbage = as_str(redis_client.xadd(log.key, {b"e": b"\x00\xff\xfe"}))
    unknown = as_str(redis_client.xadd(log.key, {b"e": msgpack.packb({**raw, "t": "FromTheFuture"})}))
    newer = as_str(redis_client.xadd(log.key, {b"e": msgpack.packb({**raw, "v": 3})}))
    good2 = log.append(scored(2))
    consumer = GroupConsumer(redis_client, run_id, "g", "c")
    consumer.ensure_group()
    assert [d.stream_id for d in drain(consumer)] == [good1, good2]
    letters = {d.source: d.reason for d in read_dead_letters(redis_client, run_id)}
    assert set(letters) == {garbage, unknown, newer}
    assert letters[garbage].startswith("not msgpack")
    assert "unknown event type 'FromTheFuture'" in letters[unknown]
    assert "SampleScored schema v3 is newer" in letters[newer]
    assert consumer.pending() == 0


@pytest.mark.parametrize("path", ["own-pending", "autoclaim"])
def test_entry_deleted_while_pending_is_dead_lettered_as_lost(
    redis_client: redis.Redis, run_id: str, path: str
) -> None:
    log = EventLog(redis_client, run_id)
    doomed, kept = log.append(scored(1)), log.append(scored(2))
    first = GroupConsumer(redis_client, run_id, "g", "first")
    first.ensure_group()
    assert len(first.read(count=2, block_ms=10)) == 2  # both pending, none acked
    redis_client.xdel(log.key, doomed)  # what a careless XTRIM does to the log

    if path == "own-pending":
        second = GroupConsumer(redis_client, run_id, "g", "first")  # the same consumer after a restart
    else:
        second = GroupConsumer(redis_client, run_id, "g", "second", claim_idle_ms=0)
    got = drain(second)
    assert [d.stream_id for d in got] == [kept]
    [letter] = read_dead_letters(redis_client, run_id)
    assert (letter.source, letter.reason) == (doomed, PAYLOAD_LOST)
    assert second.pending() == 0


def test_a_heartbeat_keeps_the_claim_and_a_reclaimed_entry_is_not_taken_back(
    redis_client: redis.Redis, run_id: str
) -> None:
    log = EventLog(redis_client, run_id)
    (entry,) = log.append_many([scored(0)])
    owner = GroupConsumer(redis_client, run_id, "workers", "owner", claim_idle_ms=500)
    other = GroupConsumer(redis_client, run_id, "workers", "other", claim_idle_ms=500)
    owner.ensure_group()
    assert [d.stream_id for d in owner.read(count=1, block_ms=10)] == [entry]
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # beats every ~50 ms for 2 s, four times the claim deadline
        assert owner.refresh(entry) == {entry}
        assert other.read(count=1, block_ms=50) == []  # never idle long enough to be reclaimed
    row = redis_client.xpending_range(log.key, "workers", entry, entry, 1)[0]
    assert as_str(row["consumer"]) == "owner" and int(row["times_delivered"]) == 1  # beats are not deliveries
    # the owner stops beating: the other consumer reclaims it, and the owner's next beat does not take it back
    deadline = time.monotonic() + 10.0
    while not (got := other.read(count=1, block_ms=50)):
        assert time.monotonic() < deadline, "the entry was never reclaimed"
    assert [d.stream_id for d in got] == [entry]
    assert owner.refresh(entry) == set()
    row = redis_client.xpending_range(log.key, "workers", entry, entry, 1)[0]
    assert as_str(row["consumer"]) == "other"


def test_work_groups_get_only_their_events_written_with_the_log_and_deleted_once_acknowledged(
    redis_client: redis.Redis, run_id: str
) -> None:
    """GroupAdmitted goes to the rollout work stream, SampleFinished to the reward one, each in the same script call
    as its log entry and exactly once (a retried append adds nothing); other types go nowhere but the log. A work
    consumer reads only its events, each delivery names its log entry, and an acknowledged entry leaves the work
    stream while the log keeps everything."""
    built = LogBuilder(run_id=run_id).start_run().group("g1", n=2).build()
    log = EventLog(redis_client, run_id)
    ids = log.append_many(built)
    assert log.append_many(built) == ids  # a retry (same event ids) writes nothing, to the log or a work stream
    by_type = Counter(e.type for e in built)
    assert by_type["GroupAdmitted"] == 1 and by_type["SampleFinished"] == 2 and len(by_type) > 2
    # the reward work of one append is one entry (events/work.py BATCHED); a rank's work is one group per entry
    assert redis_client.xlen(work_key(run_id, "reward")) == 1 and redis_client.xlen(work_key(run_id, "rollout")) == 1
    rollout = GroupConsumer.work(redis_client, run_id, "rollout", "r")
    reward = GroupConsumer.work(redis_client, run_id, "reward", "s")
    for c in (rollout, reward):
        c.ensure_group()  # created after the appends: a work group starts at its stream's first entry
    log_ids = {e.event_id: sid for e, sid in zip(built, ids, strict=True)}
    got = {c.group: drain(c) for c in (rollout, reward)}
    assert [d.event.type for d in got["rollout"]] == ["GroupAdmitted"]
    assert [d.event for d in got["reward"]] == [e for e in built if e.type == "SampleFinished"]
    for d in got["rollout"] + got["reward"]:
        assert d.log_id == log_ids[d.event.event_id] and d.deliveries == 1
    assert redis_client.xlen(work_key(run_id, "rollout")) == 0 and redis_client.xlen(work_key(run_id, "reward")) == 0
    assert rollout.pending() == 0 and reward.pending() == 0
    assert [s.event for s in log.read()] == built  # the log is never trimmed by a work consumer


def test_a_refused_append_writes_no_work(redis_client: redis.Redis, run_id: str) -> None:
    b = LogBuilder(run_id=run_id).start_run()
    log = EventLog(redis_client, run_id)
    log.append_many(b.build())
    admitted = LogBuilder(run_id=run_id).start_run().group("g1", n=1).find("GroupAdmitted")
    with pytest.raises(ConcurrencyConflict):
        log.append_if([admitted], expected_last_id="0-1")
    assert redis_client.xlen(work_key(run_id, "rollout")) == 0
    log.append_if([admitted], expected_last_id=log.last_id())
    assert redis_client.xlen(work_key(run_id, "rollout")) == 1


def test_reclaim_runs_on_a_timer_not_on_every_read(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    owner = GroupConsumer(redis_client, run_id, "g", "owner")
    other = GroupConsumer(redis_client, run_id, "g", "other", claim_idle_ms=0, claim_every_ms=600_000)
    owner.ensure_group()
    assert other.read(count=1, block_ms=10) == []  # its first read scans (nothing to reclaim) and sets the timer
    sid = log.append(scored(1))
    assert [d.stream_id for d in owner.read(count=1, block_ms=10)] == [sid]  # pending to owner, reclaimable at once
    assert other.read(count=1, block_ms=10) == []  # but the timer is not due: no scan, nothing taken
    calls = int(redis_client.info("commandstats").get("cmdstat_xautoclaim", {}).get("calls", 0))
    for _ in range(5):
        assert other.read(count=1, block_ms=1) == []
    assert int(redis_client.info("commandstats").get("cmdstat_xautoclaim", {}).get("calls", 0)) == calls
    other.nack(sid)  # a nack makes the next read scan at once
    assert [(d.stream_id, d.deliveries) for d in other.read(count=1, block_ms=10)] == [(sid, 2)]


def test_work_consumer_refuses_a_group_without_a_work_stream(redis_client: redis.Redis, run_id: str) -> None:
    with pytest.raises(ValueError, match="not a work group"):
        GroupConsumer.work(redis_client, run_id, "workers", "c")


def test_an_entry_of_several_events_is_delivered_as_each_of_them_and_acknowledged_once(
    redis_client: redis.Redis, run_id: str
) -> None:
    """A log entry holds one append's events (events/store.py): a consumer of the log gets each of them, all with the
    entry's id (one `ack` takes them all); a malformed event inside it is dead-lettered under its own place in the
    entry while the others are delivered, and an entry of nothing but malformed events is acknowledged by the
    consumer itself, after dead-lettering each once."""
    log = EventLog(redis_client, run_id)
    batch = [scored(i) for i in range(3)]
    ids = log.append_many(batch)
    good, bad = encode(scored(7)), b"\xc1 not msgpack"
    mixed = as_str(
        redis_client.xadd(
            log.key, {b"b": msgpack.packb([good, bad], use_bin_type=True), b"t": b"SampleScored,SampleScored"}
        )
    )
    hopeless = as_str(redis_client.xadd(log.key, {b"b": msgpack.packb([bad, bad], use_bin_type=True)}))
    c = GroupConsumer(redis_client, run_id, "workers", "c")
    c.ensure_group()
    got = c.read(count=10, block_ms=10)
    assert [(d.stream_id, d.event) for d in got] == [*zip(ids, batch), (mixed, decode(good))]
    letters = read_dead_letters(redis_client, run_id)
    assert [(d.source, d.raw) for d in letters] == [(mixed, bad), (hopeless, bad), (hopeless, bad)]
    assert [d.reason.split(":")[0] for d in letters] == [
        "event 1 of the entry",
        "event 0 of the entry",
        "event 1 of the entry",
    ]
    assert len(list(log.read())) == 4  # a reader of the log finds the same bad events: named alike, not again
    assert read_dead_letters(redis_client, run_id) == letters
    assert c.pending() == 2  # the two entries that were delivered; the hopeless one was acknowledged
    c.ack(*{d.stream_id for d in got})
    assert c.pending() == 0 and c.read(count=10, block_ms=10) == []
