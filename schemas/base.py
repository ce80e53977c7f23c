"""The base model every schema uses, and the compact array types the codec packs as binary."""

from __future__ import annotations

import array
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler
from pydantic.fields import FieldInfo
from pydantic_core import core_schema


class Model(BaseModel):
    """Immutable, strict about unknown fields: a typo in a config or an event names the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class PackedArray:
    """A marker the msgpack codec turns into an ExtType holding the raw bytes of an array."""

    __slots__ = ("data", "typecode")

    def __init__(self, typecode: str, data: bytes) -> None:
        self.typecode = typecode
        self.data = data


class PackedArraySchema:
    """The pydantic schema of one compact array type: a list in memory, raw little-endian bytes on the wire.

    Accepted input, fastest first:
    - an `array.array` of exactly this typecode (what the codec's ext hook builds from the wire, or a caller's own):
      its values are machine values of the type already, so it becomes a list with one C call and no per-element
      validation;
    - bytes/bytearray/memoryview: read as this typecode (a length that is not a multiple of the item size is an error);
    - anything with `tolist()` (numpy arrays, torch tensors, other array typecodes), then validated as a list;
    - a list/tuple: validated element by element by pydantic (errors name the index), then against the type's range
      (an int32 field refuses 2**31 where it is built, not later at encode).
    Serialized as a plain list, or as a PackedArray (raw bytes) when the serialization context has `packed`.
    """

    __slots__ = ("bounds", "item_schema", "name", "typecode")

    def __init__(self, typecode: str, name: str, bounds: tuple[int, int] | None = None) -> None:
        self.typecode = typecode
        self.name = name
        self.item_schema = core_schema.float_schema() if typecode == "f" else core_schema.int_schema()
        self.bounds = bounds  # checked after pydantic's per-element check: min/max in C beat constrained ints 4x

    def __repr__(self) -> str:
        return f"PackedArraySchema({self.typecode!r}, {self.name!r})"

    def _validate(self, value: Any, handler: core_schema.ValidatorFunctionWrapHandler) -> Any:
        if type(value) is array.array and value.typecode == self.typecode:
            return value.tolist()
        if isinstance(value, (bytes, bytearray, memoryview)):
            return array.array(self.typecode, bytes(value) if isinstance(value, memoryview) else value).tolist()
        if type(value) is not list and hasattr(value, "tolist"):  # other array typecodes, numpy, torch tensors
            value = value.tolist()
        out = handler(value)
        if self.bounds is not None and out:
            lo, hi = self.bounds
            if min(out) < lo or max(out) > hi:
                i = next(i for i, x in enumerate(out) if not lo <= x <= hi)
                raise ValueError(f"element {i} ({out[i]}) does not fit {self.name} [{lo}, {hi}]")
        return out

    def _serialize(self, value: Any, info: core_schema.SerializationInfo) -> Any:
        if info.context and info.context.get("packed"):
            return PackedArray(self.typecode, array.array(self.typecode, value).tobytes())
        return list(value)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_wrap_validator_function(
            self._validate,
            core_schema.list_schema(self.item_schema),
            serialization=core_schema.plain_serializer_function_ser_schema(self._serialize, info_arg=True),
        )


# int32 token ids / positions; float32 logprobs; int8 masks. Python lists in memory, raw bytes on the wire.
I32Array = Annotated[list[int], PackedArraySchema("i", "int32", (-(2**31), 2**31 - 1))]
F32Array = Annotated[list[float], PackedArraySchema("f", "float32")]
I8Array = Annotated[list[int], PackedArraySchema("b", "int8", (-128, 127))]


def packed_typecode(info: FieldInfo) -> str | None:
    """The wire typecode of a packed-array field (its PackedArraySchema), None for any other field."""
    return next((m.typecode for m in info.metadata if isinstance(m, PackedArraySchema)), None)
