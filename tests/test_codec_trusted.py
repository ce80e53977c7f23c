"""The trusted decode path (events.codec, Trust.OWN_LOG): for every entry `encode` writes it builds exactly the
event full validation builds; an entry of any other shape is validated as before, so a malformed one is still a
DecodeError and, read from a log, a dead-letter entry."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from logbuilder import LogBuilder
from test_codec import event_strategy

from rolledger.events.codec import _TRUSTED, _TRUSTED_POSITIONAL, DecodeError, Trust, decode, encode, named_form
from rolledger.events.envelope import make_event
from rolledger.events.store import EventLog, as_str, read_dead_letters
from rolledger.schemas.events import PAYLOAD_TYPES, Event, SampleScored

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import history  # tests/fixtures is not a package


def same(a: Event, b: Event) -> None:
    assert a == b
    assert a.model_dump() == b.model_dump()
    assert type(a.payload) is type(b.payload)
    assert encode(a) == encode(b)
    for name, value in a.payload.__dict__.items():  # enums stay enums, tuples tuples, arrays lists
        assert type(b.payload.__dict__[name]) is type(value), name


@pytest.mark.parametrize("type_name", sorted(PAYLOAD_TYPES))
def test_trusted_decode_builds_what_validation_builds(type_name: str) -> None:
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    @given(event_strategy(PAYLOAD_TYPES[type_name]))
    def check(event: Event) -> None:
        data = encode(event)
        same(decode(data, Trust.VALIDATE), decode(data, Trust.OWN_LOG))

    check()


def test_which_types_have_a_trusted_builder() -> None:
    """From the positional form (what `encode` writes) every type is built but RunStarted, which carries the config
    (a Path field, unions the plans do not build): once per run, always validated. From the map form of older logs
    only the types that carry arrays or nested models are built (pydantic-core is as fast for flat maps)."""
    assert set(PAYLOAD_TYPES) - set(_TRUSTED_POSITIONAL) == {"RunStarted"}
    assert set(_TRUSTED) == {"SampleFinished", "GroupAdmitted"}


def test_recorded_logs_decode_alike_under_both_trusts() -> None:
    """The committed fixtures (real runs, older schema versions among them) and a builder's log."""
    datas = [data for name in history.FIXTURES for _, data in history.load_entries(name)[1]]
    b = LogBuilder(group_size=2).start_run()
    for _ in range(3):
        b.group()
    b.consume([b.last_group]).update(1).update(2, fail_rank=0)
    datas += [encode(e) for e in b.finish_run().build()]
    for data in datas:
        same(decode(data, Trust.VALIDATE), decode(data, Trust.OWN_LOG))


def _raw() -> dict[str, Any]:
    event = make_event(
        SampleScored(sample_id="g1/0", group_id="g1", reward=0.5, correct=False),
        run_id="r",
        producer="t",
        policy_version=0,
    )
    raw: dict[str, Any] = named_form(encode(event))
    return raw


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda raw: b"\xc1\xff garbage", "not msgpack"),
        (lambda raw: msgpack.packb({**raw, "t": "NoSuchEvent"}), "unknown event type 'NoSuchEvent'"),
        (lambda raw: msgpack.packb({**raw, "p": {**raw["p"], "extra": 1}}), "invalid SampleScored: payload"),
        (
            lambda raw: msgpack.packb({**raw, "p": {k: v for k, v in raw["p"].items() if k != "reward"}}),
            "invalid SampleScored: payload",
        ),
        (
            lambda raw: msgpack.packb({**raw, "e": {k: v for k, v in raw["e"].items() if k != "run_id"}}),
            "invalid SampleScored: run_id",
        ),
        (lambda raw: msgpack.packb({**raw, "p": [1, 2]}), "must be maps"),
    ],
)
def test_a_malformed_entry_is_refused_under_either_trust(mutate: Any, reason: str) -> None:
    data = mutate(_raw())
    for trust in Trust:
        with pytest.raises(DecodeError, match=reason):
            decode(data, trust)


def test_own_log_trusts_the_writer_for_field_values() -> None:
    """What OWN_LOG does not re-check (the module docstring): a value of the wrong type in an entry of the right
    shape, of a type it builds. Only a log no one but this project writes may be read that way; VALIDATE refuses it."""
    b = LogBuilder(group_size=2).start_run()
    b.admit()
    raw = named_form(encode(b.events[-1]))
    data = msgpack.packb({**raw, "p": {**raw["p"], "n": "lots"}}, use_bin_type=True)
    with pytest.raises(DecodeError, match="invalid GroupAdmitted"):
        decode(data)
    assert decode(data, Trust.OWN_LOG).payload.__dict__["n"] == "lots"


def test_a_trusted_read_still_dead_letters_malformed_entries(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)
    raw = _raw()
    good = log.append(
        Event.model_validate({**raw["e"], "schema_version": raw["v"], "payload": {**raw["p"], "type": raw["t"]}})
    )
    garbage = as_str(redis_client.xadd(log.key, {b"e": b"\x00\xff\xfe"}))
    missing = as_str(redis_client.xadd(log.key, {b"e": msgpack.packb({**raw, "p": {"reward": 1.0}})}))
    assert [s.stream_id for s in log.read(trust=Trust.OWN_LOG)] == [good]
    letters = {d.source: d.reason for d in read_dead_letters(redis_client, run_id)}
    assert set(letters) == {garbage, missing}
    assert letters[garbage].startswith("not msgpack")
    assert letters[missing].startswith("invalid SampleScored")
