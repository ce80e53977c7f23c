"""events.codec: every event type round-trips through msgpack (hypothesis-generated payloads), arrays are packed as
binary (float32 precision for logprobs), and bad bytes fail with a DecodeError reason."""

from __future__ import annotations

import array
import enum
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logbuilder import payload_of
from pydantic import BaseModel, ValidationError

from rolledger.events.codec import DecodeError, decode, encode, named_form
from rolledger.events.envelope import make_event
from rolledger.schemas.base import F32Array, I8Array, I32Array
from rolledger.schemas.events import PAYLOAD_TYPES, Event, SampleFinished, SampleScored
from rolledger.schemas.trajectory import Trajectory

_ARRAY_MARKERS = {
    id(typing.get_args(I32Array)[1]): st.integers(-(2**31), 2**31 - 1),
    id(typing.get_args(I8Array)[1]): st.integers(-128, 127),
    id(typing.get_args(F32Array)[1]): st.floats(width=32, allow_nan=False),  # exactly representable in float32
}
_SHORT_TEXT = st.text(max_size=12)
_ID_TEXT = st.text(alphabet="abcdefg0123456789/-", min_size=1, max_size=10)


def _bounded(base: str, metadata: list[Any]) -> st.SearchStrategy[Any]:
    lo: float | None = None
    hi: float | None = None
    excl_lo = excl_hi = False
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            assert isinstance(m.ge, int | float), m  # our schemas bound numbers only
            lo = m.ge
        elif isinstance(m, annotated_types.Gt):
            assert isinstance(m.gt, int | float), m
            lo, excl_lo = m.gt, True
        elif isinstance(m, annotated_types.Le):
            assert isinstance(m.le, int | float), m
            hi = m.le
        elif isinstance(m, annotated_types.Lt):
            assert isinstance(m.lt, int | float), m
            hi, excl_hi = m.lt, True
    if base == "int":
        return st.integers(
            min_value=None if lo is None else int(lo) + excl_lo, max_value=None if hi is None else int(hi) - excl_hi
        )
    return st.floats(
        min_value=lo,
        max_value=hi,
        exclude_min=excl_lo,
        exclude_max=excl_hi,
        allow_nan=False,
        allow_infinity=lo is None and hi is None,
    )


def strategy_for(annotation: Any, metadata: list[Any]) -> st.SearchStrategy[Any]:
    """A hypothesis strategy for one pydantic field type (the subset our schemas use)."""
    for m in metadata:
        if id(m) in _ARRAY_MARKERS:
            return st.lists(_ARRAY_MARKERS[id(m)], max_size=6)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is int:
        return _bounded("int", metadata).filter(lambda v: abs(v) < 2**63)  # msgpack integers are 64-bit
    if annotation is float:
        return _bounded("float", metadata)
    if annotation is bool:
        return st.booleans()
    if annotation is str:
        return _SHORT_TEXT
    if annotation is type(None):
        return st.none()
    if annotation is Path:
        # KNOWN CODEC GAP: encode() cannot pack pathlib.Path (see test_path_field_in_config_encodes); None only here.
        return st.none()
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (Union, types.UnionType):
        return st.one_of(*(strategy_for(a, []) for a in args))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0], []), max_size=3).map(tuple)
        return st.tuples(*(strategy_for(a, []) for a in args))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return st.sampled_from(list(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_strategy(annotation)
    raise NotImplementedError(f"no strategy for {annotation!r}")


def _trajectory_strategy() -> st.SearchStrategy[Trajectory]:
    """Trajectories need aligned per-token arrays; draw the length first."""

    @st.composite
    def build(draw: st.DrawFn) -> Trajectory:
        n = draw(st.integers(0, 6))
        fields = {
            name: draw(strategy_for(f.annotation, list(f.metadata)))
            for name, f in Trajectory.model_fields.items()
            if name not in ("token_ids", "loss_mask", "positions", "logprobs")
        }
        fields["token_ids"] = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n))
        fields["loss_mask"] = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        fields["positions"] = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
        fields["logprobs"] = draw(st.lists(st.floats(width=32, allow_nan=False), min_size=n, max_size=n))
        return Trajectory(**fields)

    return build()


