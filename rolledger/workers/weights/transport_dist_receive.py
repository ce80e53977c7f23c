"""A rank's side of the dist transport: fetch a version's manifest from the trainer's weight server
(`read_manifest`), then the version itself into host memory, every tensor verified against that manifest
(`receive_verified`): a request on the server's store, a two-member group of its own, the buckets received
`SLOTS` at a time and hashed while the next ones move, or a delta against the weights this rank serves. A
communicator that moved nothing (`NoOpCommunicatorFake`, the `noop-transport` injection) is caught by the checksums;
a delta whose base was not what this rank claimed is fetched again in full (`DELTA_FALLBACKS`). The protocol is
transport_dist's, the sender transport_dist_server.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Protocol

import structlog
import torch
import torch.distributed as dist
import zstandard

from rolledger.schemas.weights import WeightManifest
from rolledger.workers.weights.staging_checksums import Hasher, new_hasher, raw_bytes
from rolledger.workers.weights.staging_format import StagingError, check_manifest, parse_manifest
from rolledger.workers.weights.staging_loader import BucketTiming, LoadTimings, VerifiedWeights, destination
from rolledger.workers.weights.transport_dist import (
    REQUESTS,
    SLOTS,
    Backend,
    DistAddress,
    Wait,
    Wire,
    as_timedelta,
    chunks,
    open_group,
    parse_uri,
    wire_device,
)
from rolledger.workers.weights.transport_dist_delta import DeltaBase, DeltaMismatch, apply_delta

log = structlog.get_logger("rolledger.transport")


class Communicator(Protocol):
    """What moves one bucket from the server: post the receive of exactly `len(buf)` bytes into `buf`; calling what
    `irecv` returns waits for them, or raises."""

    def irecv(self, buf: torch.Tensor, tag: int) -> Wait: ...


class GroupCommunicator:
    """The real one: a point-to-point receive from rank 0 of the session's group (gloo, or NCCL through a device
    bucket), with its deadline."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire

    def irecv(self, buf: torch.Tensor, tag: int) -> Wait:
        return self.wire.irecv(buf, tag)


class NoOpCommunicatorFake:
    """A communicator that disabled itself: every receive returns at once and moves nothing (what NCCL does with one
    rank or `VLLM_DISABLE_PYNCCL`). Stands in for that hazard in tests and the `noop-transport` injection; the
    checksums must catch it."""

    def __init__(self, wire: Wire | None = None) -> None:
        self.wire = wire

    def irecv(self, buf: torch.Tensor, tag: int) -> Wait:
        return lambda: None


CONNECT_TIMEOUT_S = 10.0


def _client(addr: DistAddress, timeout_s: float, version: int) -> dist.TCPStore:
    """A client of the server's store. It connects with a short deadline of its own, then takes the transfer's:
    c10d retries a refused connection until its timeout, so a server that is gone would otherwise hold the rank for
    the whole deadline instead of failing at once. (A bare TCP probe is no substitute: the store's server stalls
    on a connection that never says who it is.)"""
    try:
        store = dist.TCPStore(
            addr.host, addr.port, is_master=False, timeout=as_timedelta(min(CONNECT_TIMEOUT_S, timeout_s))
        )
    except (dist.DistError, RuntimeError) as e:
        raise StagingError(
            None, f"weight server {addr.host}:{addr.port} unreachable: {e}", kind="transport", version=version
        ) from e
    store.set_timeout(as_timedelta(timeout_s))
    return store


def read_manifest(
    uri: str, version: int, *, expected_digest: str | None = None, timeout_s: float | None = None
) -> WeightManifest:
    """The manifest the server at `uri` publishes for `version`, checked against the announced digest. `timeout_s`
    overrides the URI's deadline."""
    addr = parse_uri(uri, version)
    store = _client(addr, timeout_s or addr.timeout_s, version)
    key = f"manifest/{addr.dirname}"
    if not store.check([key]):
        raise StagingError(
            None, f"the weight server at {uri} has no manifest for it", kind="not_found", version=version
        )
    return parse_manifest(store.get(key), version, expected_digest=expected_digest, where=uri)


DELTA_FALLBACKS: list[str] = []  # deltas this process fetched again in full (their base was not what it claimed)
Receiver = type[GroupCommunicator | NoOpCommunicatorFake]


# Fault injection (kill-rank=R@receive): called with each bucket's tag once it is received, in whichever thread
# receives; the chaos harness's hook sets it in a rank process (it SIGKILLs the process). None: nothing is called.
on_bucket_received: Callable[[int], None] | None = None


def _received(tag: int) -> None:
    hook = on_bucket_received
    if hook is not None:
        hook(tag)


