"""The dist transport's deltas, the one encoding its two sides must agree on: a version sent as the XOR of each
tensor's bytes with those of a version the rank already serves, one zstandard frame per tensor (mostly zero bytes:
the sign, exponent and high mantissa bits an optimizer step leaves alone). A rank names its base (`DeltaBase`); the
server encodes against its own copy of that version (`encode_delta`, recorded as `DeltaStats`); the rank applies what
arrives to its base (`apply_delta`) and checks the result against the *full* tensor's checksum, so a base that is
not what the rank claims (a stale rank, say) cannot pass: a `DeltaMismatch`, and the rank fetches the full version
instead (transport_dist_receive).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from rolledger.schemas.weights import TensorEntry, WeightManifest
from rolledger.workers.weights.staging_checksums import raw_bytes
from rolledger.workers.weights.staging_format import StagingError


@dataclass(frozen=True)
class DeltaBase:
    """The weights a rank serves, offered as the base of a delta: their version and the tensors (CPU)."""

    version: int
    tensors: Mapping[str, torch.Tensor]

    def fits(self, manifest: WeightManifest) -> bool:
        """Whether every tensor of `manifest` has a CPU base of its name, shape and size here."""
        if not 1 <= self.version < manifest.version:
            return False
        for e in manifest.tensors:
            t = self.tensors.get(e.name)
            if t is None or t.device.type != "cpu" or tuple(t.shape) != e.shape:
                return False
            if t.element_size() * t.numel() != e.nbytes:
                return False
        return True


class DeltaMismatch(StagingError):
    """Applied to the rank's base, a delta did not give the manifest's bytes: the base was not what it claimed."""


@dataclass(frozen=True)
class DeltaStats:
    """One delta the server encoded: its size against the full version's, and what encoding it took."""

    version: int
    base_version: int
    full_bytes: int
    delta_bytes: int
    encode_s: float

    @property
    def fraction(self) -> float:
        return self.delta_bytes / self.full_bytes if self.full_bytes else 0.0


def encode_delta(
    entries: Sequence[TensorEntry], views: Sequence[memoryview], base_views: Sequence[memoryview], level: int
) -> list[bytes]:
    """Every tensor's XOR with its base's bytes, one zstd frame each at `level` (b"" for an empty tensor)."""
    cctx = zstandard.ZstdCompressor(level=level)
    frames: list[bytes] = []
    for e, new_bytes, old_bytes in zip(entries, views, base_views, strict=True):
        new = np.frombuffer(new_bytes, dtype=np.uint8, count=e.nbytes)
        old = np.frombuffer(old_bytes, dtype=np.uint8, count=e.nbytes)
        frames.append(cctx.compress(np.bitwise_xor(new, old).data) if e.nbytes else b"")
        del new, old
    return frames


def apply_delta(
    dctx: zstandard.ZstdDecompressor,
    frame: memoryview,
    entry: TensorEntry,
    base: torch.Tensor,
    dest: torch.Tensor,
    version: int,
) -> np.ndarray:
    """Decode one tensor's frame and XOR it with `base` into `dest`; returns `dest`'s bytes. DeltaMismatch when the
    frame does not decode to the tensor's size."""
    try:
        xor = dctx.decompress(frame, max_output_size=entry.nbytes) if entry.nbytes else b""
    except zstandard.ZstdError as e:
        raise DeltaMismatch(entry.name, f"undecodable delta: {e}", kind="checksum", version=version) from e
    if len(xor) != entry.nbytes:
        raise DeltaMismatch(
            entry.name,
            f"the delta holds {len(xor)} bytes, not {entry.nbytes}",
            kind="checksum",
            version=version,
        )
    have = np.frombuffer(raw_bytes(base.detach().contiguous()), dtype=np.uint8)
    want = np.frombuffer(raw_bytes(dest), dtype=np.uint8)
    np.bitwise_xor(np.frombuffer(xor, dtype=np.uint8), have, out=want)
    return want
