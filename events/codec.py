"""The msgpack codec of events.

Wire format: a msgpack array `[type, schema version, envelope, payload]`, the envelope and the payload (and the
models nested in it) as arrays of their field values in declaration order, named by the layouts locked for each
(type, version) in schemas/wire_layouts.json (schemas/wire_layout.py): no key strings to decode and no maps to
build, so an entry unpacks 2.5-3.5x faster and is 40-60% smaller than the self-describing map
`{"t": type, "v": version, "e": envelope fields, "p": payload fields}` logs were written as before; those still
decode, and `named_form` gives any entry in that map form. Token ids, masks, positions and logprobs travel as
msgpack ExtType blobs holding the raw little-endian array bytes (ext code 1), prefixed by the array typecode, instead
of lists of Python numbers. Decoding upcasts older payload versions (named by their own locked layout) and refuses
newer ones; every failure is a DecodeError with a reason fit for a dead-letter entry.

Decode is the cost of a replay, so it is lean: the ext hook turns each array into an `array.array` of its wire typecode
(one C call), which the array field's schema accepts as a list without per-element validation when the typecode is
its own (anything else is validated value by value); the unpacked dicts are reused as the validator's input; the
model's core validator is called directly. Every field is still validated by the pydantic models.

Trust. `decode(data, trust=Trust.VALIDATE)` (the default) validates every field: bytes from anywhere (a foreign
log, a dead-letter check, a tampered entry) are held to the schema. `Trust.OWN_LOG` is for entries this project wrote
through `encode` (which only takes validated models) into a log it trusts, read back by the process that relies on
them (rebuilding its state, its own tail): the unpacked maps of the types that carry arrays or nested models
(SampleFinished, GroupAdmitted: most of a log's bytes) are turned into the models directly, from the arrays or the
maps, without running pydantic's validators again (the `positional_builder` and `trusted_builder` plans below: enums
are rebuilt as enums, tuples as tuples, packed arrays as lists, nested models recursively); flat types are validated
anyway, pydantic-core being as fast as a hand-built model there (`_heavy`). The trust is in the *writer*, not the
bytes' shape: an entry whose shape is not exactly what `encode` writes (a missing or extra field, an older schema
version, a type the plans cannot build, anything the build trips on) falls back to full validation, so a malformed
entry still becomes a DecodeError (and a dead-letter entry) under either trust. What OWN_LOG does not re-check is
field *values* (ranges, cross-field checks): a caller must pass OWN_LOG only for a log no one but this project writes.
"""

from __future__ import annotations

import array
import enum
import sys
import types
import typing
from collections.abc import Callable
from enum import StrEnum
from pathlib import PurePath
from typing import Any

import msgpack
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from rolledger.schemas.base import PackedArray, packed_typecode
from rolledger.schemas.events import PAYLOAD_TYPES, Event, current_version, upcast
from rolledger.schemas.wire import ARRAY_EXT, SCALARS
from rolledger.schemas.wire_layout import (
    ENVELOPE_FIELDS,
    MAP_ENCODED,
    LayoutMismatch,
    Namer,
    check_locked,
    encoder,
    load_locked,
    namer,
)

