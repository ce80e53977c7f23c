"""A record's map form, the encoded size admission counts, and the pydantic models nested inside records.

The map form of a record (or model) is the self-describing msgpack map `{field: value}` with packed arrays as ext
blobs (schemas.base). Logs written before the positional layout hold it; RunConfig travels as it inside RunStarted
(`MAP_ENCODED`); and it is the measure of `encoded_size`: a trajectory's accounting size stays the size of its map
form, the bytes its SampleFinished took when admission and invariant 6 were defined, so every log recorded since
audits and replays to the same decisions. It is an upper bound on the positional entry's share (576 against 976
bytes for a 32 + 22 token sample).

Pydantic models nested in a record (the sampling parameters, the partial policy, the run config) stay pydantic: they
are config, validated where a user writes them. On the wire they are positional (their fields in declaration order)
except MAP_ENCODED ones; `nested_model_form` and `nested_model_from` are msgspec's hooks for them. The few distinct
sampling parameters of a run repeat on every trajectory, so a decoded one is looked up by its wire form before it is
validated again.
"""

from __future__ import annotations

import array
import functools
import typing
from collections import OrderedDict
from enum import Enum
from pathlib import PurePath
from typing import Any

import msgpack
import msgspec
from pydantic import BaseModel, ValidationError

from rolledger.schemas.base import ARRAY_EXT, PACKED_TYPES, PackedArray

SCALARS = frozenset({str, int, float, bool, type(None)})
MAP_ENCODED = frozenset({"RunConfig"})  # model class names encoded as maps inside positional records

_packer = msgpack.Packer(use_bin_type=True)


def pack_array(owner: type, name: str, typecode: str, value: Any) -> msgpack.ExtType:
    """An array's value as its ext blob: the typecode, then the raw little-endian bytes (one C call)."""
    try:
        data = value.tobytes() if type(value) is array.array and value.typecode == typecode else None
        if data is None:
            data = array.array(typecode, value).tobytes()
    except OverflowError as exc:
        raise ValueError(f"{owner.__name__}.{name}: {exc}") from None
    return msgpack.ExtType(ARRAY_EXT, typecode.encode() + data)


def wire_form(obj: Any) -> Any:
    """The map form of a record or model (nested ones too): plain values msgpack packs, arrays as ext blobs."""
    if isinstance(obj, msgspec.Struct):
        omit = _omitted(obj)
        return {name: wire_form(getattr(obj, name)) for name in obj.__struct_fields__ if name not in omit}
    if isinstance(obj, PackedArray):
        return msgpack.ExtType(ARRAY_EXT, obj.TYPECODE.encode() + obj.tobytes())
    if isinstance(obj, BaseModel):
        return {name: wire_form(value) for name, value in obj.__dict__.items()}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [wire_form(v) for v in obj]
    if isinstance(obj, dict):
        return {k: wire_form(v) for k, v in obj.items()}
    if isinstance(obj, PurePath):
        return str(obj)
    return obj


def encoded_size(record: Any) -> int:
    """The bytes `record` takes in its map form (e.g. a trajectory inside a map-encoded SampleFinished): the
    accounting size admission and invariant 6 count, an upper bound on its positional share of a log entry.

    Counted without building the map: the positional encoding (msgspec, in C) plus each record's and each
    positionally nested model's field names as msgpack strings. The two forms differ only by those keys: a map and
    an array of the same length have headers of the same size (fix, 16- or 32-bit alike), and every value is packed
    the same way by both encoders (tests/test_sample_bytes.py checks it against `map_form_size`). About 3 us for a
    trajectory where packing its map took 17.

    `encoded_size_and_form` gives the positional encoding too (events/measured.py keeps it for the codec)."""
    return encoded_size_and_form(record)[0]


def encoded_size_and_form(record: Any) -> tuple[int, bytes]:
    """`encoded_size` and the positional encoding it was counted from (the bytes msgspec gives the record inside any
    record)."""
    data = _size_encoder.encode(record)
    return len(data) + _key_bytes(record), data


def map_form_size(record: Any) -> int:
    """`encoded_size` the long way: the map form built and packed (the reference the fast count is tested against)."""
    return len(_packer.pack(wire_form(record)))