def receive_verified(
    uri: str,
    version: int,
    manifest: WeightManifest,
    *,
    corrupt: str | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    timeout_s: float | None = None,
    communicator: Receiver = GroupCommunicator,
    base: DeltaBase | None = None,
) -> VerifiedWeights:
    """Fetch `version` from the server at `uri` into host memory (fresh tensors, or `out`'s buffers) and verify every
    tensor against `manifest`; StagingError naming the tensor (checksum) or the transfer (kind "transport").

    `corrupt`: fault injection, as for staging_loader.read_verified (one byte of that tensor flips on arrival).
    `base`: the weights this rank serves; the server may send a delta against them (see the module docstring). A
    delta that does not give the manifest's bytes is fetched again in full, once.
    """
    check_manifest(manifest, version)
    timeout_s = timeout_s or parse_uri(uri, version).timeout_s  # each step's deadline: the URI's unless given
    if base is not None and base.fits(manifest):
        try:
            return _receive(uri, manifest, corrupt, out, timeout_s, communicator, base)
        except DeltaMismatch as e:
            log.warning("transport.delta_mismatch", version=version, tensor=e.tensor, base=base.version)
            DELTA_FALLBACKS.append(f"v{version} on base v{base.version}: {e.tensor}")
    return _receive(uri, manifest, corrupt, out, timeout_s, communicator, None)


def _receive(
    uri: str,
    manifest: WeightManifest,
    corrupt: str | None,
    out: Mapping[str, torch.Tensor] | None,
    timeout_s: float,
    communicator: Receiver,
    base: DeltaBase | None,
) -> VerifiedWeights:
    version = manifest.version
    addr = parse_uri(uri, version)
    t0 = time.perf_counter()
    store = _client(addr, timeout_s, version)
    session = uuid.uuid4().hex
    request = {
        "session": session,
        "dir": addr.dirname,
        "digest": manifest.digest,
        "base_version": base.version if base is not None else 0,
    }
    try:
        store.queue_push(REQUESTS, json.dumps(request))
        answer = json.loads(store.get(f"answer/{session}"))
    except (dist.DistError, RuntimeError) as e:
        raise StagingError(
            None, f"no answer from the weight server at {uri}: {e}", kind="transport", version=version
        ) from e
    if "error" in answer:
        raise StagingError(None, f"the weight server refused: {answer['error']}", kind="not_found", version=version)
    bucket_bytes = int(answer["bucket_bytes"])
    backend: Backend = "nccl" if answer.get("backend") == "nccl" else "gloo"
    dests = [destination(e, out) for e in manifest.tensors]
    hashers = [new_hasher(manifest.checksum_algo) for _ in dests]
    try:
        device = wire_device(backend)
        group = open_group(dist.PrefixStore(f"session/{session}/", store), 1, addr.host, timeout_s, backend)
    except (dist.DistError, RuntimeError, ValueError) as e:
        raise StagingError(
            None, f"could not join the {backend} transfer from {uri}: {e}", kind="transport", version=version
        ) from e
    wire = Wire(group, device, min(bucket_bytes, max(manifest.total_bytes, 1)), timeout_s)
    comm = communicator(wire)
    t1 = time.perf_counter()
    flip = _flip_of(manifest, corrupt)
    try:
        if answer.get("mode") == "delta" and base is not None:
            sizes = [int(n) for n in answer["sizes"]]
            read_s, checksum_s = _receive_delta(comm, uri, manifest, sizes, bucket_bytes, base, dests, hashers, flip)
            buckets: list[BucketTiming] = []
        else:
            read_s, checksum_s, buckets = _receive_full(comm, uri, manifest, bucket_bytes, dests, hashers, flip)
        delta = answer.get("mode") == "delta"
        tensors: dict[str, torch.Tensor] = {}
        for entry, dest, hasher in zip(manifest.tensors, dests, hashers, strict=True):
            got = hasher.hexdigest()
            if got != entry.checksum:
                raise (DeltaMismatch if delta else StagingError)(
                    entry.name,
                    f"checksum mismatch after the {'delta ' if delta else ''}transfer from {uri}: "
                    f"{manifest.checksum_algo} of the bytes is {got}, manifest says {entry.checksum}",
                    kind="checksum",
                    version=version,
                )
            tensors[entry.name] = dest
    except BaseException:
        # the sender may still be waiting on a bucket this side will never take: closing the group's connections
        # (it goes with its last reference) fails that wait now instead of at its deadline
        wire.close()
        del group
        raise
    finally:
        with contextlib.suppress(Exception):
            store.delete_key(f"answer/{session}")
    t2 = time.perf_counter()
    timings = LoadTimings(
        header_s=t1 - t0,
        read_s=read_s,
        checksum_s=checksum_s,
        total_s=t2 - t0,
        nbytes=manifest.total_bytes,
        buckets=tuple(buckets),
    )
    return VerifiedWeights(tensors=tensors, manifest=manifest, timings=timings)


