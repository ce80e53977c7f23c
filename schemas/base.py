"""The base model every schema uses, and the compact array types the codec packs as binary."""

from __future__ import annotations

import array
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer, SerializationInfo


class Model(BaseModel):
    """Immutable, strict about unknown fields: a typo in a config or an event names the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class PackedArray:
    """A marker the msgpack codec turns into an ExtType holding the raw bytes of an array."""

    __slots__ = ("typecode", "data")

    def __init__(self, typecode: str, data: bytes) -> None:
        self.typecode = typecode
        self.data = data


def _to_list(typecode: str) -> Any:
    def convert(v: Any) -> Any:
        if isinstance(v, (bytes, bytearray, memoryview)):
            a = array.array(typecode)
            a.frombytes(bytes(v))
            return a.tolist()
        if isinstance(v, array.array):
            return v.tolist()
        if hasattr(v, "tolist"):  # numpy arrays, torch tensors
            return v.tolist()
        return v

    return convert


def _packer(typecode: str) -> Any:
    def pack(v: list[Any], info: SerializationInfo) -> Any:
        if info.context and info.context.get("packed"):
            return PackedArray(typecode, array.array(typecode, v).tobytes())
        return list(v)

    return pack


# int32 token ids / positions; float32 logprobs; int8 masks. Python lists in memory, raw bytes on the wire.
I32Array = Annotated[list[int], BeforeValidator(_to_list("i")), PlainSerializer(_packer("i"))]
F32Array = Annotated[list[float], BeforeValidator(_to_list("f")), PlainSerializer(_packer("f"))]
I8Array = Annotated[list[int], BeforeValidator(_to_list("b")), PlainSerializer(_packer("b"))]
