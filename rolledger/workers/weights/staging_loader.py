"""The verified loader: read a staged version into private host memory, every byte checked against the manifest.

`load_verified()` copies a staged file into private host memory (fresh tensors, or the rank's reusable buffers via
`out=`), so the verified bytes cannot change under the rank afterwards, and checks every tensor's presence, dtype,
shape, extent in the file and checksum against the manifest the coordinator announced. The copy goes through a
read-only mapping in 1 MiB chunks, each hashed while still in cache: verification costs about one extra pass over
cached data rather than a second trip through memory. Any problem raises `StagingError` naming the tensor and a short
`kind` a RankPrepareFailed event can carry. `DirectoryStagingStore.load_verified` (workers.weights.staging_store) reads
through `read_verified` here.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rolledger.schemas.weights import DTYPE_SIZES, TensorEntry, WeightManifest
from rolledger.workers.weights.staging_checksums import new_hasher, raw_bytes
from rolledger.workers.weights.staging_format import (
    StagingError,
    check_against_manifest,
    check_manifest,
    open_weights,
    read_header,
    version_path,
)
from rolledger.workers.weights.tensors import dtype_name

READ_CHUNK_BYTES = 1 << 20  # copy-then-hash granularity: small enough to stay in L2, large enough to amortise calls
_TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}


@dataclass(frozen=True)
class BucketTiming:
    """One bucket of a transfer on the receiving side: seconds blocked waiting for its bytes (the wire, less what
    overlapped the previous bucket's copy and hashing), copying them out of the bucket into their tensors (0 when
    they were received in place: `in_place`), and hashing them."""

    nbytes: int
    wait_s: float
    copy_s: float
    hash_s: float
    in_place: bool = False


@dataclass(frozen=True)
class LoadTimings:
    header_s: float  # header parsed and checked against the manifest (names, dtypes, shapes, extents)
    read_s: float  # bytes read into host memory
    checksum_s: float
    total_s: float
    nbytes: int
    buckets: tuple[BucketTiming, ...] = ()  # the dist transport's, per bucket (empty for a file)

    @property
    def read_gbps(self) -> float:
        return self.nbytes / self.read_s / 1e9 if self.read_s > 0 else float("inf")

    @property
    def checksum_gbps(self) -> float:
        return self.nbytes / self.checksum_s / 1e9 if self.checksum_s > 0 else float("inf")


@dataclass(frozen=True, eq=False)
class VerifiedWeights(Mapping[str, torch.Tensor]):
    """Tensors read into host memory whose every byte matched the manifest; a read-only name -> tensor mapping."""

    tensors: dict[str, torch.Tensor]
    manifest: WeightManifest
    timings: LoadTimings
    manifest_digest: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "manifest_digest", self.manifest.digest)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def read_verified(
    directory: Path,
    version: int,
    manifest: WeightManifest,
    *,
    corrupt: str | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> VerifiedWeights:
    """Read the tensors staged as `version` in `directory` into host memory and verify each against `manifest`, or
    raise StagingError.

    `out`: preallocated CPU buffers (name -> contiguous tensor of the manifest's shape and dtype) to read into
    instead of allocating; a rank reusing its staging buffer skips first-touch page faults.
    `corrupt`: fault injection: flip one byte of that tensor after reading, as a bad transfer would, so the
    checksum check must catch it.
    """
    check_manifest(manifest, version)
    if corrupt is not None:
        entry = manifest.entry(corrupt)
        if entry.nbytes == 0:
            raise ValueError(f"cannot corrupt tensor {corrupt!r}: it has no bytes")
    t0 = time.perf_counter()
    tensors: dict[str, torch.Tensor] = {}
    read_s = checksum_s = 0.0
    fd = open_weights(directory / manifest.file, version)
    try:
        entries, size = read_header(fd, version)
        pairs = check_against_manifest(entries, size, manifest)
        t1 = time.perf_counter()
        # Every extent was checked against the file size above, so the mapping covers every byte read. The file
        # is immutable once staged; one truncated *during* this read would kill the process (SIGBUS), which the
        # update coordinator sees as a rank missing its prepare deadline: the update still aborts.
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm, memoryview(mm) as src:
            for h, want in pairs:
                dest = destination(want, out)
                buf = raw_bytes(dest)
                flip_at = len(buf) // 2 if corrupt == h.name else -1
                hasher = new_hasher(manifest.checksum_algo)
                # copy and hash chunk by chunk, so each chunk is hashed while it is still in the CPU cache
                for lo in range(0, len(buf), READ_CHUNK_BYTES):
                    chunk = buf[lo : lo + READ_CHUNK_BYTES]
                    ta = time.perf_counter()
                    chunk[:] = src[h.start + lo : h.start + lo + len(chunk)]
                    if lo <= flip_at < lo + len(chunk):
                        chunk[flip_at - lo] ^= 0xFF
                    tb = time.perf_counter()
                    hasher.update(chunk)
                    checksum_s += time.perf_counter() - tb
                    read_s += tb - ta
                got = hasher.hexdigest()
                if got != want.checksum:
                    raise StagingError(
                        h.name,
                        f"checksum mismatch: {manifest.checksum_algo} of the bytes is {got}, manifest says "
                        f"{want.checksum}",
                        kind="checksum",
                        version=version,
                    )
                tensors[h.name] = dest
    finally:
        os.close(fd)
    # manifest order, so iteration matches what the trainer staged
    ordered = {name: tensors[name] for name in manifest.names}
    t2 = time.perf_counter()
    timings = LoadTimings(
        header_s=t1 - t0, read_s=read_s, checksum_s=checksum_s, total_s=t2 - t0, nbytes=manifest.total_bytes
    )
    return VerifiedWeights(tensors=ordered, manifest=manifest, timings=timings)


def load_verified(
    uri: str,
    version: int,
    manifest: WeightManifest,
    *,
    corrupt: str | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> VerifiedWeights:
    """Read and verify `version` at its URI against `manifest` (which must be for that version); see read_verified."""
    return read_verified(version_path(uri, version), version, manifest, corrupt=corrupt, out=out)


def destination(want: TensorEntry, out: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
    dtype = _TORCH_DTYPES[want.dtype]
    if out is None:
        return torch.empty(want.shape, dtype=dtype)
    if want.name not in out:
        raise ValueError(f"out has no buffer for tensor {want.name!r}")
    dest = out[want.name]
    if dest.device.type != "cpu" or not dest.is_contiguous() or dest.dtype != dtype or tuple(dest.shape) != want.shape:
        raise ValueError(
            f"out[{want.name!r}] must be a contiguous CPU {want.dtype} tensor of shape {want.shape}, got "
            f"{dtype_name(dest.dtype)} {tuple(dest.shape)} on {dest.device}"
        )
    return dest