def _key_bytes(obj: Any) -> int:
    """The msgpack bytes of the field names the map form of `obj` adds to its positional form (nested records and
    positional models included)."""
    if isinstance(obj, msgspec.Struct):
        cls = type(obj)
        keys, nested = _struct_keys(cls)
        n = keys
        for name in nested:
            value = getattr(obj, name)
            if value:  # None and an empty tuple add no keys (a record or a model is always true)
                n += _key_bytes(value)
        omit = _omitted(obj)
        if omit:
            n -= _omitted_bytes(cls, omit)
        return n
    if isinstance(obj, BaseModel):
        found = _MODEL_KEYS.get(id(obj))  # models are immutable and few (a run's sampling parameters)
        if found is not None and found[0] is obj:
            return found[1]
        n = _model_key_bytes(obj)
        if len(_MODEL_KEYS) >= _FORMS_SIZE:
            _MODEL_KEYS.clear()
        _MODEL_KEYS[id(obj)] = (obj, n)
        return n
    if isinstance(obj, (list, tuple)):
        return sum(_key_bytes(v) for v in obj if type(v) not in SCALARS)
    if isinstance(obj, dict):
        return sum(_key_bytes(v) for v in obj.values() if type(v) not in SCALARS)
    return 0


def _model_key_bytes(obj: BaseModel) -> int:
    if type(obj).__name__ in MAP_ENCODED:
        return 0  # encoded as its map form already
    n = _name_bytes(tuple(obj.__dict__))
    for value in obj.__dict__.values():
        if type(value) not in SCALARS:
            n += _key_bytes(value)
    return n


_MODEL_KEYS: dict[int, tuple[BaseModel, int]] = {}  # id -> (model, its key bytes): the model kept alive while cached


@functools.cache
def _omitted_bytes(cls: type[msgspec.Struct], omit: tuple[str, ...]) -> int:
    """What leaving `omit` out of the map form of a `cls` takes off: no key, no value (an empty array, 1 byte), and
    the header of one entry less per field."""
    count = len(cls.__struct_fields__)
    return sum(len(_packer.pack(name)) + 1 for name in omit) - (_header_bytes(count - len(omit)) - _header_bytes(count))


def _omitted(obj: msgspec.Struct) -> tuple[str, ...]:
    """The fields of a record its map form leaves out: those of its class's `MAP_OMIT_EMPTY` that are empty (added
    after the accounting size was defined, so a record without them counts as it did before they existed)."""
    names: tuple[str, ...] = getattr(type(obj), "MAP_OMIT_EMPTY", ())
    return tuple(name for name in names if not getattr(obj, name)) if names else ()


def _header_bytes(count: int) -> int:
    """The bytes of a msgpack array or map header of `count` entries (the two are the same size)."""
    return 1 if count <= 15 else 3 if count <= 0xFFFF else 5


@functools.cache
def _name_bytes(names: tuple[str, ...]) -> int:
    return sum(len(_packer.pack(name)) for name in names)


@functools.cache
def _struct_keys(cls: type[msgspec.Struct]) -> tuple[int, tuple[str, ...]]:
    """(the msgpack bytes of the record's field names, its fields that can hold a record or a model)."""
    hints = typing.get_type_hints(cls)
    nested = tuple(name for name in cls.__struct_fields__ if _may_nest(hints.get(name)))
    return _name_bytes(tuple(cls.__struct_fields__)), nested


def _may_nest(hint: Any) -> bool:
    if isinstance(hint, type):
        return issubclass(hint, (msgspec.Struct, BaseModel))
    return any(_may_nest(a) for a in typing.get_args(hint))


def nested_model_form(obj: Any) -> Any:
    """A pydantic model nested in a record, as msgspec encodes it: its field values in declaration order (nested
    models likewise), or its map form for MAP_ENCODED models. TypeError for anything else (msgspec's contract)."""
    if not isinstance(obj, BaseModel):
        if isinstance(obj, PurePath):
            return str(obj)
        raise NotImplementedError(f"cannot encode {type(obj).__name__}")
    if type(obj).__name__ in MAP_ENCODED:
        return wire_form(obj)
    return [_positional_value(v) for v in obj.__dict__.values()]


