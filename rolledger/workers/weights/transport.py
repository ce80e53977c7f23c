"""How a staged version's bytes reach the ranks, chosen per run (`update.transport`): owns the choice and the
dispatch by URI scheme, so the update transaction above it is the same whatever moved the bytes.

- `directory` (`file://` URIs): the trainer writes each version into a directory every rank reads
  (workers.weights.staging_store); it needs a filesystem the trainer and the ranks share.
- `dist` (`dist://` URIs): the trainer writes each version into its own directory and serves it over
  torch.distributed (workers.weights.transport_dist and its siblings); nothing is shared but the network.

Either way the rank checks the manifest against the digest the coordinator announced and every tensor's bytes
against the manifest before it reports prepared (`read_manifest`, `load_verified`), and a failure names the tensor.
`open_trainer_store(cfg, root)` is the trainer's store for the run's transport; `versions_to_keep` (workflows.trainer)
says what its `gc` may not delete.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from rolledger.events.disk_full import DiskFull, free_bytes, has_room
from rolledger.schemas.config import RunConfig
from rolledger.schemas.weights import DEFAULT_CHECKSUM_ALGO, ChecksumAlgo, WeightManifest
from rolledger.workers.weights import staging_loader, staging_store, transport_dist, transport_dist_receive
from rolledger.workers.weights.staging_format import FREE_FILE, version_dir
from rolledger.workers.weights.staging_loader import VerifiedWeights
from rolledger.workers.weights.staging_store import DirectoryStagingStore, StagedUpdate, StageTimings, StagingStore
from rolledger.workers.weights.transport_dist_delta import DeltaBase
from rolledger.workers.weights.transport_dist_server import WeightServer

log = structlog.get_logger("rolledger.transport")

__all__ = ["DeltaBase", "DistStagingStore", "load_verified", "open_trainer_store", "read_manifest"]


def _is_dist(uri: str) -> bool:
    return uri.startswith(f"{transport_dist.SCHEME}://")


def read_manifest(uri: str, version: int, *, expected_digest: str | None = None) -> WeightManifest:
    """The manifest of `version` where its URI says (a directory, or a weight server), checked to be for that version
    and, when given, the announced digest; StagingError otherwise."""
    if _is_dist(uri):
        return transport_dist_receive.read_manifest(uri, version, expected_digest=expected_digest)
    return staging_store.read_manifest(uri, version, expected_digest=expected_digest)


def load_verified(
    uri: str,
    version: int,
    manifest: WeightManifest,
    *,
    corrupt: str | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    noop_transport: bool = False,
    base: DeltaBase | None = None,
) -> VerifiedWeights:
    """`version`'s tensors in private host memory, every byte checked against `manifest`, fetched the way the URI
    says. `base` (dist only): the weights the rank serves, which the server may send a delta against.
    `noop_transport` (fault injection, dist only): the transfer moves nothing, as a disabled communicator."""
    if _is_dist(uri):
        comm = (
            transport_dist_receive.NoOpCommunicatorFake if noop_transport else transport_dist_receive.GroupCommunicator
        )
        return transport_dist_receive.receive_verified(
            uri, version, manifest, corrupt=corrupt, out=out, communicator=comm, base=base
        )
    if noop_transport:
        raise ValueError("noop_transport is a fault of the dist transport; this version is a directory")
    return staging_loader.load_verified(uri, version, manifest, corrupt=corrupt, out=out)


@dataclass(frozen=True)
class SnapshotTimings:
    """The parts of one `DistStagingStore.stage`, all on the update's path: waiting for the previous durable copy,
    copying the weights into the snapshot served, checksumming it into the manifest, offering it."""

    wait_previous_s: float
    snapshot_s: float
    checksum_s: float
    offer_s: float
    total_s: float


class DistStagingStore:
    """The trainer's store under the dist transport: the directory store in the trainer's own directory, and a
    WeightServer that serves what it holds. URIs are the server's (`dist://host:port/<dir>`)."""

    def __init__(
        self,
        root: str | Path,
        host: str,
        port: int,
        *,
        bucket_bytes: int = transport_dist.DEFAULT_BUCKET_BYTES,
        timeout_s: float = 30.0,
        allow_remote: bool = False,
        delta: bool = False,
        fsync: bool = True,
        backend: transport_dist.Backend = "gloo",
    ) -> None:
        self.local = DirectoryStagingStore(root, fsync=fsync)
        self._writer: threading.Thread | None = None
        self.last_copy: StageTimings | None = None  # how the last durable copy's write went (bench/bench_transport.py)
        self.last_stage: SnapshotTimings | None = None  # how the last stage's parts went
        # fault injection (kill-trainer@copy): called with the version once its durable copy is written and before
        # the server records it; the chaos harness's hook sets it in a trainer process (it SIGKILLs the process)
        self.on_copied: Callable[[int], None] | None = None
        self.server = WeightServer(
            self.local.root,
            host,
            port,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            allow_remote=allow_remote,
            delta=delta,
            backend=backend,
        )

    def __repr__(self) -> str:
        return f"DistStagingStore({str(self.local.root)!r}, {self.server.host}:{self.server.port})"

    @property
    def root(self) -> Path:
        return self.local.root

    def uri_for(self, version: int) -> str:
        return self.server.uri(self.local.version_dir(version).name)

    def versions(self) -> list[int]:
        return self.local.versions()

    def stage(
        self,
        version: int,
        base_version: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        checksum_algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO,
        parent_digest: str | None = None,
    ) -> StagedUpdate:
        """Snapshot and checksum the weights, offer them on the server from memory at once, and write the trainer's
        durable copy behind (one write in flight; the next stage waits for it). The server holds back the last
        bucket of every transfer until that copy is complete, so what a rank prepares, the trainer can restore.
        The record carries the server's URI; `timings.write_s` is 0 (the write is not on the update's path)."""
        t0 = time.perf_counter()
        self.wait_persisted()
        t1 = time.perf_counter()
        prepared = staging_store.prepare_for_save(state_dict, version)
        self._check_room(version, prepared)
        snapshot = self.server.reusable(prepared)  # the trainer trains on: serve a copy
        if snapshot is None:
            snapshot = {name: t.clone() for name, t in prepared.items()}
        else:
            for name, t in prepared.items():
                snapshot[name].copy_(t)
        t2 = time.perf_counter()
        manifest = staging_store.build_manifest(snapshot, version, base_version, checksum_algo, parent_digest)
        t3 = time.perf_counter()
        dirname = version_dir(self.local.root, version, manifest.digest).name
        uri = self.server.offer(dirname, manifest, snapshot)
        took = time.perf_counter() - t0
        self.last_stage = SnapshotTimings(t1 - t0, t2 - t1, t3 - t2, took - (t3 - t0), took)
        self._writer = threading.Thread(
            target=self._persist,
            args=(dirname, manifest, snapshot),
            name=f"persist-v{version}",
            daemon=True,
        )
        self._writer.start()
        return StagedUpdate(
            manifest=manifest,
            uri=uri,
            bytes=manifest.total_bytes,
            manifest_digest=manifest.digest,
            timings=StageTimings(checksum_s=took, write_s=0.0, fsync_s=0.0, total_s=took),
        )

    def _check_room(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """DiskFull (nothing offered) when the trainer's directory has no room for the durable copy: a version
        offered without room for its copy would fail every transfer of it, so its update would abort. The free
        file, overwritten in place, needs no new room. A disk that fills during the copy still fails the transfers
        (the update aborts, the ranks keep serving the old version)."""
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + staging_store.STAGE_SLACK
        free_file = self.local.root / FREE_FILE
        with contextlib.suppress(FileNotFoundError):
            need -= free_file.stat().st_size
        if not has_room(self.local.root, need):
            raise DiskFull(
                self.local.root,
                f"staging v{version}",
                OSError(errno.ENOSPC, f"{free_bytes(self.local.root)} bytes free, the copy needs {need}"),
                need=need,
            )

    def _persist(self, dirname: str, manifest: WeightManifest, tensors: Mapping[str, torch.Tensor]) -> None:
        error = None
        try:
            staged = self.local.write(tensors, manifest, started=time.perf_counter())
            self.last_copy = staged.timings
            if staged.manifest_digest != manifest.digest:
                error = f"the copy's manifest is {staged.manifest_digest}, the offered one {manifest.digest}"
            elif self.on_copied is not None:
                self.on_copied(manifest.version)
        except Exception as e:  # noqa: BLE001 - reported to every transfer of this version, which then fails
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            log.error("transport.persist_failed", version=manifest.version, error=error)
        self.server.persisted(dirname, error)

    def wait_persisted(self) -> None:
        """Wait for the durable copy being written, if any (it has the server's deadline per transfer anyway)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def read_manifest(self, version: int, *, expected_digest: str | None = None) -> WeightManifest:
        self.wait_persisted()
        return self.local.read_manifest(version, expected_digest=expected_digest)

    def load_verified(
        self,
        version: int,
        manifest: WeightManifest,
        *,
        corrupt: str | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> VerifiedWeights:
        self.wait_persisted()
        return self.local.load_verified(version, manifest, corrupt=corrupt, out=out)

    def gc(self, keep_versions: Iterable[int]) -> list[int]:
        """Collect as the directory store does, and stop offering what was collected."""
        self.wait_persisted()
        before = {p.name for p in self.local.root.iterdir()} if self.local.root.is_dir() else set()
        deleted = self.local.gc(keep_versions, recycle=self.server.recycle)  # only this server reads these files
        after = {p.name for p in self.local.root.iterdir()} if self.local.root.is_dir() else set()
        for dirname in before - after:
            self.server.drop(dirname)
        return deleted

    def close(self) -> None:
        """Stop serving; the free file (a collected version's, kept for the next write) leaves the disk too."""
        self.wait_persisted()
        self.server.close()
        (self.local.root / FREE_FILE).unlink(missing_ok=True)


def open_trainer_store(cfg: RunConfig, default_root: Path) -> StagingStore:
    """The trainer's store for the run's transport (`update.transport`), rooted at `update.staging_dir` or
    `default_root`."""
    u = cfg.update
    root = u.staging_dir or default_root
    if u.transport == "dist":
        return DistStagingStore(
            root,
            u.transport_host,
            u.transport_port,
            bucket_bytes=int(u.transport_bucket_mb * (1 << 20)),
            timeout_s=u.prepare_deadline_s,
            allow_remote=u.allow_remote_transport,
            delta=u.transport_delta,
            fsync=u.staging_fsync,
            backend=u.transport_backend,
        )
    return DirectoryStagingStore(root, fsync=u.staging_fsync)


def serves_weights(store: StagingStore) -> bool:
    """Whether the ranks fetch staged versions from this process (the dist transport): then it must keep running
    until the run ends, or a rank that still needs the last version (an update in flight, a rank rejoining) finds
    nothing there. A directory outlives its writer."""
    return isinstance(store, DistStagingStore)


def own_copy_uri(store: StagingStore, uri: str, version: int) -> str:
    """Where the trainer reads back a version it staged (a restarted trainer restoring its weights): the URI itself
    for a directory, the trainer's own directory for the dist transport (not through its own server), once the
    copy being written is complete."""
    if not isinstance(store, DistStagingStore):
        return uri
    store.wait_persisted()
    return (store.local.root / transport_dist.parse_uri(uri, version).dirname).as_uri()


def close_store(store: StagingStore) -> None:
    """Stop a store's server, if it has one (the directory store has nothing to stop)."""
    if isinstance(store, DistStagingStore):
        store.close()


def fix_transport_port(cfg: RunConfig) -> RunConfig:
    """`cfg` with a dist transport's port 0 replaced by a free port of its host, chosen once when the run starts and
    recorded in RunStarted: a restarted trainer serves on the same address, so the URIs in the log stay valid."""
    u = cfg.update
    if u.transport != "dist" or u.transport_port != 0:
        return cfg
    with socket.socket(socket.AF_INET6 if ":" in u.transport_host else socket.AF_INET) as s:
        s.bind((u.transport_host, 0))
        port = int(s.getsockname()[1])
    return cfg.model_copy(update={"update": u.model_copy(update={"transport_port": port})})
