"""The two trusts of events.codec: since events became msgspec records, `Trust.OWN_LOG` decodes exactly as
`Trust.VALIDATE` does (every field checked by msgspec's typed decode). For every entry `encode` writes both build
the event that was encoded, type for type; an entry of any other shape, or a value of the wrong type in an entry of
the right shape, is a DecodeError under either, and, read from a log, a dead-letter entry."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from logbuilder import LogBuilder
from pydantic import BaseModel
from test_codec import event_strategy

from rolledger.events.codec import DecodeError, Trust, decode, encode, named_form
from rolledger.events.envelope import make_event
from rolledger.events.store import EventLog, as_str, read_dead_letters
from rolledger.schemas.base import PackedArray
from rolledger.schemas.events import PAYLOAD_TYPES, Event, GroupAdmitted, SampleScored

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import history  # tests/fixtures is not a package


def shape(obj: Any) -> Any:
    """`obj` as nested (type, value) pairs, down to every scalar: equal only where the types are equal too (an enum
    stays an enum, a tuple a tuple, an array its packed type, a float the same float bit for bit)."""
    if isinstance(obj, msgspec.Struct):
        return type(obj), {name: shape(getattr(obj, name)) for name in obj.__struct_fields__}
    if isinstance(obj, PackedArray):
        return type(obj), obj.tobytes()
    if isinstance(obj, BaseModel):
        return type(obj), {name: shape(value) for name, value in obj.__dict__.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj), [shape(v) for v in obj]
    if isinstance(obj, dict):
        return type(obj), {k: shape(v) for k, v in obj.items()}
    if type(obj) is float:
        return float, obj.hex()
    return type(obj), obj


def same(a: Event, b: Event) -> None:
    assert a == b
    assert shape(a) == shape(b)
    assert encode(a) == encode(b)


@pytest.mark.parametrize("type_name", sorted(PAYLOAD_TYPES))
def test_either_trust_builds_the_event_that_was_encoded(type_name: str) -> None:
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    @given(event_strategy(PAYLOAD_TYPES[type_name]))
    def check(event: Event) -> None:
        data = encode(event)
        validated = decode(data, Trust.VALIDATE)
        same(validated, decode(data, Trust.OWN_LOG))
        same(validated, event)

    check()


def test_recorded_logs_decode_alike_under_both_trusts() -> None:
    """The committed fixtures (real runs, older schema versions among them) and a builder's log."""
    datas = [data for name in history.FIXTURES for _, data in history.load_entries(name)[1]]
    b = LogBuilder(group_size=2).start_run()
    for _ in range(3):
        b.group()
    b.consume([b.last_group]).update(1).update(2, fail_rank=0)
    datas += [encode(e) for e in b.finish_run().build()]
    assert len(datas) > 50
    for data in datas:
        same(decode(data, Trust.VALIDATE), decode(data, Trust.OWN_LOG))


def _event() -> Event:
    return make_event(
        SampleScored(sample_id="g1/0", group_id="g1", reward=0.5, correct=False),
        run_id="r",
        producer="t",
        policy_version=0,
    )


def _raw() -> dict[str, Any]:
    raw: dict[str, Any] = named_form(encode(_event()))
    return raw


def _positional(mutate: Any) -> bytes:
    raw = msgpack.unpackb(encode(_event()), raw=False)
    mutate(raw)
    return msgpack.packb(raw, use_bin_type=True)


def _set(path: tuple[int, ...], value: Any) -> Any:
    def mutate(raw: list[Any]) -> None:
        for i in path[:-1]:
            raw = raw[i]
        raw[path[-1]] = value

    return mutate


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (lambda: b"\xc1\xff garbage", "^not msgpack"),
        (lambda: msgpack.packb({**_raw(), "t": "NoSuchEvent"}), "^unknown event type 'NoSuchEvent'$"),
        (
            lambda: msgpack.packb({**_raw(), "p": {**_raw()["p"], "extra": 1}}),
            "^invalid SampleScored: unexpected field 'extra'$",
        ),
        (
            lambda: msgpack.packb({**_raw(), "p": {k: v for k, v in _raw()["p"].items() if k != "reward"}}),
            "^invalid SampleScored: missing field 'reward'$",
        ),
        (
            lambda: msgpack.packb({**_raw(), "e": {k: v for k, v in _raw()["e"].items() if k != "run_id"}}),
            "^invalid SampleScored: missing field 'run_id'$",
        ),
        (lambda: msgpack.packb({**_raw(), "p": [1, 2]}), "must be maps"),
        # the positional form `encode` writes: the typed path
        (lambda: _positional(_set((3, 2), "lots")), "^invalid SampleScored: reward: Expected `float`, got `str`$"),
        (lambda: _positional(_set((0,), "NoSuchEvent")), "^unknown event type 'NoSuchEvent'$"),
        (
            lambda: _positional(lambda raw: raw[3].append(1)),
            r"^invalid SampleScored: Expected `array` of at most length 4, got 5$",
        ),
        (
            lambda: _positional(lambda raw: raw[2].__delitem__(slice(6, None))),
            "^invalid SampleScored: envelope has 6 fields, not 7 or 8$",
        ),
        (lambda: _positional(_set((2, 5), -1)), "^invalid SampleScored: policy_version: Expected `int` >= 0"),
    ],
)
def test_a_malformed_entry_is_refused_under_either_trust(data: Any, reason: str) -> None:
    entry = data()
    for trust in Trust:
        with pytest.raises(DecodeError, match=reason):
            decode(entry, trust)


def test_own_log_no_longer_trusts_the_writer_for_field_values() -> None:
    """A value of the wrong type in an entry of the right shape (which the unchecked OWN_LOG builder of the pydantic
    events took as it was) is refused under either trust, in either form."""
    b = LogBuilder(group_size=2).start_run()
    b.admit()
    event = b.events[-1]
    assert isinstance(event.payload, GroupAdmitted)
    raw = named_form(encode(event))
    as_map = msgpack.packb({**raw, "p": {**raw["p"], "n": "lots"}}, use_bin_type=True)
    as_array = _positional_entry(event, "n", "lots")
    for entry in (as_map, as_array):
        for trust in Trust:
            with pytest.raises(DecodeError, match="^invalid GroupAdmitted: n: Expected `int`, got `str`$"):
                decode(entry, trust)


def _positional_entry(event: Event, name: str, value: Any) -> bytes:
    raw = msgpack.unpackb(encode(event), raw=False)
    raw[3][list(type(event.payload).__struct_fields__).index(name)] = value
    return msgpack.packb(raw, use_bin_type=True)


def test_a_trusted_read_still_dead_letters_malformed_entries(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    raw = _raw()
    good = log.append(_event())
    garbage = as_str(redis_client.xadd(log.key, {b"e": b"\x00\xff\xfe"}))
    missing = as_str(redis_client.xadd(log.key, {b"e": msgpack.packb({**raw, "p": {"reward": 1.0}})}))
    forged = as_str(redis_client.xadd(log.key, {b"e": _positional(_set((3, 2), "lots"))}))
    assert [s.stream_id for s in log.read(trust=Trust.OWN_LOG)] == [good]
    letters = {d.source: d.reason for d in read_dead_letters(redis_client, run_id)}
    assert set(letters) == {garbage, missing, forged}
    assert letters[garbage].startswith("not msgpack")
    assert letters[missing].startswith("invalid SampleScored: missing field")
    assert letters[forged] == "invalid SampleScored: reward: Expected `float`, got `str`"
