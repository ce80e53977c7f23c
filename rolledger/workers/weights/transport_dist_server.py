"""The trainer's side of the dist transport: `WeightServer`, the weight server in the trainer process. It listens
on a TCPStore, publishes each staged version's manifest there, and serves every rank that asks on a thread of its
own: from memory while the version's durable copy is still being written (`offer`; the last bucket waits for
`persisted`), else from a mapping of the staged file, `SLOTS` buckets in flight, as a delta when the rank names a
base this server has. It also owns the memory of the versions it holds (the newest `IN_MEMORY` offered ones, and
retired snapshots kept for reuse) and which staged files a transfer is reading (`recycle` never takes one). Each
transfer is timed (`SendStats`). The protocol is transport_dist's, the receiver transport_dist_receive.
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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import structlog
import torch
import torch.distributed as dist

from rolledger.schemas.weights import WeightManifest
from rolledger.workers.runtime.netguard import EngineAddressError, check_host
from rolledger.workers.weights.staging_checksums import raw_bytes
from rolledger.workers.weights.staging_format import (
    MANIFEST_FILE,
    VERSION_DIR,
    StagingError,
    check_against_manifest,
    open_weights,
    read_header,
)
from rolledger.workers.weights.transport_dist import (
    BACKENDS,
    DEFAULT_BUCKET_BYTES,
    REQUESTS,
    SLOTS,
    STOP,
    Backend,
    Wait,
    Wire,
    as_timedelta,
    chunks,
    dist_uri,
    open_group,
    wire_device,
)
from rolledger.workers.weights.transport_dist_delta import DeltaStats, encode_delta

log = structlog.get_logger("rolledger.transport")


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
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=as_timedelta(timeout_s))
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
            self._store.queue_push(REQUESTS, STOP)
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
                raw = self._accept_store.queue_pop(REQUESTS)
            except (dist.DistError, RuntimeError):
                if self._closed.is_set():
                    return
                continue
            if raw == STOP:
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
        client = dist.TCPStore(self.host, self.port, is_master=False, timeout=as_timedelta(self.timeout_s))
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
            group = open_group(
                dist.PrefixStore(f"session/{session}/", client), 0, self.host, self.timeout_s, self.backend
            )
            nbytes = min(self.bucket_bytes, max(sum(sizes), 1))
            wire = Wire(group, self._device, nbytes, self.timeout_s)
            stats = self._send_buckets(wire, dirname, list(chunks(sizes, self.bucket_bytes)), pieces_of, nbytes, held)
            self.transfers.append(stats)

    def _send_buckets(
        self,
        wire: Wire,
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
                frames = encode_delta(manifest.tensors, views, base_views, self.delta_level)
            sizes = [len(f) for f in frames]
            encoded = (sizes, b"".join(frames))
            self.deltas.append(
                DeltaStats(manifest.version, base_version, manifest.total_bytes, sum(sizes), time.perf_counter() - t0)
            )
            self._delta_cache = (key, encoded)
            return encoded