def _try_build(cls: type[BaseModel], fields: dict[str, Any]) -> BaseModel | None:
    try:
        return cls(**fields)
    except ValidationError:  # cross-field validators (partial policy k, ...) reject some draws
        return None


def model_strategy(cls: type[BaseModel]) -> st.SearchStrategy[Any]:
    if cls is Trajectory:
        return _trajectory_strategy()
    fields = {
        name: strategy_for(f.annotation, list(f.metadata)) for name, f in cls.model_fields.items() if name != "type"
    }
    return st.fixed_dictionaries(fields).map(lambda d: _try_build(cls, d)).filter(lambda m: m is not None)


def event_strategy(payload_cls: type[BaseModel]) -> st.SearchStrategy[Event]:
    return st.builds(
        lambda payload, pv, wall, cause: make_event(
            payload, run_id="run-1", producer="test", policy_version=pv, wall_time=wall, causation_id=cause
        ),
        model_strategy(payload_cls),
        st.integers(0, 2**31),
        st.floats(0, 4e9),
        st.none() | _ID_TEXT,
    )


@pytest.mark.parametrize("type_name", sorted(PAYLOAD_TYPES))
def test_every_event_type_round_trips(type_name: str) -> None:
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    @given(event_strategy(PAYLOAD_TYPES[type_name]))
    def check(event: Event) -> None:
        data = encode(event)
        assert isinstance(data, bytes)
        back = decode(data)
        assert back == event
        assert type(back.payload) is type(event.payload)
        assert encode(back) == data  # stable: re-encoding the decoded event gives the same bytes

    check()


def _sample_finished(logprobs: list[float], n: int = 5) -> Event:
    traj = Trajectory(
        trajectory_id="g000001/0",
        group_id="g000001",
        prompt_id="p1",
        index=0,
        prompt_token_ids=[1, 2, 3],
        token_ids=list(range(100_000, 100_000 + n)),
        loss_mask=[1, 0, 1, 1, -1][:n],
        positions=list(range(3, 3 + n)),
        logprobs=logprobs,
        logprob_mode="raw",
        finish_reason="stop",
        sampling={"temperature": 0.7},
        policy_version=2,
        weights_digest="w",
        rank=0,
        engine="torch",
        cache_generation=1,
        graph_generation=1,
    )
    from rolledger.schemas.events import SampleFinished

    return make_event(SampleFinished(trajectory=traj), run_id="r", producer="t", policy_version=2)


@given(
    st.lists(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e30, max_value=1e30), min_size=5, max_size=5)
)
@settings(max_examples=50, deadline=None)
def test_logprobs_come_back_at_float32_precision(values: list[float]) -> None:
    back = decode(encode(_sample_finished(values)))
    expected = array.array("f", values).tolist()  # what float32 storage keeps
    assert payload_of(back, SampleFinished).trajectory.logprobs == expected
    for got, original in zip(payload_of(back, SampleFinished).trajectory.logprobs, values):
        assert math.isclose(got, original, rel_tol=1e-6, abs_tol=1e-37)


def test_arrays_travel_as_binary_not_number_lists() -> None:
    event = _sample_finished([-0.5] * 5)
    raw = named_form(encode(event))
    traj = raw["p"]["trajectory"]
    for name, width in (("token_ids", 4), ("loss_mask", 1), ("positions", 4), ("logprobs", 4)):
        assert isinstance(traj[name], msgpack.ExtType), name
        assert len(traj[name].data) == 1 + 5 * width, name  # typecode byte + raw little-endian values


