"""The positional wire format: entries are arrays named by locked layouts; old map entries and old versions still read."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from logbuilder import LogBuilder

from rolledger.events import codec
from rolledger.events.codec import DecodeError, Trust, decode, encode, named_form
from rolledger.events.envelope import make_event
from rolledger.schemas.events import SampleScored
from rolledger.schemas.wire_layout import check_locked, current_layouts, load_locked, namer, write_lock


def _run_events() -> list[Any]:
    b = LogBuilder(group_size=2).start_run()
    b.admit()
    gid = b.last_group
    for i in range(2):
        b.start(f"{gid}/{i}")
    for i in range(2):
        b.finish(f"{gid}/{i}")
        b.score(f"{gid}/{i}", reward=1.0)
    b.complete(gid)
    b.consume([gid])
    b.update()
    return b.finish_run().build()


def test_every_event_is_written_as_an_array_and_reads_back_equal_under_either_trust() -> None:
    for event in _run_events():
        data = encode(event)
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        assert type(raw) is list and raw[0] == event.type and len(raw) == 4, event.type
        for trust in Trust:
            assert decode(data, trust) == event, (event.type, trust)


def test_a_log_written_as_maps_before_the_positional_layout_reads_the_same() -> None:
    for event in _run_events():
        as_map = msgpack.packb(named_form(encode(event)), use_bin_type=True)
        assert type(msgpack.unpackb(as_map, raw=False, strict_map_key=False)) is dict
        for trust in Trust:
            assert decode(as_map, trust) == event, (event.type, trust)


def test_positional_entries_are_smaller_than_their_maps() -> None:
    finished = next(e for e in _run_events() if e.type == "SampleFinished")
    data = encode(finished)
    assert len(data) < 0.75 * len(msgpack.packb(named_form(data), use_bin_type=True))


def _scored() -> list[Any]:
    event = make_event(
        SampleScored(sample_id="g1/0", group_id="g1", reward=0.5, correct=False),
        run_id="r",
        producer="t",
        policy_version=0,
    )
    raw: list[Any] = msgpack.unpackb(encode(event), raw=False)
    return raw


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda raw: [*raw[:3], [*raw[3], 1]], r"invalid SampleScored: Expected `array` of at most length 4, got 5"),
        (lambda raw: [*raw[:3], raw[3][:3]], r"invalid SampleScored: Expected `array` of at least length 4, got 3"),
        (lambda raw: [raw[0], raw[1], raw[2][:6], raw[3]], r"envelope has 6 fields, not 7"),
        (
            lambda raw: [raw[0], raw[1], raw[2], {"reward": 1.0}],
            r"invalid SampleScored: Expected `array`, got `object`",
        ),
        (lambda raw: raw[:3], r"not an event envelope"),
        (lambda raw: [raw[0], 99, *raw[2:]], r"newer than this rolledger"),
        (lambda raw: ["NoSuchEvent", *raw[1:]], r"unknown event type 'NoSuchEvent'"),
    ],
)
def test_a_malformed_positional_entry_is_refused_under_either_trust(mutate: Any, reason: str) -> None:
    data = msgpack.packb(mutate(_scored()), use_bin_type=True)
    for trust in Trust:
        with pytest.raises(DecodeError, match=reason):
            decode(data, trust)


def test_a_wrong_value_in_the_right_shape_is_refused_under_either_trust() -> None:
    """An entry of exactly the shape `encode` writes with a value of the wrong type is refused naming the field, even
    from the project's own log (msgspec checks every field as it builds the record: trusting the writer bought
    nothing once decoding became typed)."""
    raw = _scored()
    data = msgpack.packb([*raw[:3], [raw[3][0], raw[3][1], "lots", False]], use_bin_type=True)
    for trust in Trust:
        with pytest.raises(DecodeError, match=r"invalid SampleScored: reward: Expected `float`, got `str`"):
            decode(data, trust)


def test_an_older_version_reads_by_its_own_locked_layout_and_is_upcast(monkeypatch: pytest.MonkeyPatch) -> None:
    """SampleScored v1 had no `correct` (its upcaster derives it from the reward); an entry written positionally in
    v1 is named by v1's layout, upcast, and validated."""
    v1 = [["sample_id", "v", None], ["group_id", "v", None], ["reward", "v", None]]
    monkeypatch.setitem(codec._NAMERS, ("SampleScored", 1), namer(v1))
    raw = _scored()
    data = msgpack.packb([raw[0], 1, raw[2], ["g1/0", "g1", 1.0]], use_bin_type=True)
    for trust in Trust:
        payload = decode(data, trust).payload
        assert isinstance(payload, SampleScored) and payload.correct is True and payload.reward == 1.0


def test_a_payload_changed_without_a_new_version_is_named_at_import() -> None:
    locked = copy.deepcopy(load_locked())
    check_locked(locked)  # the lock as committed matches the models
    locked["SampleScored"]["2"] = locked["SampleScored"]["2"][:-1]
    del locked["GroupCompleted"]
    with pytest.raises(RuntimeError) as caught:
        check_locked(locked)
    message = str(caught.value)
    assert "SampleScored v2's fields differ" in message and "GroupCompleted v1 has no locked wire layout" in message


def test_writing_the_lock_adds_new_versions_and_never_rewrites_a_locked_one(tmp_path: Path) -> None:
    path = tmp_path / "layouts.json"
    assert len(write_lock(path)) == len(current_layouts())
    assert write_lock(path) == []
    # the committed lock holds exactly what the models give for every current version, plus the older versions
    # locked before a bump (SampleFinished v1, SampleFailed v1), which it keeps so their entries stay readable
    committed = load_locked()
    current = {name: {v: committed[name][v] for v in by_version} for name, by_version in current_layouts().items()}
    assert json.loads(path.read_text()) == current
    assert set(committed) == set(current)
    altered = json.loads(path.read_text())
    altered["SampleScored"]["2"] = altered["SampleScored"]["2"][:-1]
    path.write_text(json.dumps(altered))
    with pytest.raises(RuntimeError, match="SampleScored v2 is locked with other fields"):
        write_lock(path)
