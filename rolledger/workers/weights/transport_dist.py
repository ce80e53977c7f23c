"""The torch.distributed weight transport, and what both its sides share (this module): the `dist://` URI a
version is announced by, the rendezvous (the store's request and answer keys, the two-member group per transfer,
the backend), the wire (`Wire`: `SLOTS` buckets in flight, through device buckets for NCCL) and the bucket plan
(`chunks`). The trainer's side is transport_dist_server (`WeightServer`), a rank's is transport_dist_receive
(`read_manifest`, `receive_verified`), and the delta encoding both agree on is transport_dist_delta.

The trainer serves staged versions over gloo (or NCCL: the same code, with each bucket staged through a device
buffer; `backend_for(device)` picks NCCL for CUDA weights), ranks receive them into private memory and verify every
byte against the manifest. The NCCL path is written against the same
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

import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol, cast
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from rolledger.workers.weights.staging_format import VERSION_DIR, StagingError

SCHEME = "dist"
DEFAULT_BUCKET_BYTES = 64 << 20
REQUESTS = "requests"  # the store's queue a rank pushes its request onto
STOP = b"stop"  # what the server pushes onto it to end its own accept loop


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


def as_timedelta(seconds: float) -> datetime.timedelta:
    """A deadline in seconds, as c10d takes it."""
    return datetime.timedelta(seconds=seconds)


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


def open_group(store: dist.Store, rank: int, host: str, timeout_s: float, backend: Backend = "gloo") -> PointToPoint:
    """A two-member group (rank 0 sends, rank 1 receives) over `store`; joining waits at most `timeout_s`.

    gloo is what runs here (CPU, tested); NCCL takes the same calls on device buffers (written against the same
    interface, untested where no GPU is lent: see docs/internals.md, How the bytes travel)."""
    if backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = as_timedelta(timeout_s)
        return cast("PointToPoint", dist.ProcessGroupNCCL(store, rank, 2, nccl_opts))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the documented way to pick the device
    opts._timeout = as_timedelta(timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return cast("PointToPoint", dist.ProcessGroupGloo(store, rank, 2, opts))


Wait = Callable[[], None]  # completes one posted send or receive (raises past its deadline)
SLOTS = 2  # buckets in flight per transfer: bucket i+1 moves while bucket i is filled, or copied out and hashed


class Wire:
    """The bucket as it goes over the group: host memory for gloo; for NCCL one of `SLOTS` device buckets the host
    bytes are copied into before a send and out of after a receive (the checksums are always taken on host bytes).
    Sends and receives are posted (`isend`, `irecv`) and completed later, so a transfer keeps `SLOTS` buckets in
    flight; a bucket's slot is `tag % SLOTS`, and a slot is reused only after the transfer two tags back completed
    (NCCL: the copy into or out of a device bucket is ordered after it on the current stream)."""

    def __init__(self, group: PointToPoint, device: torch.device | None, nbytes: int, timeout_s: float) -> None:
        self.group = group
        self.timeout = as_timedelta(timeout_s)
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


def chunks(sizes: list[int], bucket_bytes: int) -> Iterator[list[tuple[int, int, int]]]:
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