def test_out_of_range_array_value_is_refused_at_encode() -> None:
    event = _sample_finished([0.0] * 5)
    bad = event.model_copy(
        update={
            "payload": event.payload.model_copy(
                update={
                    "trajectory": payload_of(event, SampleFinished).trajectory.model_copy(
                        update={"token_ids": [2**40] * 5}
                    )
                }
            )
        }
    )
    with pytest.raises(ValueError, match="signed integer is greater than maximum"):
        encode(bad)  # PydanticSerializationError (a ValueError) from the int32 packer


def test_older_schema_is_upcast() -> None:
    event = make_event(
        SampleScored(sample_id="g1/0", group_id="g1", reward=1.0, correct=True),
        run_id="r",
        producer="t",
        policy_version=0,
    )
    raw = named_form(encode(event))
    raw["v"] = 1
    del raw["p"]["correct"]
    back = decode(msgpack.packb(raw, use_bin_type=True))
    assert payload_of(back, SampleScored).correct is True
    raw["p"]["reward"] = 0.25
    assert payload_of(decode(msgpack.packb(raw, use_bin_type=True)), SampleScored).correct is False


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda raw: b"\xc1\xff garbage", "not msgpack"),
        (lambda raw: msgpack.packb([1, 2, 3]), "not an event envelope"),
        (lambda raw: msgpack.packb({**raw, "t": "NoSuchEvent"}), "unknown event type 'NoSuchEvent'"),
        (lambda raw: msgpack.packb({**raw, "v": 99}), "newer than this rolledger"),
        (lambda raw: msgpack.packb({**raw, "p": {**raw["p"], "reward": "lots"}}), "invalid SampleScored: payload"),
    ],
)
def test_bad_bytes_raise_decode_error_with_reason(mutate: Any, reason: str) -> None:
    event = make_event(
        SampleScored(sample_id="g1/0", group_id="g1", reward=0.5, correct=False),
        run_id="r",
        producer="t",
        policy_version=0,
    )
    raw = named_form(encode(event))
    with pytest.raises(DecodeError, match=reason):
        decode(mutate(raw))


def test_path_field_in_config_encodes() -> None:
    from rolledger.schemas.config import RunConfig
    from rolledger.schemas.events import RunStarted

    config = RunConfig.model_validate({"update": {"staging_dir": "/tmp/staging"}})
    event = make_event(
        RunStarted(config=config, initial_weights_digest="d"), run_id="r", producer="t", policy_version=0
    )
    assert decode(encode(event)) == event


# ---------------------------------------------------------------- packed arrays: the fast path still validates
def _raw_sample_finished() -> dict[str, Any]:
    return named_form(encode(_sample_finished([-0.5] * 5)))


def _with_array(raw: dict[str, Any], name: str, ext: msgpack.ExtType) -> bytes:
    raw["p"]["trajectory"][name] = ext
    return msgpack.packb(raw, use_bin_type=True)


def test_decoded_arrays_are_plain_lists_of_python_numbers() -> None:
    back = decode(encode(_sample_finished([-0.5] * 5)))
    traj = payload_of(back, SampleFinished).trajectory
    for name in ("prompt_token_ids", "token_ids", "loss_mask", "positions", "logprobs"):
        assert type(getattr(traj, name)) is list, name
    assert traj.token_ids == [100_000, 100_001, 100_002, 100_003, 100_004]
    assert type(traj.token_ids[0]) is int and type(traj.logprobs[0]) is float


