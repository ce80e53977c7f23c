"""The two bases every schema uses, and the packed arrays the log's events carry.

- `Model` (pydantic): what validation and good error messages are the point of: the run config (TOML), the weight
  manifest, the client API's and plug-ins' inputs. Immutable, strict about unknown fields.
- `Record` (msgspec.Struct): the log's events and what they nest (the trajectory, its version spans). Frozen,
  positional on the wire (`array_like`: an entry is an array of field values in declaration order, no key strings),
  not tracked by the cyclic collector (`gc=False`: a record holds scalars, strings, tuples and packed arrays, never a
  reference back to itself). msgspec validates a record where it is *decoded* (types and `Meta` bounds, one C pass);
  a rule that spans fields, or a value that must be converted where a record is built, is the record's
  `__post_init__`, which runs both when it is built and when it is decoded.

Packed arrays (`Int32Array`, `Float32Array`, `Int8Array`) are `array.array`s of one machine type: token ids,
positions, logprobs and masks live in memory as one buffer each (no Python object per token) and travel as one
msgpack ExtType blob each (`ARRAY_EXT`: the typecode byte, then the raw little-endian bytes). A record's
`__post_init__` turns whatever it was given (a list, a tuple, bytes, a numpy array, a torch tensor) into the packed
type with `packed(...)`, refusing a value the type cannot hold, naming the field.
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Self

import msgspec
from pydantic import BaseModel, ConfigDict

ARRAY_EXT = 1  # the msgpack ext code of a packed array


class Model(BaseModel):
    """Immutable, strict about unknown fields: a typo in a config names the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Record(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False, forbid_unknown_fields=True):
    """Base of the log's records (see the module docstring). Subclasses repeat `kw_only=True` (msgspec applies it per
    class), so required and defaulted fields can stand in the order the wire layout has them."""


class PackedArray(array.array):  # type: ignore[type-arg]
    """An `array.array` of the subclass's TYPECODE that compares equal to a list or tuple of the same values (so code
    and tests written against lists keep reading naturally); built from any sequence of numbers."""

    TYPECODE: ClassVar[str] = ""
    NAME: ClassVar[str] = ""
    __slots__ = ()

    def __new__(cls, values: Any = ()) -> Self:
        return super().__new__(cls, cls.TYPECODE, values)  # type: ignore[call-arg]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return array.array.__eq__(self, other)  # type: ignore[operator, no-any-return]

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"

    def __reduce__(self) -> Any:
        return (type(self), (self.tolist(),))


class Int32Array(PackedArray):
    """int32 values: token ids, positions."""

    TYPECODE = "i"
    NAME = "int32"
    __slots__ = ()


class Float32Array(PackedArray):
    """float32 values: logprobs."""

    TYPECODE = "f"
    NAME = "float32"
    __slots__ = ()


class Int8Array(PackedArray):
    """int8 values: loss masks."""

    TYPECODE = "b"
    NAME = "int8"
    __slots__ = ()


PACKED_TYPES: dict[str, type[PackedArray]] = {c.TYPECODE: c for c in (Int32Array, Float32Array, Int8Array)}


class PackedField:
    """The annotation marker of a packed-array field: what the wire layout reads its typecode from."""

    __slots__ = ("cls",)

    def __init__(self, cls: type[PackedArray]) -> None:
        self.cls = cls


# A packed field's annotation. To msgspec it is `Any`: the ext hook has built the array of the wire's typecode
# already, so no per-field hook runs on decode, and the record's `__post_init__` (`packed`) checks that it is of the
# field's own type (or converts what a caller built it from). To mypy it is a read-only sequence of numbers, what
# callers build a record from (a list, a packed array) and what readers index, slice and iterate.
if TYPE_CHECKING:
    from collections.abc import Sequence

    I32 = Sequence[int]
    F32 = Sequence[float]
    I8 = Sequence[int]
else:
    I32 = Annotated[Any, PackedField(Int32Array)]
    F32 = Annotated[Any, PackedField(Float32Array)]
    I8 = Annotated[Any, PackedField(Int8Array)]


def packed(cls: type[PackedArray], value: Any, field: str) -> PackedArray:
    """`value` as a `cls`: itself when it is one already (what the decoder builds), else converted in one C call where
    it can be (an array of the same typecode, bytes, a buffer), else value by value (lists, numpy arrays and tensors
    through `tolist()`). ValueError naming `field` for a value the type cannot hold."""
    if type(value) is cls:
        return value
    if isinstance(value, PackedArray):
        raise TypeError(f"{field}: a packed {value.NAME} array where {cls.NAME} belongs")
    if isinstance(value, array.array):
        if value.typecode == cls.TYPECODE:
            out = cls()
            out.frombytes(value.tobytes())
            return out
        value = value.tolist()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        out = cls()
        try:
            out.frombytes(bytes(value))
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None
        return out
    elif not isinstance(value, (list, tuple)) and hasattr(value, "tolist"):  # numpy arrays, torch tensors
        value = value.tolist()
    try:
        return cls(value)
    except OverflowError:
        i = next((i for i, v in enumerate(value) if not _fits(cls, v)), 0)
        raise ValueError(f"{field}: element {i} ({value[i]}) does not fit {cls.NAME}") from None
    except TypeError:
        pass
    for i, v in enumerate(value):  # integral floats in an integer array are taken as ints, anything else refused
        number = isinstance(v, (int, float)) if cls.TYPECODE == "f" else isinstance(v, float) and v.is_integer()
        if not (type(v) is int or number):
            raise ValueError(f"{field}: element {i} ({v!r}) is not a number of {cls.NAME}")
    return packed(cls, [int(v) for v in value], field)


def _fits(cls: type[PackedArray], v: Any) -> bool:
    try:
        cls([v])
    except (OverflowError, TypeError):
        return False
    return True
