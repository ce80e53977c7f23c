"""events.codec: every event type round-trips through msgpack (hypothesis-generated payloads), arrays are packed as
binary (float32 precision for logprobs), and bad bytes fail with a DecodeError reason.

The payloads are msgspec records (schemas.base.Record): their strategies are read off `msgspec.inspect.type_info`
(types and `Meta` bounds) and their packed-array fields off the `PackedField` marker in the annotations; the pydantic
models nested in them (run config, sampling parameters, partial policy) are drawn from their pydantic fields."""

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
import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logbuilder import payload_of
from pydantic import BaseModel

from rolledger.events.codec import DecodeError, decode, encode, named_form
from rolledger.events.envelope import make_event
from rolledger.schemas.base import Float32Array, Int8Array, Int32Array, PackedArray, PackedField
from rolledger.schemas.config import SamplingParams
from rolledger.schemas.events import PAYLOAD_TYPES, Event, SampleFinished, SampleScored
from rolledger.schemas.trajectory import Trajectory

_PACKED_ELEMENTS: dict[type[PackedArray], st.SearchStrategy[Any]] = {
    Int32Array: st.integers(-(2**31), 2**31 - 1),
    Int8Array: st.integers(-128, 127),
    Float32Array: st.floats(width=32, allow_nan=False),  # exactly representable in float32
}
_INT64 = (-(2**63), 2**63 - 1)  # msgpack integers are 64-bit
_SHORT_TEXT = st.text(max_size=12)
_ID_TEXT = st.text(alphabet="abcdefg0123456789/-", min_size=1, max_size=10)


# ---------------------------------------------------------------- msgspec records
def packed_fields(cls: type[msgspec.Struct]) -> dict[str, type[PackedArray]]:
    """The packed-array fields of a record and their array types (`I32`/`F32`/`I8`: `Annotated[Any, PackedField]`)."""
    out: dict[str, type[PackedArray]] = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        if name in cls.__struct_fields__ and typing.get_origin(hint) is typing.Annotated:
            out.update((name, m.cls) for m in hint.__metadata__ if isinstance(m, PackedField))
    return out


def packed_strategy(cls: type[PackedArray], min_size: int = 0, max_size: int = 6) -> st.SearchStrategy[Any]:
    """A packed field's value as a caller may give it: a list, a tuple or the packed array itself."""
    values = st.lists(_PACKED_ELEMENTS[cls], min_size=min_size, max_size=max_size)
    return st.one_of(values, values.map(tuple), values.map(cls))


def _number_bounds(t: mi.IntType | mi.FloatType) -> tuple[Any, Any, bool, bool]:
    assert t.multiple_of is None, t  # our schemas bound numbers by ge/gt/le/lt only
    lo, excl_lo = (t.gt, True) if t.gt is not None else (t.ge, False)
    hi, excl_hi = (t.lt, True) if t.lt is not None else (t.le, False)
    return lo, hi, excl_lo, excl_hi


def type_strategy(t: mi.Type) -> st.SearchStrategy[Any]:
    """A hypothesis strategy for one msgspec field type (the subset our records use)."""
    if isinstance(t, mi.IntType):
        lo, hi, excl_lo, excl_hi = _number_bounds(t)
        return st.integers(
            min_value=_INT64[0] if lo is None else lo + excl_lo, max_value=_INT64[1] if hi is None else hi - excl_hi
        )
    if isinstance(t, mi.FloatType):
        lo, hi, excl_lo, excl_hi = _number_bounds(t)
        return st.floats(
            min_value=lo,
            max_value=hi,
            exclude_min=excl_lo,
            exclude_max=excl_hi,
            allow_nan=False,
            allow_infinity=lo is None and hi is None,
        )
    if isinstance(t, mi.StrType):
        assert t.pattern is None, t
        if t.min_length is None and t.max_length is None:
            return _SHORT_TEXT
        return st.text(min_size=t.min_length or 0, max_size=t.max_length if t.max_length is not None else 12)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.EnumType):
        return st.sampled_from(list(t.cls))
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(type_strategy(a) for a in t.types))
    if isinstance(t, mi.VarTupleType):
        max_size = t.max_length if t.max_length is not None else 3
        return st.lists(type_strategy(t.item_type), min_size=t.min_length or 0, max_size=max_size).map(tuple)
    if isinstance(t, mi.TupleType):
        return st.tuples(*(type_strategy(a) for a in t.item_types))
    if isinstance(t, mi.StructType):
        return record_strategy(t.cls)
    if isinstance(t, mi.CustomType) and issubclass(t.cls, BaseModel):  # a pydantic model nested in a record
        return model_strategy(t.cls)
    # AnyType: only packed fields are `Any` to msgspec, and record_strategy draws those from their PackedField
    raise NotImplementedError(f"no strategy for {t!r}")


