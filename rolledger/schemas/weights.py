"""The weight manifest: what a staged update contains, tensor by tensor, and the digests that identify it.

A `WeightManifest` is written next to the staged safetensors file (workers/weights/staging_store.py) and its `digest` travels in
UpdateStaged / RankPrepared, so every rank proves it prepared exactly the manifest the trainer staged. Its
`weights_digest` is the digest a rank reports after committing (workers.weights.tensors.state_digest of the live weights).
`digest_entries` (the digest over tensor entries) is defined here, torch-free, so schemas never imports torch; the
torch side (checksumming live tensors) is workers/weights/tensors.py, which builds on it.
Invalid manifests raise a pydantic ValidationError naming the field (and the tensor, for tensor-level errors).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Literal

import xxhash
from pydantic import Field, field_validator, model_validator

from rolledger.schemas.base import Model

ChecksumAlgo = Literal["xxh3_128", "blake3"]
# The checksum of a tensor's bytes that state digests are built from (workers.weights.tensors.tensor_checksum).
CHECKSUM_ALGO: ChecksumAlgo = "xxh3_128"
DEFAULT_CHECKSUM_ALGO: ChecksumAlgo = CHECKSUM_ALGO


def digest_entries(entries: Iterable[tuple[str, str, tuple[int, ...], str]]) -> str:
    """Digest of (name, dtype, shape, checksum) entries, order-independent."""
    h = xxhash.xxh3_128()
    for name, dtype, shape, checksum in sorted(entries):
        h.update(f"{name}|{dtype}|{','.join(map(str, shape))}|{checksum}\n".encode())
    return h.hexdigest()


# Manifest dtype name (workers.weights.tensors.dtype_name) -> bytes per element. The dtypes safetensors can store.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# Hex digits in a checksum: xxh3-128 is 16 bytes, blake3's default output is 32 bytes.
CHECKSUM_HEX_LEN: dict[str, int] = {"xxh3_128": 32, "blake3": 64}

_HEX = re.compile(r"^[0-9a-f]+$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9._-]+\.safetensors$")


class TensorEntry(Model):
    """One tensor of a staged update: its name, layout and the checksum of its raw (little-endian, C-order) bytes."""

    name: str = Field(min_length=1)
    shape: tuple[int, ...]
    dtype: str
    nbytes: int = Field(ge=0)
    checksum: str

    @field_validator("shape")
    @classmethod
    def _dims_non_negative(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < 0 for d in v):
            raise ValueError(f"negative dimension in shape {v}")
        return v

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {v!r}; expected one of {sorted(DTYPE_SIZES)}")
        return v

    @field_validator("checksum")
    @classmethod
    def _hex_checksum(cls, v: str) -> str:
        if not _HEX.match(v):
            raise ValueError(f"checksum must be lowercase hex, got {v!r}")
        return v

    @model_validator(mode="after")
    def _nbytes_fit_shape(self) -> TensorEntry:
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if self.nbytes != expected:
            raise ValueError(
                f"tensor {self.name!r}: nbytes={self.nbytes} but shape {self.shape} of {self.dtype} holds {expected}"
            )
        return self

    def as_digest_entry(self) -> tuple[str, str, tuple[int, ...], str]:
        return (self.name, self.dtype, self.shape, self.checksum)


class WeightManifest(Model):
    """A staged weight update: version `version` replaces `base_version`, stored in `file` beside the manifest."""

    version: int = Field(ge=1)
    base_version: int = Field(ge=0)
    checksum_algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO
    tensors: tuple[TensorEntry, ...] = Field(min_length=1)
    total_bytes: int = Field(ge=0)
    file: str = "weights.safetensors"
    parent_digest: str | None = Field(
        None,
        description="weights_digest of the weights this version was trained from (its lineage): the trainer's last "
        "staged version, or the published one; None in manifests written before it was recorded",
    )

    @field_validator("file")
    @classmethod
    def _bare_file_name(cls, v: str) -> str:
        if not _FILE_NAME.match(v) or v.startswith("."):
            raise ValueError(f"file must be a bare '*.safetensors' name inside the version directory, got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> WeightManifest:
        if self.base_version >= self.version:
            raise ValueError(f"base_version={self.base_version} must be below version={self.version}")
        seen: set[str] = set()
        want_len = CHECKSUM_HEX_LEN[self.checksum_algo]
        for t in self.tensors:
            if t.name in seen:
                raise ValueError(f"tensors: duplicate tensor name {t.name!r}")
            seen.add(t.name)
            if len(t.checksum) != want_len:
                raise ValueError(
                    f"tensors: tensor {t.name!r} checksum has {len(t.checksum)} hex digits, "
                    f"{self.checksum_algo} gives {want_len}"
                )
        total = sum(t.nbytes for t in self.tensors)
        if self.total_bytes != total:
            raise ValueError(f"total_bytes={self.total_bytes} but the tensors add up to {total}")
        return self

    def entry(self, name: str) -> TensorEntry:
        """The entry for tensor `name`; KeyError naming it when absent."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"tensor {name!r} is not in the manifest of version {self.version}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def tensors_digest(self) -> str:
        """digest_entries over the tensors, with whatever checksum algorithm the manifest uses."""
        return digest_entries(t.as_digest_entry() for t in self.tensors)

    @property
    def weights_digest(self) -> str:
        """The digest ranks report after committing: equals workers.weights.tensors.state_digest of these tensors loaded.

        Only defined for xxh3_128 manifests, because state_digest is built from xxh3-128 checksums; a blake3
        manifest's tensor checksums cannot be turned into it without re-reading the bytes.
        """
        if self.checksum_algo != CHECKSUM_ALGO:
            raise ValueError(
                f"weights_digest needs {CHECKSUM_ALGO} checksums (state_digest uses them); this manifest uses "
                f"{self.checksum_algo}: compare ranks' state_digest with each other instead"
            )
        return self.tensors_digest

    @property
    def digest(self) -> str:
        """Stable identity of the manifest: version, base, algorithm, total bytes and every tensor entry.

        Independent of tensor order and of where the update is stored (`file`), so the same update staged in two
        places has the same digest, and any change to a tensor's name, dtype, shape or checksum changes it.
        """
        h = xxhash.xxh3_128()
        h.update(
            f"rolledger-manifest/1|v={self.version}|base={self.base_version}|algo={self.checksum_algo}"
            f"|bytes={self.total_bytes}|tensors={self.tensors_digest}".encode()
        )
        if self.parent_digest is not None:  # absent from older manifests, whose digests stay what they were
            h.update(f"|parent={self.parent_digest}".encode())
        return h.hexdigest()
