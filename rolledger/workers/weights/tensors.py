"""Checksums and digests of live weight tensors (torch): one definition shared by trainer, staging, ranks and engines.

A tensor's checksum is xxh3-128 over its raw bytes (dtype and shape are checked separately, from the manifest).
A state digest is xxh3-128 over the sorted (name, dtype, shape, checksum) lines: two models have the same digest
exactly when every tensor has the same name, dtype, shape and bytes. The torch-free half (CHECKSUM_ALGO,
digest_entries over manifest entries) is rolledger.schemas.weights; this module adds what needs the tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash

from rolledger.schemas.weights import digest_entries


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor in C order, without copying when it is already contiguous on the CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)  # 1-D first: a 0-dim tensor cannot be viewed as another element size
    # view as uint8 so bf16 (which numpy cannot hold) works too
    return t.view(torch.uint8).numpy().data


def tensor_checksum(t: torch.Tensor) -> str:
    """xxh3-128 hex digest of a tensor's bytes."""
    return xxhash.xxh3_128_hexdigest(tensor_bytes(t))


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the name used in manifests."""
    return str(dtype).removeprefix("torch.")


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """Digest of a whole state dict (live weights or a staged buffer)."""
    return digest_entries(
        (name, dtype_name(t.dtype), tuple(t.shape), tensor_checksum(t)) for name, t in tensors.items()
    )