def _trajectory_strategy() -> st.SearchStrategy[Trajectory]:
    """Trajectories need aligned per-token arrays; draw the length first."""
    aligned = ("token_ids", "loss_mask", "positions", "logprobs")
    types_ = {f.name: f.type for f in typing.cast(mi.StructType, mi.type_info(Trajectory)).fields}
    arrays = packed_fields(Trajectory)
    assert set(aligned) <= set(arrays), arrays

    @st.composite
    def build(draw: st.DrawFn) -> Trajectory:
        n = draw(st.integers(0, 6))
        fields = {
            name: draw(packed_strategy(arrays[name]) if name in arrays else type_strategy(types_[name]))
            for name in Trajectory.__struct_fields__
            if name not in aligned
        }
        fields["token_ids"] = draw(packed_strategy(Int32Array, n, n))
        fields["loss_mask"] = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        fields["positions"] = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
        fields["logprobs"] = draw(packed_strategy(Float32Array, n, n))
        return Trajectory(**fields)

    return build()


def _try_build(cls: type[Any], fields: dict[str, Any]) -> Any:
    try:
        return cls(**fields)
    except (ValueError, TypeError):  # __post_init__ / cross-field validators (a terminal status, partial k) refuse
        return None  # some draws; pydantic's ValidationError is a ValueError


def record_strategy(cls: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    if cls is Trajectory:
        return _trajectory_strategy()
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType), info
    arrays = packed_fields(cls)
    fields = {
        f.name: packed_strategy(arrays[f.name]) if f.name in arrays else type_strategy(f.type) for f in info.fields
    }
    return st.fixed_dictionaries(fields).map(lambda d: _try_build(cls, d)).filter(lambda m: m is not None)


# ---------------------------------------------------------------- pydantic models nested in records
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
            min_value=_INT64[0] if lo is None else int(lo) + excl_lo,
            max_value=_INT64[1] if hi is None else int(hi) - excl_hi,
        )
    return st.floats(
        min_value=lo,
        max_value=hi,
        exclude_min=excl_lo,
        exclude_max=excl_hi,
        allow_nan=False,
        allow_infinity=lo is None and hi is None,
    )


def _text(metadata: list[Any]) -> st.SearchStrategy[str]:
    """A str field's value within its declared `pattern` and `min_length`: drawn valid rather than filtered out
    (a `module:function` reference drawn as free text almost never matches, and the run config was drawn ~80 times
    per example kept)."""
    for m in metadata:
        pattern = getattr(m, "pattern", None)
        if isinstance(pattern, str):
            return st.from_regex(pattern, fullmatch=True).filter(lambda s: len(s) <= 40)
    min_size = max((m.min_length for m in metadata if isinstance(m, annotated_types.MinLen)), default=0)
    return st.text(min_size=min_size, max_size=max(12, min_size))