def _positional_value(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return nested_model_form(value)
    if type(value) in SCALARS or isinstance(value, Enum):
        return value
    return wire_form(value)


_MODEL_CACHE: OrderedDict[tuple[type, Any], BaseModel] = OrderedDict()
_MODEL_CACHE_SIZE = 1024


def _key(values: list[Any]) -> Any:
    """A hashable key of a flat positional form (its lists become tuples); TypeError where it holds anything else
    unhashable."""
    key = tuple([tuple(v) if type(v) is list else v for v in values])
    hash(key)
    return key


def nested_model_from(type_: type, obj: Any) -> Any:
    """A pydantic model nested in a record, from its wire form (positional, or a map), validated by pydantic; a
    positional form seen recently is the model built from it then (models are immutable). msgspec.ValidationError
    naming the model's field for anything invalid."""
    if not (isinstance(type_, type) and issubclass(type_, BaseModel)):
        raise msgspec.ValidationError(f"cannot decode {type_!r}")
    key = None
    if type(obj) is list:
        try:
            key = (type_, _key(obj))
        except TypeError:
            key = None
        if key is not None:
            found = _MODEL_CACHE.get(key)
            if found is not None:
                return found
        names = tuple(type_.model_fields)
        if len(obj) != len(names):
            raise msgspec.ValidationError(f"{type_.__name__} has {len(obj)} fields where its layout has {len(names)}")
        data: Any = dict(zip(names, obj))
    elif type(obj) is dict:
        data = obj
    else:
        raise msgspec.ValidationError(f"expected {type_.__name__} as an array or a map, got {type(obj).__name__}")
    try:
        model = type_.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise msgspec.ValidationError(f"{type_.__name__}.{where}: {first['msg']}") from None
    if key is not None:
        _MODEL_CACHE[key] = model
        if len(_MODEL_CACHE) > _MODEL_CACHE_SIZE:
            _MODEL_CACHE.popitem(last=False)
    return model


# ---------------------------------------------------------------- msgspec's hooks
_FORMS: dict[int, tuple[BaseModel, Any]] = {}  # id -> (model, positional form): the model kept alive while cached
_FORMS_SIZE = 1024
_TYPECODE_BYTES: dict[type, bytes] = {c: c.TYPECODE.encode() for c in PACKED_TYPES.values()}


def enc_hook(obj: Any) -> Any:
    """msgspec's hook for what it cannot encode natively: a packed array becomes its ext blob; a pydantic model
    nested in a record its positional form (the same few sampling parameters are encoded on every trajectory, so a
    model's form is kept by identity) or, MAP_ENCODED, its map form."""
    typecode = _TYPECODE_BYTES.get(type(obj))
    if typecode is not None:  # a packed array (5 per trajectory)
        return msgspec.msgpack.Ext(ARRAY_EXT, typecode + obj.tobytes())
    if isinstance(obj, PackedArray):
        return msgspec.msgpack.Ext(ARRAY_EXT, obj.TYPECODE.encode() + obj.tobytes())
    found = _FORMS.get(id(obj))
    if found is not None and found[0] is obj:
        return found[1]
    form = nested_model_form(obj)
    if isinstance(obj, BaseModel):
        if len(_FORMS) >= _FORMS_SIZE:
            _FORMS.clear()
        _FORMS[id(obj)] = (obj, form)
    return form


def ext_hook(code: int, data: memoryview) -> Any:
    """msgspec's hook for ext blobs: an array ext becomes the packed array of its typecode (one copy out of the
    decode buffer, which msgspec reuses after the call); anything else is a ValidationError."""
    if code != ARRAY_EXT:
        raise msgspec.ValidationError(f"unknown msgpack extension {code}")
    found = _ARRAY_OF_BYTE.get(data[0]) if len(data) else None
    if found is None:
        raise msgspec.ValidationError(f"packed array with unknown typecode {chr(data[0]) if len(data) else ''!r}")
    cls, typecode = found
    out = _new_array(cls, typecode)  # not cls(): PackedArray.__new__ is a Python frame, 5 per trajectory
    try:
        out.frombytes(data[1:])
    except ValueError:
        raise msgspec.ValidationError(
            f"packed array of typecode {cls.TYPECODE!r} has {len(data) - 1} bytes, not a multiple of {out.itemsize}"
        ) from None
    return out


_ARRAY_OF_BYTE: dict[int, tuple[type[PackedArray], str]] = {ord(tc): (c, tc) for tc, c in PACKED_TYPES.items()}
_new_array = array.array.__new__
_size_encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
dec_hook = nested_model_from  # the only types msgspec does not know in a record are the nested pydantic models
