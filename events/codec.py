"""The msgpack codec of events.

Wire format: a msgpack map {"t": type, "v": schema version, "e": envelope fields, "p": payload fields}. Token ids,
masks, positions and logprobs travel as msgpack ExtType blobs holding the raw little-endian array bytes (ext code 1),
prefixed by the array typecode, instead of lists of Python numbers. Decoding upcasts older payload versions and
refuses newer ones; every failure is a DecodeError with a reason fit for a dead-letter entry.

Decode is the cost of a replay, so it is lean: the ext hook turns each array into an `array.array` of its wire typecode
(one C call), which the array field's schema accepts as a list without per-element validation when the typecode is
its own (anything else is validated value by value); the unpacked dicts are reused as the validator's input; the
model's core validator is called directly. Every field is still validated by the pydantic models.
"""

from __future__ import annotations

import array
import sys
from pathlib import PurePath
from typing import Any

import msgpack
from pydantic import BaseModel, ValidationError

from rolledger.schemas.base import PackedArray, PackedArraySchema
from rolledger.schemas.events import PAYLOAD_TYPES, Event, upcast

_ARRAY_EXT = 1
_PACK_CTX = {"packed": True}
_CURRENT_VERSION = {name: cls.SCHEMA_VERSION for name, cls in PAYLOAD_TYPES.items()}
_unpackb = msgpack.unpackb
_validate_event = Event.__pydantic_validator__.validate_python  # the TypeAdapter's core validator, minus a wrapper
_ENVELOPE_FIELDS = ("event_id", "run_id", "producer", "causation_id", "correlation_id", "policy_version", "wall_time")

if sys.byteorder != "little":  # pragma: no cover - every platform we run on is little-endian
    raise ImportError("the rolledger codec assumes a little-endian host")


class DecodeError(ValueError):
    """An entry that cannot become an Event; `reason` says why (garbage, unknown type, newer schema, invalid field)."""

    def __init__(self, reason: str, event_type: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.event_type = event_type


def _default(obj: Any) -> Any:
    if isinstance(obj, PackedArray):
        return msgpack.ExtType(_ARRAY_EXT, obj.typecode.encode() + obj.data)
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, PurePath):
        return str(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


_ARRAY_TYPECODES = {ord(c): c for c in "ifb"}  # first byte -> typecode: int32, float32, int8 (schemas.base)


def _ext_hook(code: int, data: bytes) -> Any:
    """An array ext becomes an `array.array` of its wire typecode (one C call); the field's schema checks the typecode
    and turns it into a list without validating element by element (schemas.base.PackedArraySchema)."""
    if code != _ARRAY_EXT:
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


_FIELDS: dict[type[BaseModel], tuple[tuple[str, str | None], ...]] = {}


def _fields(cls: type[BaseModel]) -> tuple[tuple[str, str | None], ...]:
    """(field name, wire typecode of a packed-array field or None), read once per model class."""
    found = _FIELDS.get(cls)
    if found is None:
        found = tuple(
            (name, next((m.typecode for m in info.metadata if isinstance(m, PackedArraySchema)), None))
            for name, info in cls.model_fields.items()
        )
        _FIELDS[cls] = found
    return found


def _wire(obj: Any) -> Any:
    """What `model_dump(context={"packed": True})` gives, built straight from the (already validated) models' fields:
    the models are immutable and valid, so serialising is a walk, and arrays become ext blobs in one C call each."""
    if isinstance(obj, BaseModel):
        values = obj.__dict__
        out: dict[str, Any] = {}
        for name, typecode in _fields(type(obj)):
            value = values[name]
            if typecode is not None:
                try:
                    packed = array.array(typecode, value).tobytes()
                except OverflowError as exc:  # a model built with model_construct/model_copy skipped the range check
                    raise ValueError(f"{type(obj).__name__}.{name}: {exc}") from None
                out[name] = msgpack.ExtType(_ARRAY_EXT, typecode.encode() + packed)
            elif type(value) in _SCALARS:
                out[name] = value
            else:
                out[name] = _wire(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [_wire(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _wire(v) for k, v in obj.items()}
    if isinstance(obj, PurePath):
        return str(obj)
    return obj


_SCALARS = frozenset({str, int, float, bool, type(None)})


def encode(event: Event) -> bytes:
    """Event -> msgpack bytes (arrays packed as binary)."""
    values = event.__dict__
    env = {k: values[k] for k in _ENVELOPE_FIELDS}
    payload = _wire(event.payload)
    del payload["type"]
    return _packer.pack({"t": event.type, "v": event.schema_version, "e": env, "p": payload})


def decode(data: bytes) -> Event:
    """msgpack bytes -> Event, upcasting an older payload version. Raises DecodeError."""
    try:
        raw = _unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types for garbage
        raise DecodeError(f"not msgpack: {exc.__class__.__name__}: {exc}") from None
    try:
        type_, version, env, payload = raw["t"], raw["v"], raw["e"], raw["p"]
    except (KeyError, TypeError, IndexError):
        raise DecodeError("not an event envelope (expected keys t, v, e, p)") from None
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
    # `raw` is ours alone: build the model input in place instead of copying. Upcast payloads are re-stamped with
    # the version they now have, so re-encoding never mislabels them.
    payload["type"] = type_
    env["schema_version"] = current
    env["payload"] = payload
    try:
        return _validate_event(env)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise DecodeError(f"invalid {type_}: {where}: {first['msg']}", type_) from None