def strategy_for(annotation: Any, metadata: list[Any]) -> st.SearchStrategy[Any]:
    """A hypothesis strategy for one pydantic field type (the subset our config models use)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is int:
        return _bounded("int", metadata)
    if annotation is float:
        return _bounded("float", metadata)
    if annotation is bool:
        return st.booleans()
    if annotation is str:
        return _text(metadata)
    if annotation is type(None):
        return st.none()
    if annotation is Path:
        return st.sampled_from([Path("/tmp/staging"), Path("relative/dir"), Path(".")])
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (Union, types.UnionType):  # `int | None` with `ge=1`: the bound is the int's
        return st.one_of(*(strategy_for(a, [] if a is type(None) else metadata) for a in args))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0], []), max_size=3).map(tuple)
        return st.tuples(*(strategy_for(a, []) for a in args))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return st.sampled_from(list(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_strategy(annotation)
    raise NotImplementedError(f"no strategy for {annotation!r}")


def model_strategy(cls: type[BaseModel]) -> st.SearchStrategy[Any]:
    fields = {name: strategy_for(f.annotation, list(f.metadata)) for name, f in cls.model_fields.items()}
    return st.fixed_dictionaries(fields).map(lambda d: _try_build(cls, d)).filter(lambda m: m is not None)


# ---------------------------------------------------------------- events
def event_strategy(payload_cls: type[msgspec.Struct]) -> st.SearchStrategy[Event]:
    return st.builds(
        lambda payload, pv, wall, cause: make_event(
            payload, run_id="run-1", producer="test", policy_version=pv, wall_time=wall, causation_id=cause
        ),
        record_strategy(payload_cls),
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


def test_the_strategies_cover_every_field_kind() -> None:
    """The strategies above are read off the records: every payload field has one (none is left to `Any`), and the
    packed fields are found by their marker."""
    for cls in PAYLOAD_TYPES.values():
        record_strategy(cls)  # built eagerly, nested records and models too: NotImplementedError for a missing kind
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        arrays = packed_fields(cls)
        for f in info.fields:
            assert f.name in arrays or not isinstance(f.type, mi.AnyType), (cls.__name__, f.name)
    assert packed_fields(Trajectory) == {
        "prompt_token_ids": Int32Array,
        "token_ids": Int32Array,
        "loss_mask": Int8Array,
        "positions": Int32Array,
        "logprobs": Float32Array,
    }
    assert packed_fields(PAYLOAD_TYPES["GroupAdmitted"]) == {"prompt_token_ids": Int32Array}


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
        sampling=SamplingParams(temperature=0.7),
        policy_version=2,
        weights_digest="w",
        rank=0,
        engine="torch",
        cache_generation=1,
        graph_generation=1,
    )
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
    for name, width in (("prompt_token_ids", 4), ("token_ids", 4), ("loss_mask", 1), ("positions", 4), ("logprobs", 4)):
        assert isinstance(traj[name], msgpack.ExtType), name
        n = 3 if name == "prompt_token_ids" else 5
        assert len(traj[name].data) == 1 + n * width, name  # typecode byte + raw little-endian values


def test_out_of_range_array_value_is_refused() -> None:
    """Where a trajectory is built (a packed array cannot hold it), and where one forced past that is read back."""
    event = _sample_finished([0.0] * 5)
    traj = payload_of(event, SampleFinished).trajectory
    with pytest.raises(ValueError, match=r"token_ids: element 0 \(1099511627776\) does not fit int32"):
        msgspec.structs.replace(traj, token_ids=[2**40] * 5)
    forced = msgspec.structs.replace(traj)
    msgspec.structs.force_setattr(forced, "token_ids", [2**40] * 5)  # past __post_init__: encoded as a number list
    bad = msgspec.structs.replace(event, payload=msgspec.structs.replace(event.payload, trajectory=forced))
    with pytest.raises(DecodeError, match=r"invalid SampleFinished: .*token_ids: element 0 .* does not fit int32"):
        decode(encode(bad))


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
        (
            lambda raw: msgpack.packb({**raw, "p": {**raw["p"], "reward": "lots"}}),
            "invalid SampleScored: reward: Expected `float`, got `str`",
        ),
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
    back = decode(encode(event))
    assert back == event
    assert payload_of(back, RunStarted).config.update.staging_dir == Path("/tmp/staging")


# ---------------------------------------------------------------- packed arrays: the fast path still validates
def _raw_sample_finished() -> dict[str, Any]:
    return named_form(encode(_sample_finished([-0.5] * 5)))


def _with_array(raw: dict[str, Any], name: str, ext: msgpack.ExtType) -> bytes:
    raw["p"]["trajectory"][name] = ext
    return msgpack.packb(raw, use_bin_type=True)


def test_decoded_arrays_are_packed_arrays_of_python_numbers() -> None:
    """One buffer per array (no Python object per token, issue 37), read as Python ints and floats."""
    back = decode(encode(_sample_finished([-0.5] * 5)))
    traj = payload_of(back, SampleFinished).trajectory
    for name, cls in packed_fields(Trajectory).items():
        assert type(getattr(traj, name)) is cls, name
    assert traj.token_ids == [100_000, 100_001, 100_002, 100_003, 100_004]
    assert traj.prompt_token_ids == [1, 2, 3] and traj.loss_mask == [1, 0, 1, 1, -1]
    assert traj.positions == [3, 4, 5, 6, 7] and traj.logprobs == [-0.5] * 5
    assert type(traj.token_ids[0]) is int and type(traj.loss_mask[0]) is int and type(traj.logprobs[0]) is float


def _positional_with_array(name: str, value: Any) -> bytes:
    """The entry `encode` writes (`[type, version, envelope, payload]`, records as arrays), one array replaced."""
    raw = msgpack.unpackb(encode(_sample_finished([-0.5] * 5)), raw=False)
    raw[3][0][list(Trajectory.__struct_fields__).index(name)] = value
    return msgpack.packb(raw, use_bin_type=True)


_BAD_TYPE = "invalid SampleFinished: trajectory: "


@pytest.mark.parametrize("form", ["positional", "map"])
@pytest.mark.parametrize(
    ("name", "ext", "reason"),
    [
        # malformed blobs fail in the ext hook, before any field is known (neither form names the field)
        ("token_ids", msgpack.ExtType(1, b"x" + bytes(20)), "packed array with unknown typecode 'x'$"),
        (
            "token_ids",
            msgpack.ExtType(1, b"i" + bytes(19)),
            "packed array of typecode 'i' has 19 bytes, not a multiple of 4$",
        ),
        ("token_ids", msgpack.ExtType(1, b""), "packed array with unknown typecode ''$"),
        # a float32 array where int32 token ids belong: a packed array of another type is refused, naming both
        (
            "token_ids",
            msgpack.ExtType(1, b"f" + array.array("f", [0.5] * 5).tobytes()),
            f"^{_BAD_TYPE}token_ids: a packed float32 array where int32 belongs$",
        ),
        # an int32 array where int8 masks belong
        (
            "loss_mask",
            msgpack.ExtType(1, b"i" + array.array("i", [1, 1, 300, 1, 1]).tobytes()),
            f"^{_BAD_TYPE}loss_mask: a packed int32 array where int8 belongs$",
        ),
        # aligned lengths are still checked by Trajectory's own validator
        (
            "logprobs",
            msgpack.ExtType(1, b"f" + array.array("f", [0.0] * 4).tobytes()),
            f"^{_BAD_TYPE}logprobs has 4 entries for 5 generated tokens$",
        ),
        # a number list where a packed array belongs is converted, its values checked one by one
        ("positions", [0, 1, 2, 3, "x"], rf"^{_BAD_TYPE}positions: element 4 \('x'\) is not a number of int32$"),
    ],
)
def test_bad_packed_arrays_raise_decode_error_with_reason(form: str, name: str, ext: Any, reason: str) -> None:
    data = _positional_with_array(name, ext) if form == "positional" else _with_array(_raw_sample_finished(), name, ext)
    with pytest.raises(DecodeError, match=reason):
        decode(data)


def test_an_ext_blob_of_another_code_is_not_an_array() -> None:
    """The typed path refuses the extension code itself; the map path reads it as msgpack's ExtType (a pair), which
    then fails as a number list, naming the field."""
    ext = msgpack.ExtType(7, b"i" + bytes(20))
    with pytest.raises(DecodeError, match="^invalid SampleFinished: unknown msgpack extension 7$"):
        decode(_positional_with_array("positions", ext))
    with pytest.raises(DecodeError, match=rf"^{_BAD_TYPE}positions: element 1 \(b'i.*'\) is not a number of int32$"):
        decode(_with_array(_raw_sample_finished(), "positions", ext))


def test_a_packed_array_of_another_type_is_refused_even_when_its_values_fit() -> None:
    """The typecode on the wire is the writer's word for the array's type: integral floats where int32 token ids
    belong are refused (before the msgspec records, values that were valid ints were taken)."""
    raw = _raw_sample_finished()
    with pytest.raises(DecodeError, match="token_ids: a packed float32 array where int32 belongs"):
        decode(_with_array(raw, "token_ids", msgpack.ExtType(1, b"f" + array.array("f", [7.0] * 5).tobytes())))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda raw: {**raw, "e": [1, 2]}, "must be maps"),
        (lambda raw: {**raw, "p": "payload"}, "must be maps"),
        (lambda raw: {**raw, "v": True}, "type/version malformed"),
        (lambda raw: {k: v for k, v in raw.items() if k != "e"}, "not an event envelope"),
        (lambda raw: "a string", "not an event envelope"),
        (lambda raw: {**raw, "e": {**raw["e"], "policy_version": -1}}, "invalid SampleScored: policy_version"),
        (lambda raw: {**raw, "e": {**raw["e"], "surprise": 1}}, "invalid SampleScored: .*surprise"),
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
    fields = msgspec.structs.asdict(base)
    ok = Trajectory(
        **{
            **fields,
            "token_ids": torch.arange(5, dtype=torch.int64),
            "logprobs": array.array("d", [0.25] * 5),
            "positions": array.array("i", range(5)).tobytes(),
        }
    )
    assert ok.token_ids == [0, 1, 2, 3, 4] and ok.logprobs == [0.25] * 5 and ok.positions == [0, 1, 2, 3, 4]
    assert type(ok.token_ids) is Int32Array and type(ok.logprobs) is Float32Array and type(ok.positions) is Int32Array
    with pytest.raises(ValueError, match=r"^token_ids: element 3 \(2147483648\) does not fit int32$"):
        Trajectory(**{**fields, "token_ids": [0, 1, 2, 2**31, 4]})
    with pytest.raises(ValueError, match=r"^token_ids: element 1 \('x'\) is not a number of int32$"):
        Trajectory(**{**fields, "token_ids": [0, "x", 2, 3, 4]})
    with pytest.raises(ValueError, match=r"^positions: .*multiple of item size"):
        Trajectory(**{**fields, "positions": b"\x00" * 7})
    with pytest.raises((TypeError, ValueError), match=r"^loss_mask: a packed int32 array where int8 belongs$"):
        Trajectory(**{**fields, "loss_mask": Int32Array([1] * 5)})
    with pytest.raises(ValueError, match=r"^positions has 4 entries for 5 generated tokens$"):
        Trajectory(**{**fields, "positions": [0, 1, 2, 3]})