_PACK_CTX = {"packed": True}
_CURRENT_VERSION = {name: cls.SCHEMA_VERSION for name, cls in PAYLOAD_TYPES.items()}
_unpackb = msgpack.unpackb
_validate_event = Event.__pydantic_validator__.validate_python  # the TypeAdapter's core validator, minus a wrapper
_LOCKED = load_locked()
check_locked(_LOCKED)  # a payload changed without a new schema version fails every import, so every test, here
_NAMERS: dict[tuple[str, int], Namer] = {
    (name, int(version)): namer(layout)
    for name, by_version in _LOCKED.items()
    for version, layout in by_version.items()
}
_PAYLOAD_ENCODERS = {name: encoder(cls, skip=("type",)) for name, cls in PAYLOAD_TYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every platform we run on is little-endian
    raise ImportError("the rolledger codec assumes a little-endian host")


class Trust(StrEnum):
    """How far `decode` trusts the bytes it is given (see the module docstring)."""

    VALIDATE = "validate"  # any bytes: every field validated (the default; foreign logs, audits, dead-letter checks)
    OWN_LOG = "own-log"  # entries this project encoded into a log it trusts: built without re-validating


class DecodeError(ValueError):
    """An entry that cannot become an Event; `reason` says why (garbage, unknown type, newer schema, invalid field)."""

    def __init__(self, reason: str, event_type: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.event_type = event_type


def _default(obj: Any) -> Any:
    if isinstance(obj, PackedArray):
        return msgpack.ExtType(ARRAY_EXT, obj.typecode.encode() + obj.data)
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, PurePath):
        return str(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


_ARRAY_TYPECODES = {ord(c): c for c in "ifb"}  # first byte -> typecode: int32, float32, int8 (schemas.base)


def _ext_hook(code: int, data: bytes) -> Any:
    """An array ext becomes an `array.array` of its wire typecode (one C call); the field's schema checks the typecode
    and turns it into a list without validating element by element (schemas.base.PackedArraySchema)."""
    if code != ARRAY_EXT:
        return msgpack.ExtType(code, data)
    typecode = _ARRAY_TYPECODES.get(data[0]) if data else None
    if typecode is None:
        raise DecodeError(f"packed array with unknown typecode {chr(data[0]) if data else ''!r}")
    try:
        return array.array(typecode, data[1:])
    except ValueError:
        raise DecodeError(
            f"packed array of typecode {typecode!r} has {len(data) - 1} bytes, "
            f"not a multiple of {array.array(typecode).itemsize}"
        ) from None


_packer = msgpack.Packer(default=_default, use_bin_type=True)


def encode(event: Event) -> bytes:
    """Event -> msgpack bytes: `[type, version, envelope, payload]`, the last two positional (arrays packed). The
    version written is the one whose layout the payload is written in: its model's SCHEMA_VERSION."""
    values = event.__dict__
    payload = event.payload
    return _packer.pack(
        [
            payload.type,
            payload.SCHEMA_VERSION,
            [values[k] for k in ENVELOPE_FIELDS],
            _PAYLOAD_ENCODERS[payload.type](payload),
        ]
    )


def decode(data: bytes, trust: Trust = Trust.VALIDATE) -> Event:
    """msgpack bytes -> Event, upcasting an older payload version. Raises DecodeError.

    `trust`: Trust.VALIDATE validates every field; Trust.OWN_LOG builds the models straight from an entry of the
    exact shape `encode` writes (anything else is validated as under VALIDATE). See the module docstring."""
    try:
        raw = _unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types for garbage
        raise DecodeError(f"not msgpack: {exc.__class__.__name__}: {exc}") from None
    if type(raw) is list:
        return _decode_positional(raw, trust)
    try:
        type_, version, env, payload = raw["t"], raw["v"], raw["e"], raw["p"]
    except (KeyError, TypeError, IndexError):
        raise DecodeError("not an event envelope (expected [type, version, envelope, payload])") from None
    if type(type_) is not str or type(version) is not int:
        raise DecodeError("envelope type/version malformed")
    if type(env) is not dict or type(payload) is not dict:
        raise DecodeError(f"envelope fields and payload of {type_!r} must be maps", type_)
    current = _CURRENT_VERSION.get(type_)
    if version != current:  # an unknown type (current None) or an older/newer version: upcast decides
        try:
            payload = upcast(type_, version, payload)
        except ValueError as exc:  # SchemaTooNew included
            raise DecodeError(str(exc), type_) from None
        current = PAYLOAD_TYPES[type_].SCHEMA_VERSION
    elif trust is Trust.OWN_LOG:
        build = _TRUSTED.get(type_)
        if build is not None and env.keys() == _ENVELOPE_KEYS:
            try:
                return _trusted_event(env, type_, current, build(payload))
            except _Untrusted:
                # the build may have converted some fields in place: unpack again for the validating path
                raw = _unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
                env, payload = raw["e"], raw["p"]
    return _validate(type_, current, env, payload)


def _validate(type_: str, version: int, env: dict[str, Any], payload: dict[str, Any]) -> Event:
    """Every field validated by the models. The maps are the caller's alone: the model input is built in them in place
    instead of copied. Upcast payloads are re-stamped with the version they now have, so re-encoding never mislabels
    them."""
    payload["type"] = type_
    env["schema_version"] = version
    env["payload"] = payload
    try:
        return _validate_event(env)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise DecodeError(f"invalid {type_}: {where}: {first['msg']}", type_) from None


def _decode_positional(raw: list[Any], trust: Trust) -> Event:
    """`[type, version, envelope, payload]` -> Event: built straight from the values under OWN_LOG when the shape is
    exactly what `encode` writes, else named by the locked layout of (type, version), upcast and validated."""
    if len(raw) != 4:
        raise DecodeError(f"not an event envelope (expected [type, version, envelope, payload], got {len(raw)} items)")
    type_, version, env, payload = raw
    if type(type_) is not str or type(version) is not int:
        raise DecodeError("envelope type/version malformed")
    if type(env) is not list or type(payload) is not list:
        raise DecodeError(f"envelope and payload of {type_!r} must be arrays", type_)
    if len(env) != len(ENVELOPE_FIELDS):
        raise DecodeError(f"invalid {type_}: envelope has {len(env)} fields, not {len(ENVELOPE_FIELDS)}", type_)
    current = _CURRENT_VERSION.get(type_)
    if trust is Trust.OWN_LOG and version == current:
        build = _TRUSTED_POSITIONAL.get(type_)
        if build is not None:
            # any shape a plan trips on is validated instead, and reported from there (the builders never change
            # their input, so the same values are validated)
            try:
                return _trusted_event(dict(zip(ENVELOPE_FIELDS, env)), type_, version, build(payload))
            except Exception:  # noqa: BLE001, S110 - a try costs nothing here; contextlib.suppress cost 0.4 us
                pass
    name = _NAMERS.get((type_, version))
    if name is None:
        try:
            current_version(type_, version)  # an unknown type or a newer version: its own message
        except ValueError as exc:
            raise DecodeError(str(exc), type_) from None
        raise DecodeError(f"{type_} v{version} has no locked wire layout", type_)
    try:
        fields = name(payload)
    except LayoutMismatch as exc:
        raise DecodeError(f"invalid {type_}: payload has {exc}", type_) from None
    if version != current:
        try:
            fields = upcast(type_, version, fields)
        except ValueError as exc:
            raise DecodeError(str(exc), type_) from None
    return _validate(type_, PAYLOAD_TYPES[type_].SCHEMA_VERSION, dict(zip(ENVELOPE_FIELDS, env)), fields)


def named_form(data: bytes) -> dict[str, Any]:
    """An entry as the self-describing map `{"t": type, "v": version, "e": envelope, "p": payload}`, its positional
    parts named by their locked layouts (for a person reading raw entries, and for tests that reshape them; packing
    the map gives an entry `decode` reads as well). Raises DecodeError where the entry has no such form."""
    raw = _unpackb(data, raw=False, strict_map_key=False)  # arrays stay ext blobs, so the map packs back as it was
    if type(raw) is not list:
        return dict(raw)
    if len(raw) != 4 or type(raw[2]) is not list:
        raise DecodeError("not an event envelope")
    name = _NAMERS.get((raw[0], raw[1]))
    if name is None:
        raise DecodeError(f"{raw[0]} v{raw[1]} has no locked wire layout")
    try:
        return {"t": raw[0], "v": raw[1], "e": dict(zip(ENVELOPE_FIELDS, raw[2], strict=True)), "p": name(raw[3])}
    except (LayoutMismatch, ValueError) as exc:
        raise DecodeError(f"invalid {raw[0]}: {exc}") from None


# ---------------------------------------------------------------- the trusted path (Trust.OWN_LOG)
class _Untrusted(Exception):
    """The entry is not of the exact shape `encode` writes (or a plan cannot build it): validate it instead."""


Conv = Callable[[Any], Any]
_object_setattr = object.__setattr__
_ENVELOPE_KEYS = frozenset(ENVELOPE_FIELDS)


def _construct(cls: type[BaseModel], values: dict[str, Any]) -> Any:
    """What `cls.model_construct(**values)` does for a complete set of fields, minus its per-field loop."""
    obj = cls.__new__(cls)
    _object_setattr(obj, "__dict__", values)
    _object_setattr(obj, "__pydantic_fields_set__", set(values))
    _object_setattr(obj, "__pydantic_extra__", None)
    _object_setattr(obj, "__pydantic_private__", None)
    return obj


def _trusted_event(env: dict[str, Any], type_: str, version: int, payload: BaseModel) -> Event:
    for name in ("causation_id", "correlation_id"):
        if env[name] is not None and type(env[name]) is not str:
            raise _Untrusted
    env["schema_version"] = version
    env["payload"] = payload
    built: Event = _construct(Event, env)
    return built


def _conv(annotation: Any, info: FieldInfo | None = None, positional: bool = False) -> Conv | None:
    """How to turn the unpacked wire value of a field of this annotation into the model's value (None: as it is);
    nested models from their positional form where `positional` (but MAP_ENCODED ones from their map).
    Raises TypeError for an annotation it cannot build (the type then always takes the validating path)."""
    packed_as = packed_typecode(info) if info else None
    if packed_as is not None:

        def packed(v: Any) -> Any:
            if type(v) is not array.array or v.typecode != packed_as:
                raise _Untrusted
            return v.tolist()

        return packed
    if annotation in SCALARS:
        return None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        if all(type(a) in SCALARS for a in args):
            return None
        members = {a.value: a for a in args if isinstance(a, enum.Enum)}
        if len(members) != len(args):
            raise TypeError(f"cannot build {annotation}")

        def literal_enum(v: Any) -> Any:
            try:
                return members[v]
            except (KeyError, TypeError):
                raise _Untrusted from None

        return literal_enum
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"cannot build {annotation}")
        inner = _conv(rest[0], positional=positional)
        if inner is None:
            return None
        return lambda v: None if v is None else inner(v)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _conv(args[0], positional=positional)
        if item is None:
            return tuple
        return lambda v: tuple(item(x) for x in v)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        enum_cls = annotation

        def to_enum(v: Any) -> Any:
            try:
                return enum_cls(v)
            except ValueError:
                raise _Untrusted from None

        return to_enum
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if positional and annotation.__name__ not in MAP_ENCODED:
            return positional_builder(annotation)
        return trusted_builder(annotation)
    raise TypeError(f"cannot build {annotation}")


def trusted_builder(cls: type[BaseModel]) -> Callable[[dict[str, Any]], Any]:
    """A function turning the wire map of `cls` (every field present, as `encode` writes it) into the model without
    validation; a map of any other shape raises _Untrusted. Raises TypeError when a field's type cannot be built."""
    names = frozenset(cls.model_fields)
    convs = tuple(
        (name, conv) for name, info in cls.model_fields.items() if (conv := _conv(info.annotation, info)) is not None
    )

    def build(d: Any) -> Any:
        if type(d) is not dict or d.keys() != names:
            raise _Untrusted
        for name, conv in convs:
            d[name] = conv(d[name])
        return _construct(cls, d)

    return build


def positional_builder(cls: type[BaseModel], skip: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """A function turning the positional form of `cls` (less `skip`) into the model without validation; a value of
    any other shape raises. Raises TypeError when a field's type cannot be built. It never changes its input."""
    names = tuple(name for name in cls.model_fields if name not in skip)
    count = len(names)
    convs = tuple(
        (name, conv)
        for name, info in cls.model_fields.items()
        if name not in skip and (conv := _conv(info.annotation, info, positional=True)) is not None
    )

    def build(values: Any) -> Any:
        if type(values) is not list or len(values) != count:
            raise _Untrusted
        d = dict(zip(names, values))
        for name, conv in convs:
            d[name] = conv(d[name])
        return d if skip else _construct(cls, d)

    return build


def _positional_payload_builder(cls: type[BaseModel]) -> Callable[[list[Any]], Any] | None:
    """The trusted builder of a payload type from its positional form (the frame carries `type`), or None for a type
    with a field of a type the plans cannot build (always validated). Flat types too: from the positional form a
    build is cheaper than pydantic-core's validator (measured, trusted decode of a whole entry: SampleStarted 3.5 us
    built vs 4.7 validated, SampleScored 2.8 vs 4.5, GroupCompleted 3.5 vs 5.1); from a map it is not (`_heavy`)."""
    try:
        fields = positional_builder(cls, skip=("type",))
    except TypeError:
        return None
    type_name = cls.model_fields["type"].default

    def build(values: list[Any]) -> Any:
        d = fields(values)
        d["type"] = type_name
        return _construct(cls, d)

    return build


def _heavy(cls: type[BaseModel]) -> bool:
    """Whether a payload type holds packed arrays or nested models: where building it from its wire *map* beats
    pydantic-core's validator. For a flat model read from a map (logs written before the positional layout) the
    validator (one Rust call) is as fast as building it by hand or faster (measured: SampleStarted 5.0 us validated vs
    6.8 us built, SampleFinished 18.1 vs 15.8, GroupAdmitted 11.1 vs 9.9), so flat types in map entries are validated
    under either trust."""
    for info in cls.model_fields.values():
        if packed_typecode(info) is not None:
            return True
        for a in (info.annotation, *typing.get_args(info.annotation)):
            if isinstance(a, type) and issubclass(a, BaseModel):
                return True
    return False


def _payload_builder(cls: type[BaseModel]) -> Callable[[dict[str, Any]], Any] | None:
    """The trusted builder of a payload type (its wire map lacks `type`, which decode adds back), or None for a flat
    type (`_heavy`) or one with a field of a type the plans cannot build: such types are always validated."""
    if not _heavy(cls):
        return None
    try:
        inner = trusted_builder(cls)
    except TypeError:
        return None
    type_name = cls.model_fields["type"].default

    def build(d: dict[str, Any]) -> Any:
        d["type"] = type_name
        return inner(d)

    return build


_TRUSTED: dict[str, Callable[[dict[str, Any]], Any]] = {
    name: b for name, cls in PAYLOAD_TYPES.items() if (b := _payload_builder(cls)) is not None
}
_TRUSTED_POSITIONAL: dict[str, Callable[[list[Any]], Any]] = {
    name: pb for name, cls in PAYLOAD_TYPES.items() if (pb := _positional_payload_builder(cls)) is not None
}
