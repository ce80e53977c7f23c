"""The msgpack codec of events.

Wire format: a msgpack map {"t": type, "v": schema version, "e": envelope fields, "p": payload fields}. Token ids,
masks, positions and logprobs travel as msgpack ExtType blobs holding the raw little-endian array bytes (ext code 1),
prefixed by the array typecode, instead of lists of Python numbers. Decoding upcasts older payload versions and
refuses newer ones; every failure is a DecodeError with a reason fit for a dead-letter entry.
"""

from __future__ import annotations

import sys
from pathlib import PurePath
from typing import Any

import msgpack
from pydantic import ValidationError

from schemas.base import PackedArray
from schemas.events import EVENT_ADAPTER, PAYLOAD_TYPES, Event, SchemaTooNew, upcast

_ARRAY_EXT = 1
_PACK_CTX = {"packed": True}
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


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _ARRAY_EXT:
        return data[1:]  # raw bytes; the I32Array/F32Array validators turn them back into lists
    return msgpack.ExtType(code, data)


_packer = msgpack.Packer(default=_default, use_bin_type=True)


def encode(event: Event) -> bytes:
    """Event -> msgpack bytes (arrays packed as binary)."""
    dumped = event.model_dump(mode="python", context=_PACK_CTX, exclude={"payload"})
    payload = event.payload.model_dump(mode="python", context=_PACK_CTX, exclude={"type"})
    env = {k: dumped[k] for k in _ENVELOPE_FIELDS}
    return _packer.pack({"t": event.type, "v": event.schema_version, "e": env, "p": payload})


def decode(data: bytes) -> Event:
    """msgpack bytes -> Event, upcasting an older payload version. Raises DecodeError."""
    try:
        raw = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise DecodeError(f"not msgpack: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(raw, dict) or not {"t", "v", "e", "p"} <= raw.keys():
        raise DecodeError("not an event envelope (expected keys t, v, e, p)")
    type_, version = raw["t"], raw["v"]
    if not isinstance(type_, str) or not isinstance(version, int):
        raise DecodeError("envelope type/version malformed")
    try:
        payload = upcast(type_, version, dict(raw["p"]))
    except SchemaTooNew as exc:
        raise DecodeError(str(exc), type_) from None
    except ValueError as exc:
        raise DecodeError(str(exc), type_) from None
    payload["type"] = type_
    try:
        # upcast payloads are re-stamped with the version they now have, so re-encoding never mislabels them
        current = PAYLOAD_TYPES[type_].SCHEMA_VERSION
        return EVENT_ADAPTER.validate_python({**raw["e"], "schema_version": current, "payload": payload})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise DecodeError(f"invalid {type_}: {where}: {first['msg']}", type_) from None
