"""A model's wire form: the plain values (maps, lists, scalars, array ext blobs) the event codec packs with msgpack,
and the encoded size of a model, which is what admission counts a queued trajectory as holding.

Packed arrays (schemas.base.PackedArraySchema fields) become msgpack ExtType blobs (code `ARRAY_EXT`) holding the
array's typecode and raw little-endian bytes, in one C call each. The framing of events and their decoding are the
codec's (events/codec.py); this module is only the walk both share with the size, so an encoded size is exactly the
bytes the model takes inside an encoded event (msgpack is compositional).
"""

from __future__ import annotations

import array
from pathlib import PurePath
from typing import Any

import msgpack
from pydantic import BaseModel

from rolledger.schemas.base import PackedArraySchema

ARRAY_EXT = 1  # the msgpack ext code of a packed array
SCALARS = frozenset({str, int, float, bool, type(None)})

_FIELDS: dict[type[BaseModel], tuple[tuple[str, str | None], ...]] = {}
_packer = msgpack.Packer(use_bin_type=True)


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


def wire_form(obj: Any) -> Any:
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
                out[name] = msgpack.ExtType(ARRAY_EXT, typecode.encode() + packed)
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
    """The bytes `model` takes inside an encoded event, e.g. a trajectory's inside its SampleFinished."""
    return len(_packer.pack(wire_form(model)))
