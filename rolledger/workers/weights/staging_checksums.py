"""Checksums of staged tensor bytes: xxh3-128 (the default) or blake3, over raw bytes or streamed chunk by chunk.

Owns the one definition a staged manifest's per-tensor `checksum` is computed with (workers.weights.staging_store, when a
version is staged) and checked against (workers.weights.staging_loader, while the bytes are copied in). For xxh3_128 it
equals workers.weights.tensors.tensor_checksum.
"""

from __future__ import annotations

from typing import Protocol

import blake3
import torch
import xxhash

from rolledger.schemas.weights import DEFAULT_CHECKSUM_ALGO, ChecksumAlgo


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (any dtype, any rank including 0-dim)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def checksum_bytes(data: memoryview | bytes, algo: ChecksumAlgo) -> str:
    """Hex checksum of raw bytes: xxh3-128 (32 hex digits) or blake3 (64 hex digits)."""
    if algo == "xxh3_128":
        return xxhash.xxh3_128_hexdigest(data)
    if algo == "blake3":
        return blake3.blake3(data).hexdigest()
    raise ValueError(f"unknown checksum_algo {algo!r}; expected 'xxh3_128' or 'blake3'")


class Hasher(Protocol):
    """A streaming hasher (xxhash.xxh3_128, blake3.blake3)."""

    def update(self, data: memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(algo: ChecksumAlgo) -> Hasher:
    """A streaming hasher whose hexdigest equals checksum_bytes(all the bytes fed, algo)."""
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    if algo == "blake3":
        return blake3.blake3()
    raise ValueError(f"unknown checksum_algo {algo!r}; expected 'xxh3_128' or 'blake3'")


def checksum(t: torch.Tensor, algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO) -> str:
    """Checksum of a tensor's C-order bytes; for xxh3_128 this equals workers.weights.tensors.tensor_checksum."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return checksum_bytes(raw_bytes(t.contiguous()), algo)
