"""One decode per event per process (issue 37): a work consumer and the process's tail of the log are handed the same
bytes for a SampleFinished (the reward worker) or a GroupAdmitted (a rank); events.codec.SharedDecodes decodes them
once. Checked on its own, and against the real redis-server with a reward work consumer and a follower of the log in
one process."""

from __future__ import annotations

import pytest
import redis
from logbuilder import LogBuilder

from rolledger.events import codec
from rolledger.events.codec import DecodeError, SharedDecodes, encode
from rolledger.events.consumer import GroupConsumer
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.workers.runtime.runtime import Follower


def run_events(run_id: str = "r", groups: int = 1) -> list[ev.Event]:
    b = LogBuilder(run_id=run_id).start_run()
    for _ in range(groups):
        b.group()
    return b.build()


def test_a_shared_type_is_decoded_once_for_two_readers_and_then_let_go() -> None:
    shared = SharedDecodes()
    shared.share(["SampleFinished"])
    finished = next(e for e in run_events() if isinstance(e.payload, ev.SampleFinished))
    data = encode(finished)
    first = shared.decode(bytes(data))
    second = shared.decode(bytes(data))  # another bytes object, equal: the other reader's copy
    assert first is second and first == finished
    assert shared.hits == 1 and len(shared) == 0  # the second reader took it
    assert shared.decode(data) is not first  # a third read (a redelivery) decodes again


def test_other_types_and_other_bytes_are_decoded_as_ever() -> None:
    shared = SharedDecodes()
    shared.share(["SampleFinished"])
    events = run_events()
    started = next(e for e in events if isinstance(e.payload, ev.SampleStarted))
    data = encode(started)
    assert shared.decode(data) is not shared.decode(data)  # not shared: nothing kept
    assert len(shared) == 0
    finished = [e for e in events if isinstance(e.payload, ev.SampleFinished)]
    a, b = (shared.decode(encode(e)) for e in finished[:2])
    assert a == finished[0] and b == finished[1]  # keyed by the bytes: each is its own decode


def test_a_malformed_entry_is_still_a_decode_error_and_nothing_is_kept() -> None:
    shared = SharedDecodes()
    shared.share(["SampleFinished"])
    finished = next(e for e in run_events() if isinstance(e.payload, ev.SampleFinished))
    broken = encode(finished)[:-3]  # the shared prefix, then a truncated payload
    for _ in range(2):
        with pytest.raises(DecodeError):
            shared.decode(broken)
    assert len(shared) == 0


def test_what_a_second_reader_never_takes_is_bounded() -> None:
    shared = SharedDecodes(kept=3, kept_bytes=1 << 20)
    shared.share(["SampleFinished"])
    finished = [e for e in run_events(groups=3) if isinstance(e.payload, ev.SampleFinished)]
    assert len(finished) > 3
    for e in finished:
        shared.decode(encode(e))
    assert len(shared) == 3
    tight = SharedDecodes(kept=100, kept_bytes=len(encode(finished[0])) + 1)
    tight.share(["SampleFinished"])
    for e in finished:
        tight.decode(encode(e))
    assert len(tight) <= 1


def test_the_reward_consumer_and_the_tail_of_one_process_decode_each_sample_once(
    redis_client: redis.Redis, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = run_events(run_id)
    finished = [e for e in events if isinstance(e.payload, ev.SampleFinished)]
    consumer = GroupConsumer.work(redis_client, run_id, "reward", "scorer")  # asks for SampleFinished to be shared
    consumer.ensure_group()
    log = EventLog(redis_client, run_id)
    log.append_many(events)
    decoded: list[str] = []
    real = codec.decode

    def counted(data: bytes, trust: codec.Trust = codec.Trust.VALIDATE) -> ev.Event:
        event = real(data, trust)
        decoded.append(event.type)
        return event

    monkeypatch.setattr(codec, "decode", counted)
    deliveries = consumer.read(count=100, block_ms=100)
    follower = Follower(log)
    folded = follower.catch_up()
    assert [d.event for d in deliveries] == finished
    assert [s.event for s in folded] == events
    assert decoded.count("SampleFinished") == len(finished)  # once each, for both readers
    tail_events = {id(s.event) for s in folded}
    assert all(id(d.event) in tail_events for d in deliveries)  # the very same objects
    assert decoded.count("SampleStarted") == sum(isinstance(e.payload, ev.SampleStarted) for e in events)
