"""The torch.distributed weight transport: the trainer serves staged versions over gloo (or NCCL: the same code,
with each bucket staged through a device buffer; `backend_for(device)` picks NCCL for CUDA weights), ranks receive
them into private memory and verify every byte against the manifest. The NCCL path is written against the same
interface; its device-bucket half runs on CPU in tests/test_transport_pipeline.py, a real NCCL transfer needs two
GPUs and was not run here (no GPU was lent).

No filesystem is shared. The trainer stages each version into its *own* directory (workers.weights.staging_store, the same
content-addressed, atomic layout; it is the trainer's durable copy and what a restarted trainer reloads) and a
`WeightServer` in the trainer process serves it:

- Rendezvous goes through the run's log: `UpdateStaged.uri` is `dist://HOST:PORT/v000007-<digest[:12]>`, the
  address of the server's `TCPStore` and the version directory. The host must be loopback or private unless the run
  opts in (workers.runtime.netguard, the guard the engines use).
- The manifest is published in that store under `manifest/<dir>`; a rank fetches it and checks it against the digest
  the coordinator announced before anything else (`read_manifest`).
- A rank asks for a version by pushing a request onto the store's `requests` queue; the server answers on
  `answer/<session>` and the two form a two-member gloo process group of their own under the prefix
  `session/<session>/`, through which the tensor bytes go, in manifest order, in buckets of `bucket_bytes`.
  One group per receiver and per transfer, rebuilt every time: a rank that joins late (a restarted rank reloading
  the published version) is served like the others, and a rank that dies mid-transfer only ends its own session.
- A transfer is a pipeline of `SLOTS` buckets in flight on each side: the server fills bucket i+1 while bucket i
  goes, and the receiver posts bucket i+SLOTS as soon as bucket i is out of its slot, so the wire moves while bucket
  i is copied and hashed. A bucket that is one piece of one tensor is sent straight from the snapshot and received
  straight into its destination (no copy either side). `SendStats` (server) and `LoadTimings.buckets` (receiver)
  time every part, per bucket (bench/bench_transport.py prints them).
- The durable copy and what recovery needs of it (decided by the server's record of the copy, never by timing): a
  version offered from memory is hashed, offered and sent at once while the trainer's durable copy is written
  beside the transfer; the ranks verify against the manifest from the wire, never against the file. The one thing
  held back is each transfer's *last* bucket, until the trainer reports its copy complete and renamed into place
  (`WeightServer.persisted`); a copy that failed fails every transfer of it. So no rank can verify, prepare or
  commit a version, and none can be published, that a restarted trainer could not restore from its own directory;
  a trainer killed mid-copy leaves a version nobody prepared, and resumes from the published one
  (workers.roles.trainer_client.restore). Everything else of the copy overlaps the transfer.
- The receiver copies each bucket into its destination tensors and hashes them while the bytes are in cache
  (workers.weights.staging_loader does the same for files); a tensor whose bytes do not match its manifest checksum is a
  `StagingError` naming it. So a communicator that silently did nothing (NCCL disabled, one rank: every collective a
  no-op), sent to the wrong buffer or stopped short is caught before the rank reports prepared, and the all-prepared
  gate aborts the update on every rank. `NoOpCommunicatorFake` is such a communicator, for the tests and the
  `noop-transport=R` injection.
- Deltas: a rank says which version it serves (`DeltaBase`); when the server holds that version too, it sends each
  tensor as the XOR of the new bytes with the base's, compressed with zstandard (mostly zero bytes: the sign,
  exponent and high mantissa bits an optimizer step leaves alone). The rank XORs what arrives with the weights it
  serves and checks the result against the *full* tensor's checksum, so a base that is not what the rank claims
  (a stale rank, say) cannot pass: the rank fetches the full version instead (`DELTA_FALLBACKS` counts it).
- Every step has a deadline (`timeout_s`: store operations, joining the group, each bucket); a transfer past it is
  a `StagingError(kind="transport")`, which a rank reports as a failed transfer.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, Self, cast
from urllib.parse import urlsplit

import numpy as np
import structlog
import torch
import torch.distributed as dist
import zstandard

from rolledger.schemas.weights import WeightManifest
from rolledger.workers.runtime.netguard import EngineAddressError, check_host
from rolledger.workers.weights.staging_checksums import Hasher, new_hasher, raw_bytes
from rolledger.workers.weights.staging_format import (
    MANIFEST_FILE,
    VERSION_DIR,
    StagingError,
    check_against_manifest,
    check_manifest,
    open_weights,
    parse_manifest,
    read_header,
)
from rolledger.workers.weights.staging_loader import BucketTiming, LoadTimings, VerifiedWeights, destination

log = structlog.get_logger("rolledger.transport")

SCHEME = "dist"
DEFAULT_BUCKET_BYTES = 64 << 20
_REQUESTS = "requests"
_STOP = b"stop"


def dist_uri(host: str, port: int, dirname: str, timeout_s: float | None = None) -> str:
    """The URI UpdateStaged carries for a version served at host:port (`dirname`: its directory's name). `timeout_s`:
    the deadline of each step of a transfer, which the receiver takes from the URI (the command carries it)."""
    h = f"[{host}]" if ":" in host else host
    query = f"?timeout={timeout_s:g}" if timeout_s is not None else ""
    return f"{SCHEME}://{h}:{port}/{dirname}{query}"


DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DistAddress:
    host: str
    port: int
    dirname: str
    timeout_s: float = DEFAULT_TIMEOUT_S  # the URI's, else the default


def parse_uri(uri: str, version: int) -> DistAddress:
    """host, port and version directory of a `dist://` URI, checked to name `version`; StagingError otherwise."""
    parts = urlsplit(uri)
    dirname = parts.path.lstrip("/")
    m = VERSION_DIR.match(dirname)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != SCHEME or not parts.hostname or not port or m is None or int(m.group(1)) != version:
        raise StagingError(
            None, f"{uri!r} is not a dist:// URI of version {version}", kind="not_found", version=version
        )
    timeout_s = DEFAULT_TIMEOUT_S
    for key, _, value in (kv.partition("=") for kv in parts.query.split("&") if kv):
        if key == "timeout":
            try:
                timeout_s = float(value)
            except ValueError:
                timeout_s = -1.0
            if not 0 < timeout_s < 86400:
                raise StagingError(None, f"{uri!r}: bad timeout {value!r}", kind="not_found", version=version)
    return DistAddress(parts.hostname, port, dirname, timeout_s)


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


CONNECT_TIMEOUT_S = 10.0


def _client(addr: DistAddress, timeout_s: float, version: int) -> dist.TCPStore:
    """A client of the server's store. It connects with a short deadline of its own, then takes the transfer's:
    c10d retries a refused connection until its timeout, so a server that is gone would otherwise hold the rank for
    the whole deadline instead of failing at once. (A bare TCP probe is no substitute: the store's server stalls
    on a connection that never says who it is.)"""
    try:
        store = dist.TCPStore(
            addr.host, addr.port, is_master=False, timeout=_timeout(min(CONNECT_TIMEOUT_S, timeout_s))
        )
    except (dist.DistError, RuntimeError) as e:
        raise StagingError(
            None, f"weight server {addr.host}:{addr.port} unreachable: {e}", kind="transport", version=version
        ) from e
    store.set_timeout(_timeout(timeout_s))
    return store


class PointToPoint(Protocol):
    """What a transfer needs of a process group (gloo's backend object; NCCL's has the same calls)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...


Backend = Literal["gloo", "nccl"]
BACKENDS: tuple[Backend, ...] = ("gloo", "nccl")


def backend_for(device: torch.device | str) -> Backend:
    """The backend for weights that live on `device`: NCCL for CUDA (device buckets, GPU to GPU), gloo otherwise.
    The protocol is the same either way (manifest, buckets, checksums); `wire_device` refuses NCCL where it cannot
    run."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def wire_device(backend: Backend) -> torch.device | None:
    """Where a bucket must sit to go over `backend`: None for gloo (host memory), the current CUDA device for NCCL;
    ValueError when NCCL is asked for and this process cannot use it."""
    if backend == "gloo":
        return None
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError(
            "the nccl weight transport needs a CUDA device and a torch built with NCCL; this process has "
            f"{'no CUDA device' if not torch.cuda.is_available() else 'no NCCL'} (use transport_backend = 'gloo')"
        )
    return torch.device("cuda", torch.cuda.current_device())


def _group(store: dist.Store, rank: int, host: str, timeout_s: float, backend: Backend = "gloo") -> PointToPoint:
    """A two-member group (rank 0 sends, rank 1 receives) over `store`; joining waits at most `timeout_s`.

    gloo is what runs here (CPU, tested); NCCL takes the same calls on device buffers (written against the same
    interface, untested where no GPU is lent: see the README's transport section)."""
    if backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = _timeout(timeout_s)
        return cast("PointToPoint", dist.ProcessGroupNCCL(store, rank, 2, nccl_opts))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the documented way to pick the device
    opts._timeout = _timeout(timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return cast("PointToPoint", dist.ProcessGroupGloo(store, rank, 2, opts))


Wait = Callable[[], None]  # completes one posted send or receive (raises past its deadline)
SLOTS = 2  # buckets in flight per transfer: bucket i+1 moves while bucket i is filled, or copied out and hashed


class _Wire:
    """The bucket as it goes over the group: host memory for gloo; for NCCL one of `SLOTS` device buckets the host
    bytes are copied into before a send and out of after a receive (the checksums are always taken on host bytes).
    Sends and receives are posted (`isend`, `irecv`) and completed later, so a transfer keeps `SLOTS` buckets in
    flight; a bucket's slot is `tag % SLOTS`, and a slot is reused only after the transfer two tags back completed
    (NCCL: the copy into or out of a device bucket is ordered after it on the current stream)."""

    def __init__(self, group: PointToPoint, device: torch.device | None, nbytes: int, timeout_s: float) -> None:
        self.group = group
        self.timeout = _timeout(timeout_s)
        self.device_buckets = (
            [] if device is None else [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(SLOTS)]
        )

    def isend(self, host: torch.Tensor, tag: int) -> Wait:
        wire = host
        if self.device_buckets:
            wire = self.device_buckets[tag % SLOTS][: host.numel()]
            wire.copy_(host)
        work = self.group.send([wire], 1, tag)
        return lambda: _done(work, self.timeout)

    def send(self, host: torch.Tensor, tag: int) -> None:
        self.isend(host, tag)()

    def irecv(self, host: torch.Tensor, tag: int) -> Wait:
        if not self.device_buckets:
            work = self.group.recv([host], 0, tag)
            return lambda: _done(work, self.timeout)
        wire = self.device_buckets[tag % SLOTS][: host.numel()]
        dev_work = self.group.recv([wire], 0, tag)

        def done() -> None:
            _done(dev_work, self.timeout)
            host.copy_(wire)  # device to pageable host memory: synchronous, after the receive on the stream

        return done

    def recv(self, host: torch.Tensor, tag: int) -> None:
        self.irecv(host, tag)()

    def close(self) -> None:
        """Drop this side's group: gloo closes its connections once the last reference goes, and a peer blocked on
        this side fails at once (`abort()` and `shutdown()` leave a gloo peer waiting out its deadline)."""
        del self.group
        self.device_buckets = []


def _done(work: dist.Work, timeout: datetime.timedelta) -> None:
    work.wait(timeout)


def _chunks(sizes: list[int], bucket_bytes: int) -> Iterator[list[tuple[int, int, int]]]:
    """The byte stream of tensors of `sizes` (concatenated in order) cut into buckets of at most `bucket_bytes`:
    per bucket, the (tensor index, start within the tensor, length) pieces it holds, in order."""
    bucket: list[tuple[int, int, int]] = []
    room = bucket_bytes
    for i, size in enumerate(sizes):
        at = 0
        while at < size:
            n = min(room, size - at)
            bucket.append((i, at, n))
            at += n
            room -= n
            if room == 0:
                yield bucket
                bucket, room = [], bucket_bytes
    if bucket:
        yield bucket


# ------------------------------------------------------------------------------------------------------ receiving


class Communicator(Protocol):
    """What moves one bucket from the server: post the receive of exactly `len(buf)` bytes into `buf`; calling what
    `irecv` returns waits for them, or raises."""

    def irecv(self, buf: torch.Tensor, tag: int) -> Wait: ...


class GroupCommunicator:
    """The real one: a point-to-point receive from rank 0 of the session's group (gloo, or NCCL through a device
    bucket), with its deadline."""

    def __init__(self, wire: _Wire) -> None:
        self.wire = wire

    def irecv(self, buf: torch.Tensor, tag: int) -> Wait:
        return self.wire.irecv(buf, tag)


class NoOpCommunicatorFake:
    """A communicator that disabled itself: every receive returns at once and moves nothing (what NCCL does with one
    rank or `VLLM_DISABLE_PYNCCL`). Stands in for that hazard in tests and the `noop-transport` injection; the
    checksums must catch it."""

    def __init__(self, wire: _Wire | None = None) -> None:
        self.wire = wire

    def irecv(self, buf: torch.Tensor, tag: int) -> Wait:
        return lambda: None


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
        store.queue_push(_REQUESTS, json.dumps(request))
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
        group = _group(dist.PrefixStore(f"session/{session}/", store), 1, addr.host, timeout_s, backend)
    except (dist.DistError, RuntimeError, ValueError) as e:
        raise StagingError(
            None, f"could not join the {backend} transfer from {uri}: {e}", kind="transport", version=version
        ) from e
    wire = _Wire(group, device, min(bucket_bytes, max(manifest.total_bytes, 1)), timeout_s)
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
    plan = list(_chunks([e.nbytes for e in manifest.tensors], bucket_bytes))
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
    for tag, pieces in enumerate(_chunks(sizes, bucket_bytes)):
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
        try:
            xor = dctx.decompress(frame, max_output_size=entry.nbytes) if entry.nbytes else b""
        except zstandard.ZstdError as e:
            raise DeltaMismatch(entry.name, f"undecodable delta: {e}", kind="checksum", version=manifest.version) from e
        if len(xor) != entry.nbytes:
            raise DeltaMismatch(
                entry.name,
                f"the delta holds {len(xor)} bytes, not {entry.nbytes}",
                kind="checksum",
                version=manifest.version,
            )
        have = np.frombuffer(raw_bytes(base.tensors[entry.name].detach().contiguous()), dtype=np.uint8)
        want = np.frombuffer(raw_bytes(dests[i]), dtype=np.uint8)
        np.bitwise_xor(np.frombuffer(xor, dtype=np.uint8), have, out=want)
        if i in flip:
            want[flip[i]] ^= 0xFF
        tb = time.perf_counter()
        hashers[i].update(raw_bytes(dests[i]))
        checksum_s += time.perf_counter() - tb
    return time.perf_counter() - ta - checksum_s, checksum_s


# ------------------------------------------------------------------------------------------------------- serving


def _release(views: list[memoryview]) -> None:
    for v in views:
        v.release()


IN_MEMORY = 2  # offered versions a server keeps in memory: the newest and the base of its delta
FREE_SNAPSHOTS = 1  # retired versions' memory kept for the next snapshot (peak: IN_MEMORY + this + the one training)


def _layout(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


@dataclass
class _Held:
    """A version served from memory: its manifest, its tensors and their bytes, whether its durable copy is written,
    how many transfers are reading it, and whether it has left the server (its memory is reused once none is)."""

    manifest: WeightManifest
    tensors: dict[str, torch.Tensor]
    views: list[memoryview]
    durable: threading.Event
    error: str | None = None
    readers: int = 0
    retired: bool = False


@dataclass(frozen=True)
class SendStats:
    """One transfer on the sending side: its buckets, the seconds spent filling them, blocked on the wire (a slot's
    previous bucket still going, and the last ones after the loop), holding the last bucket for the durable copy,
    and in all."""

    dirname: str
    buckets: int
    fill_s: float
    wait_s: float
    held_s: float
    total_s: float


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


class WeightServer:
    """Serves the versions staged under `root` (a DirectoryStagingStore's) to any rank that asks, from the trainer.

    `host:port` is where the TCPStore listens (port 0: a free one, see `.port`); `publish(dirname)` makes a staged
    version's manifest fetchable. `delta`: answer a rank that names the version it serves with a delta against it
    when that version is here too (`deltas` records each one's size and encode time). Each request is served on its own thread, from a copy-on-write mapping of the
    staged file; a receiver that fails or dies ends only its session (after `timeout_s` at most).
    """

    def __init__(
        self,
        root: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 30.0,
        allow_remote: bool = False,
        delta: bool = False,
        delta_level: int = 1,
        backend: Backend = "gloo",
    ) -> None:
        try:
            check_host(host, allow_remote)
        except EngineAddressError as e:
            raise ValueError(str(e)) from e
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend: Backend = backend
        self._device = wire_device(backend)  # refuses nccl where there is no CUDA, before anything listens
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.root = Path(root).absolute()
        self.host = host
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.delta = delta
        self.delta_level = delta_level
        self.deltas: list[DeltaStats] = []  # one per delta encoded
        self._delta_lock = threading.Lock()
        self._delta_cache: tuple[tuple[str, int], tuple[list[int], bytes]] | None = None
        self._held: dict[str, _Held] = {}  # versions offered from memory, oldest first
        self._free: list[dict[str, torch.Tensor]] = []  # memory of retired versions no transfer reads, for reuse
        self._file_readers: dict[str, int] = {}  # transfers reading a version's file, by directory
        self._held_lock = threading.Lock()  # guards _held, _free and _file_readers
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=_timeout(timeout_s))
        self.port: int = self._store.port
        # the accept loop blocks on the request queue: its own connection, with a deadline it never reaches
        self._accept_store = dist.TCPStore(host, self.port, is_master=False, timeout=datetime.timedelta(days=7))
        self._closed = threading.Event()
        self._senders: set[threading.Thread] = set()  # transfers running, each on its own thread
        self._senders_lock = threading.Lock()
        self.served: list[str] = []  # the directories sent, one entry per completed transfer
        self.failed: list[str] = []  # why a transfer failed, one entry per failed one
        self.transfers: collections.deque[SendStats] = collections.deque(maxlen=256)  # the last completed sends
        if self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                if VERSION_DIR.match(p.name) and (p / MANIFEST_FILE).is_file():
                    self.publish(p.name)
        self._thread = threading.Thread(target=self._accept, name=f"weight-server:{self.port}", daemon=True)
        self._thread.start()

    def uri(self, dirname: str) -> str:
        return dist_uri(self.host, self.port, dirname, self.timeout_s)

    def publish(self, dirname: str) -> str:
        """Make the version in `root/dirname` fetchable (its manifest goes into the store); returns its URI."""
        self._store.set(f"manifest/{dirname}", (self.root / dirname / MANIFEST_FILE).read_text())
        return self.uri(dirname)

    def withdraw(self, dirname: str) -> None:
        """Stop offering a version (it is being collected); a transfer already running finishes."""
        with contextlib.suppress(Exception):
            self._store.delete_key(f"manifest/{dirname}")

    def close(self) -> None:
        """Stop serving: no request is accepted any more, a transfer running stops at its next bucket, and every
        transfer thread has ended (or `timeout_s` passed) when this returns, so nothing of torch.distributed is still
        running on them when the process exits (a gloo group torn down by the interpreter's exit aborts it)."""
        if self._closed.is_set():
            return
        self._closed.set()
        deadline = time.monotonic() + self.timeout_s
        with self._held_lock:  # a transfer holding back its last bucket for a copy not yet written ends now
            for held in self._held.values():
                if not held.durable.is_set():
                    held.error = "the weight server closed first"
                    held.durable.set()
        with contextlib.suppress(Exception):
            self._store.queue_push(_REQUESTS, _STOP)
        self._thread.join(timeout=self.timeout_s)
        with self._senders_lock:
            senders = list(self._senders)
        for t in senders:
            t.join(timeout=max(deadline - time.monotonic(), 0.0))
        if alive := [t.name for t in senders if t.is_alive()]:
            log.warning("weight_server.transfers_still_running", threads=alive, timeout_s=self.timeout_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                raw = self._accept_store.queue_pop(_REQUESTS)
            except (dist.DistError, RuntimeError):
                if self._closed.is_set():
                    return
                continue
            if raw == _STOP:
                return
            try:
                request = json.loads(raw)
                session, dirname, digest = str(request["session"]), str(request["dir"]), str(request["digest"])
                base_version = int(request.get("base_version", 0))
            except (ValueError, KeyError, TypeError):
                log.warning("weight_server.bad_request", request=raw[:200])
                continue
            sender = threading.Thread(
                target=self._serve,
                args=(session, dirname, digest, base_version),
                name=f"weight-send:{session[:8]}",
                daemon=True,
            )
            with self._senders_lock:
                self._senders.add(sender)
            sender.start()

    def _serve(self, session: str, dirname: str, digest: str, base_version: int) -> None:
        """Send one version to one receiver; any failure ends this session only."""
        try:
            self._send(session, dirname, digest, base_version)
            self.served.append(dirname)
        except Exception as e:  # noqa: BLE001 - a receiver that fails or dies ends its own session, never the server
            self.failed.append(f"{dirname}: {e}")
            log.warning("weight_server.transfer_failed", dir=dirname, session=session, error=str(e)[:300])
        finally:
            with self._senders_lock:
                self._senders.discard(threading.current_thread())

    def offer(self, dirname: str, manifest: WeightManifest, tensors: Mapping[str, torch.Tensor]) -> str:
        """Serve a version from memory (`tensors`, prepared and checksummed into `manifest`, which the server keeps
        and nobody may change) while its durable copy under `root/dirname` is still being written: every transfer
        of it holds back its last bucket until `persisted(dirname)` says the copy is complete, so no rank can
        prepare, and no version be published, that the trainer could not restore after a crash. The last
        `IN_MEMORY` versions offered stay in memory (the next delta's base); older ones are served from disk."""
        views = [raw_bytes(tensors[e.name]) for e in manifest.tensors]
        with self._held_lock:
            self._held[dirname] = _Held(manifest, dict(tensors), views, threading.Event())
            for old in list(self._held)[:-IN_MEMORY]:
                self._retire(self._held.pop(old))
        self._store.set(f"manifest/{dirname}", manifest.model_dump_json(indent=1))
        return self.uri(dirname)

    def reusable(self, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Tensors of a version that left the server and that no transfer reads any more, with the names, shapes and
        dtypes of `like`, for the next snapshot to be copied into (None: allocate). Copying into memory already
        mapped costs a fraction of a fresh allocation's page faults (bench/bench_transport.py)."""
        key = _layout(like)
        with self._held_lock:
            for i, free in enumerate(self._free):
                if _layout(free) == key:
                    return self._free.pop(i)
        return None

    def _retire(self, held: _Held) -> None:
        """Called under `_held_lock` when a version leaves the server: its memory is free once no transfer reads it
        (at most `FREE_SNAPSHOTS` kept)."""
        held.retired = True
        if held.readers == 0 and len(self._free) < FREE_SNAPSHOTS:
            self._free.append(held.tensors)

    def _release(self, held: _Held) -> None:
        with self._held_lock:
            held.readers -= 1
            if held.retired and held.readers == 0 and len(self._free) < FREE_SNAPSHOTS:
                self._free.append(held.tensors)

    def _file_released(self, dirname: str) -> None:
        with self._held_lock:
            left = self._file_readers.pop(dirname) - 1
            if left:
                self._file_readers[dirname] = left

    def recycle(self, weights: Path, free: Path) -> bool:
        """Move a collected version's weights file to `free` (the store's free file, overwritten in place by its
        next write) unless a transfer reads it; a transfer asking for it afterwards finds no file and fails."""
        with self._held_lock:
            if self._file_readers.get(weights.parent.name):
                return False
            try:
                os.rename(weights, free)
            except FileNotFoundError:
                return False
            return True

    def persisted(self, dirname: str, error: str | None = None) -> None:
        """The durable copy of an offered version is complete (or failed: `error`, and its transfers fail)."""
        with self._held_lock:
            held = self._held.get(dirname)
        if held is not None:
            held.error = error
            held.durable.set()

    def drop(self, dirname: str) -> None:
        """Forget an offered version's memory and manifest (collected)."""
        with self._held_lock:
            held = self._held.pop(dirname, None)
            if held is not None:
                self._retire(held)
        self.withdraw(dirname)

    def _send(self, session: str, dirname: str, digest: str, base_version: int) -> None:
        client = dist.TCPStore(self.host, self.port, is_master=False, timeout=_timeout(self.timeout_s))
        with contextlib.ExitStack() as stack:
            try:
                manifest, views, held = self._source(dirname, digest, stack)
            except (OSError, ValueError, StagingError) as e:
                client.set(f"answer/{session}", json.dumps({"error": str(e)}))
                raise
            delta = self._delta(dirname, manifest, views, base_version) if self.delta else None
            if delta is None:
                answer: dict[str, object] = {"bucket_bytes": self.bucket_bytes, "mode": "full"}
                sizes, pieces_of = [e.nbytes for e in manifest.tensors], views
            else:
                sizes, blob = delta
                answer = {"bucket_bytes": self.bucket_bytes, "mode": "delta", "sizes": sizes}
                offsets = [sum(sizes[:i]) for i in range(len(sizes))]
                whole = memoryview(blob)
                pieces_of = [whole[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
            answer["backend"] = self.backend
            client.set(f"answer/{session}", json.dumps(answer))
            group = _group(dist.PrefixStore(f"session/{session}/", client), 0, self.host, self.timeout_s, self.backend)
            nbytes = min(self.bucket_bytes, max(sum(sizes), 1))
            wire = _Wire(group, self._device, nbytes, self.timeout_s)
            stats = self._send_buckets(wire, dirname, list(_chunks(sizes, self.bucket_bytes)), pieces_of, nbytes, held)
            self.transfers.append(stats)

    def _send_buckets(
        self,
        wire: _Wire,
        dirname: str,
        plan: list[list[tuple[int, int, int]]],
        pieces_of: list[memoryview],
        nbytes: int,
        held: _Held | None,
    ) -> SendStats:
        """Send the buckets of `plan`, `SLOTS` in flight: bucket i+1 is filled while bucket i goes. A bucket that is
        one piece of one tensor in writable memory (a snapshot) goes without a copy. The last one waits for the
        durable copy when the version is served from memory (`held`): see `offer`."""
        slots = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(SLOTS)]
        dsts = [raw_bytes(b) for b in slots]
        pending: collections.deque[Wait] = collections.deque()
        fill_s = wait_s = held_s = 0.0
        t0 = time.perf_counter()
        for tag, pieces in enumerate(plan):
            if self._closed.is_set():
                raise RuntimeError(f"the weight server closed while sending {dirname}")
            ta = time.perf_counter()
            if len(pending) == SLOTS:  # this slot's previous bucket must have gone
                pending.popleft()()
            tb = time.perf_counter()
            i, lo, length = pieces[0]
            if len(pieces) == 1 and not pieces_of[i].readonly:
                out = torch.frombuffer(pieces_of[i][lo : lo + length], dtype=torch.uint8)
            else:
                dst, at = dsts[tag % SLOTS], 0
                for i, lo, length in pieces:
                    dst[at : at + length] = pieces_of[i][lo : lo + length]
                    at += length
                out = slots[tag % SLOTS][:at]
            tc = time.perf_counter()
            if tag == len(plan) - 1 and held is not None:
                self._await_durable(dirname, held)
            td = time.perf_counter()
            pending.append(wire.isend(out, tag))
            wait_s, fill_s, held_s = wait_s + tb - ta, fill_s + tc - tb, held_s + td - tc
        tw = time.perf_counter()
        while pending:
            pending.popleft()()
        wait_s += time.perf_counter() - tw
        return SendStats(dirname, len(plan), fill_s, wait_s, held_s, time.perf_counter() - t0)

    def _await_durable(self, dirname: str, held: _Held) -> None:
        if not held.durable.wait(self.timeout_s):
            raise TimeoutError(f"the trainer's copy of {dirname} was not written within {self.timeout_s:g} s")
        if held.error is not None:
            raise OSError(f"the trainer's copy of {dirname} could not be written: {held.error}")

    def _source(
        self, dirname: str, digest: str | None, stack: contextlib.ExitStack
    ) -> tuple[WeightManifest, list[memoryview], _Held | None]:
        """A version's manifest and each tensor's bytes, in manifest order: from memory when it was offered (and its
        durable copy's record, to wait on), else mapped from its file (closed with `stack`)."""
        with self._held_lock:
            held = self._held.get(dirname)
            if held is not None:
                held.readers += 1
        if held is not None:
            stack.callback(self._release, held)
            if digest is not None and held.manifest.digest != digest:
                raise ValueError(f"{dirname} holds manifest {held.manifest.digest}, not {digest}")
            return held.manifest, held.views, held
        manifest, path = self._staged(dirname, digest)
        with self._held_lock:  # opened and counted at once: `recycle` never takes a file a transfer reads
            fd = open_weights(path, manifest.version)
            self._file_readers[dirname] = self._file_readers.get(dirname, 0) + 1
        stack.callback(self._file_released, dirname)
        stack.callback(os.close, fd)
        entries, size = read_header(fd, manifest.version)
        by_name = {h.name: h for h, _ in check_against_manifest(entries, size, manifest)}
        mm = stack.enter_context(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
        src = stack.enter_context(memoryview(mm))
        views = [src[by_name[e.name].start : by_name[e.name].start + e.nbytes] for e in manifest.tensors]
        stack.callback(_release, views)
        return manifest, views, None

    def _staged(self, dirname: str, digest: str | None) -> tuple[WeightManifest, Path]:
        """The manifest and weights file of a version directory here (checked against `digest` when given)."""
        directory = self.root / dirname
        if VERSION_DIR.match(dirname) is None or not (directory / MANIFEST_FILE).is_file():
            raise FileNotFoundError(f"no staged version {dirname!r} here")
        manifest = WeightManifest.model_validate_json((directory / MANIFEST_FILE).read_bytes())
        if digest is not None and manifest.digest != digest:
            raise ValueError(f"{dirname} holds manifest {manifest.digest}, not {digest}")
        return manifest, directory / manifest.file

    def _base_dirname(self, version: int) -> str | None:
        """The directory of `version` here: an offered one in memory first, else the newest on disk."""
        with self._held_lock:
            for dirname, held in reversed(self._held.items()):
                if held.manifest.version == version:
                    return dirname
        bases = sorted(
            (p for p in self.root.iterdir() if (m := VERSION_DIR.match(p.name)) and int(m.group(1)) == version),
            key=lambda p: p.stat().st_mtime_ns,
            reverse=True,
        )
        return bases[0].name if bases else None

    def _delta(
        self, dirname: str, manifest: WeightManifest, views: list[memoryview], base_version: int
    ) -> tuple[list[int], bytes] | None:
        """Every tensor's XOR with the base version's, zstd-compressed: (compressed sizes, the frames back to back);
        None when this server has no base of that version with the same tensors. Encoded once per (version, base)."""
        if not 1 <= base_version < manifest.version:
            return None
        with self._delta_lock:
            key = (dirname, base_version)
            if self._delta_cache is not None and self._delta_cache[0] == key:
                return self._delta_cache[1]
            base_dir = self._base_dirname(base_version)
            if base_dir is None:
                return None
            t0 = time.perf_counter()
            with contextlib.ExitStack() as stack:
                try:
                    base_manifest, base_views, _ = self._source(base_dir, None, stack)
                except (OSError, ValueError, StagingError):
                    return None
                if [(e.name, e.dtype, e.shape) for e in base_manifest.tensors] != [
                    (e.name, e.dtype, e.shape) for e in manifest.tensors
                ]:
                    return None
                cctx = zstandard.ZstdCompressor(level=self.delta_level)
                frames: list[bytes] = []
                for e, new_bytes, old_bytes in zip(manifest.tensors, views, base_views, strict=True):
                    new = np.frombuffer(new_bytes, dtype=np.uint8, count=e.nbytes)
                    old = np.frombuffer(old_bytes, dtype=np.uint8, count=e.nbytes)
                    frames.append(cctx.compress(np.bitwise_xor(new, old).data) if e.nbytes else b"")
                    del new, old
            sizes = [len(f) for f in frames]
            encoded = (sizes, b"".join(frames))
            self.deltas.append(
                DeltaStats(manifest.version, base_version, manifest.total_bytes, sum(sizes), time.perf_counter() - t0)
            )
            self._delta_cache = (key, encoded)
            return encoded