def _flip_of(manifest: WeightManifest, corrupt: str | None) -> dict[int, int]:
    """Fault injection: tensor index -> the byte of it that flips on arrival."""
    return {manifest.names.index(corrupt): manifest.entry(corrupt).nbytes // 2} if corrupt is not None else {}


def _failed(e: Exception, uri: str, manifest: WeightManifest, index: int, tag: int) -> StagingError:
    name = manifest.tensors[index].name
    return StagingError(
        name, f"transfer from {uri} failed in bucket {tag}: {e}", kind="transport", version=manifest.version
    )


def _receive_full(
    comm: Communicator,
    uri: str,
    manifest: WeightManifest,
    bucket_bytes: int,
    dests: list[torch.Tensor],
    hashers: list[Hasher],
    flip: dict[int, int],
) -> tuple[float, float, list[BucketTiming]]:
    """Receive the tensors' bytes bucket by bucket into `dests` and hash each piece, pipelined: `SLOTS` receives are
    posted at once, and bucket i+SLOTS is posted as soon as bucket i is out of its slot, so the wire moves while
    bucket i is hashed. A bucket that is one piece of one tensor is received straight into it (no copy). Returns the
    seconds spent waiting for and copying bytes, hashing, and per bucket."""
    views = [raw_bytes(d) for d in dests]
    flat = [d.reshape(-1).view(torch.uint8) for d in dests]
    plan = list(chunks([e.nbytes for e in manifest.tensors], bucket_bytes))
    slots = [torch.empty(min(bucket_bytes, max(manifest.total_bytes, 1)), dtype=torch.uint8) for _ in range(SLOTS)]
    srcs = [raw_bytes(b) for b in slots]

    def post(tag: int) -> tuple[Wait, bool]:
        pieces = plan[tag]
        if len(pieces) == 1 and pieces[0][0] not in flip:
            i, lo, length = pieces[0]
            return comm.irecv(flat[i][lo : lo + length], tag), True
        return comm.irecv(slots[tag % SLOTS][: sum(p[2] for p in pieces)], tag), False

    def failed(e: Exception, tag: int) -> StagingError:
        return _failed(e, uri, manifest, plan[tag][0][0], tag)

    pending: collections.deque[tuple[Wait, bool]] = collections.deque()
    timings: list[BucketTiming] = []
    for tag in range(min(SLOTS, len(plan))):
        try:
            pending.append(post(tag))
        except (dist.DistError, RuntimeError) as e:
            raise failed(e, tag) from e
    for tag, pieces in enumerate(plan):
        wait, direct = pending.popleft()
        ta = time.perf_counter()
        try:
            wait()
        except (dist.DistError, RuntimeError) as e:
            raise failed(e, tag) from e
        tb = time.perf_counter()
        _received(tag)
        if not direct:
            src, at = srcs[tag % SLOTS], 0
            for i, lo, length in pieces:
                views[i][lo : lo + length] = src[at : at + length]
                if i in flip and lo <= flip[i] < lo + length:
                    views[i][flip[i]] ^= 0xFF
                at += length
        tc = tb if direct else time.perf_counter()
        if tag + SLOTS < len(plan):  # its slot is free: the next bucket for it moves while this one is hashed
            try:
                pending.append(post(tag + SLOTS))
            except (dist.DistError, RuntimeError) as e:
                raise failed(e, tag + SLOTS) from e
        for i, lo, length in pieces:
            hashers[i].update(views[i][lo : lo + length])
        td = time.perf_counter()
        timings.append(BucketTiming(sum(p[2] for p in pieces), tb - ta, tc - tb, td - tc, direct))
    read_s = sum(t.wait_s + t.copy_s for t in timings)
    return read_s, sum(t.hash_s for t in timings), timings


def _receive_delta(
    comm: Communicator,
    uri: str,
    manifest: WeightManifest,
    sizes: list[int],
    bucket_bytes: int,
    base: DeltaBase,
    dests: list[torch.Tensor],
    hashers: list[Hasher],
    flip: dict[int, int],
) -> tuple[float, float]:
    """Receive every tensor's compressed XOR against the base, apply it to the base into `dests` and hash the result;
    returns the seconds spent receiving and applying, and hashing."""
    if len(sizes) != len(manifest.tensors):
        raise StagingError(
            None,
            f"a delta of {len(sizes)} tensors for a manifest of {len(manifest.tensors)}",
            kind="transport",
            version=manifest.version,
        )
    ta = time.perf_counter()
    blob = torch.empty(max(sum(sizes), 1), dtype=torch.uint8)
    at = 0
    for tag, pieces in enumerate(chunks(sizes, bucket_bytes)):
        n = sum(p[2] for p in pieces)
        try:
            comm.irecv(blob[at : at + n], tag)()
        except (dist.DistError, RuntimeError) as e:
            raise _failed(e, uri, manifest, pieces[0][0], tag) from e
        _received(tag)
        at += n
    packed = raw_bytes(blob)
    dctx = zstandard.ZstdDecompressor()
    checksum_s = 0.0
    at = 0
    for i, (entry, size) in enumerate(zip(manifest.tensors, sizes, strict=True)):
        frame, at = packed[at : at + size], at + size
        want = apply_delta(dctx, frame, entry, base.tensors[entry.name], dests[i], manifest.version)
        if i in flip:
            want[flip[i]] ^= 0xFF
        tb = time.perf_counter()
        hashers[i].update(raw_bytes(dests[i]))
        checksum_s += time.perf_counter() - tb
    return time.perf_counter() - ta - checksum_s, checksum_s
