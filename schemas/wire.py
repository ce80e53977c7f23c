"""A model's map form: the plain values (maps, lists, scalars, array ext blobs) of a self-describing msgpack map, and
the encoded size of a model, which is what admission counts a queued trajectory as holding.

Packed arrays (schemas.base.PackedArraySchema fields) become msgpack ExtType blobs (code `ARRAY_EXT`) holding the
array's typecode and raw little-endian bytes, in one C call each. The framing of events and their decoding are the
codec's (events/codec.py), and the log's entries are positional now (schemas/wire_layout.py); the map form remains
what the config is written as inside RunStarted, what logs written before the positional layout hold, and the measure
of `encoded_size`: a trajectory's accounting size stays the size of its map form, the bytes its SampleFinished took
when admission and invariant 6 were defined, so every log recorded since audits and replays to the same decisions.
It is an upper bound on the positional entry's share (576 against 976 bytes for a 32 + 22 token sample).
"""

from __future__ import annotations

import array
from pathlib import PurePath
from typing import Any

import msgpack
from pydantic import BaseModel

from rolledger.schemas.base import packed_typecode

ARRAY_EXT = 1  # the msgpack ext code of a packed array
SCALARS = frozenset({str, int, float, bool, type(None)})

_FIELDS: dict[type[BaseModel], tuple[tuple[str, str | None], ...]] = {}
_packer = msgpack.Packer(use_bin_type=True)


def _fields(cls: type[BaseModel]) -> tuple[tuple[str, str | None], ...]:
    """(field name, wire typecode of a packed-array field or None), read once per model class."""
    found = _FIELDS.get(cls)
    if found is None:
        found = tuple((name, packed_typecode(info)) for name, info in cls.model_fields.items())
        _FIELDS[cls] = found
    return found


def pack_array(owner: type, name: str, typecode: str, value: Any) -> msgpack.ExtType:
    """A packed-array field's value as its ext blob: the typecode, then the raw little-endian bytes (one C call)."""
    try:
        packed = array.array(typecode, value).tobytes()
    except OverflowError as exc:  # a model built with model_construct/model_copy skipped the range check
        raise ValueError(f"{owner.__name__}.{name}: {exc}") from None
    return msgpack.ExtType(ARRAY_EXT, typecode.encode() + packed)


def wire_form(obj: Any) -> Any:
    """What `model_dump(context={"packed": True})` gives, built straight from the (already validated) models' fields:
    the models are immutable and valid, so serialising is a walk, and arrays become ext blobs in one C call each."""
    if isinstance(obj, BaseModel):
        values = obj.__dict__
        out: dict[str, Any] = {}
        for name, typecode in _fields(type(obj)):
            value = values[name]
            if typecode is not None:
                out[name] = pack_array(type(obj), name, typecode, value)
            elif type(value) in SCALARS:
                out[name] = value
            else:
                out[name] = wire_form(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [wire_form(v) for v in obj]
    if isinstance(obj, dict):
        return {k: wire_form(v) for k, v in obj.items()}
    if isinstance(obj, PurePath):
        return str(obj)
    return obj


def encoded_size(model: BaseModel) -> int:
    """The bytes `model` takes in its map form (e.g. a trajectory inside a map-encoded SampleFinished): the accounting
    size admission and invariant 6 count, an upper bound on its positional share of a log entry."""
    return len(_packer.pack(wire_form(model)))