@pytest.mark.parametrize(
    ("name", "ext", "reason"),
    [
        ("token_ids", msgpack.ExtType(1, b"x" + bytes(20)), "packed array with unknown typecode 'x'"),
        ("token_ids", msgpack.ExtType(1, b"i" + bytes(19)), "has 19 bytes, not a multiple of 4"),
        ("token_ids", msgpack.ExtType(1, b""), "unknown typecode ''"),
        # a float32 array where int32 token ids belong: its values are checked one by one, and 0.5 is no token id
        (
            "token_ids",
            msgpack.ExtType(1, b"f" + array.array("f", [0.5] * 5).tobytes()),
            "trajectory.token_ids.0: Input should be a valid integer",
        ),
        # an int32 array where int8 masks belong: 300 does not fit
        (
            "loss_mask",
            msgpack.ExtType(1, b"i" + array.array("i", [1, 1, 300, 1, 1]).tobytes()),
            "element 2 \\(300\\) does not fit int8",
        ),
        # aligned lengths are still checked by Trajectory's own validator
        (
            "logprobs",
            msgpack.ExtType(1, b"f" + array.array("f", [0.0] * 4).tobytes()),
            "logprobs has 4 entries for 5 generated tokens",
        ),
        # another ext code is not an array: it arrives as an ExtType (a 2-tuple) and fails as a list of ints
        ("positions", msgpack.ExtType(7, b"i" + bytes(20)), "trajectory.positions.1: Input should be a valid integer"),
    ],
)
def test_bad_packed_arrays_raise_decode_error_with_reason(name: str, ext: msgpack.ExtType, reason: str) -> None:
    with pytest.raises(DecodeError, match=reason):
        decode(_with_array(_raw_sample_finished(), name, ext))


def test_integral_floats_in_an_int_array_are_accepted_as_ints() -> None:
    """A foreign typecode is not trusted, but values that are valid ints are not refused either."""
    raw = _raw_sample_finished()
    back = decode(_with_array(raw, "token_ids", msgpack.ExtType(1, b"f" + array.array("f", [7.0] * 5).tobytes())))
    assert payload_of(back, SampleFinished).trajectory.token_ids == [7] * 5


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda raw: {**raw, "e": [1, 2]}, "must be maps"),
        (lambda raw: {**raw, "p": "payload"}, "must be maps"),
        (lambda raw: {**raw, "v": True}, "type/version malformed"),
        (lambda raw: {k: v for k, v in raw.items() if k != "e"}, "not an event envelope"),
        (lambda raw: "a string", "not an event envelope"),
        (lambda raw: {**raw, "e": {**raw["e"], "policy_version": -1}}, "invalid SampleScored: policy_version"),
        (lambda raw: {**raw, "e": {**raw["e"], "surprise": 1}}, "invalid SampleScored: surprise: Extra inputs"),
    ],
)
def test_malformed_envelopes_raise_decode_error(mutate: Any, reason: str) -> None:
    event = make_event(
        SampleScored(sample_id="g1/0", group_id="g1", reward=0.5, correct=False),
        run_id="r",
        producer="t",
        policy_version=0,
    )
    raw = named_form(encode(event))
    with pytest.raises(DecodeError, match=reason):
        decode(msgpack.packb(mutate(raw), use_bin_type=True))


def test_array_fields_accept_arrays_bytes_tensors_and_refuse_out_of_range_values() -> None:
    import torch

    base = payload_of(_sample_finished([0.0] * 5), SampleFinished).trajectory
    fields = base.model_dump()
    ok = Trajectory(
        **{
            **fields,
            "token_ids": torch.arange(5, dtype=torch.int64),
            "logprobs": array.array("d", [0.25] * 5),
            "positions": array.array("i", range(5)).tobytes(),
        }
    )
    assert ok.token_ids == [0, 1, 2, 3, 4] and ok.logprobs == [0.25] * 5 and ok.positions == [0, 1, 2, 3, 4]
    assert type(ok.token_ids) is list
    with pytest.raises(ValidationError, match=r"token_ids\n.*element 3 \(2147483648\) does not fit int32"):
        Trajectory(**{**fields, "token_ids": [0, 1, 2, 2**31, 4]})
    with pytest.raises(ValidationError, match=r"token_ids\.1\n.*valid integer"):
        Trajectory(**{**fields, "token_ids": [0, "x", 2, 3, 4]})
    with pytest.raises(ValidationError, match=r"positions\n.*multiple of item size"):
        Trajectory(**{**fields, "positions": b"\x00" * 7})
