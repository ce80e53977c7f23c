"""The directory staging store: the trainer writes a versioned update once, atomically; old versions are collected.

`DirectoryStagingStore(root)` keeps version `v` in `root/v{v:06d}-{manifest digest[:12]}/` as `weights.safetensors` +
`manifest.json` (workers.weights.staging_format): content-addressed, so staging is idempotent. `stage()` computes per-tensor
checksums (xxh3-128 by default, blake3 optional) and the manifest first; if that directory already holds the same
manifest, staging is a no-op returning the existing record (a trainer killed after staging and before appending
UpdateStaged restages the same step on restart); other content for the same version goes to another directory (the
unlogged one is an orphan `gc()` collects); a directory of the same name holding another manifest is an error naming
both digests. New content is written into a hidden temporary directory, fsynced, and renamed into place: a crash
mid-write leaves no visible version; a full disk (ENOSPC, EDQUOT) removes the temporary directory and raises
`DiskFull` naming the file (events/disk_full.py), so nothing is staged. The URI (`StagedUpdate.uri`, UpdateStaged.uri) names the directory; readers go
by it (`read_manifest(uri, ...)`, staging_loader.load_verified), never by the version alone.
`read_manifest()` reads a version's manifest back, checked against the announced digest; `load_verified()` reads
through workers.weights.staging_loader; `gc()` deletes what no update needs any more. `open_store(uri)` picks a store by URI
scheme (`file://` or a plain path); the `StagingStore` protocol is what an object-store backend would implement later.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors.torch import save_file

from rolledger.events.archive import fsync_path
from rolledger.events.disk_full import DiskFull, is_disk_full
from rolledger.schemas.weights import DEFAULT_CHECKSUM_ALGO, DTYPE_SIZES, ChecksumAlgo, TensorEntry, WeightManifest
from rolledger.workers.weights.staging_checksums import checksum_bytes, raw_bytes
from rolledger.workers.weights.staging_format import (
    FREE_FILE,
    MANIFEST_FILE,
    TMP_DIR,
    VERSION_DIR,
    WEIGHTS_FILE,
    StagingError,
    overwrite_safetensors,
    parse_manifest,
    path_from_uri,
    safetensors_layout,
    version_dir,
    version_path,
    version_root,
)
from rolledger.workers.weights.staging_loader import VerifiedWeights, read_verified
from rolledger.workers.weights.tensors import dtype_name

STAGE_SLACK = 1 << 20  # room beyond the tensors' bytes a stage needs: the safetensors header, the manifest, metadata


@dataclass(frozen=True)
class StageTimings:
    checksum_s: float
    write_s: float  # safetensors + manifest written and fsynced, directory renamed into place
    fsync_s: float  # the part of write_s spent in fsync (0 with fsync=False)
    total_s: float


@dataclass(frozen=True)
class StagedUpdate:
    """What UpdateStaged announces: the manifest (and its digest), where it lives, and its size."""

    manifest: WeightManifest
    uri: str
    bytes: int
    manifest_digest: str
    timings: StageTimings


@runtime_checkable
class StagingStore(Protocol):
    """Where staged updates live: put (stage) and get (load_verified) by version. A directory today."""

    @property
    def root(self) -> Path: ...

    def uri_for(self, version: int) -> str: ...

    def versions(self) -> list[int]: ...

    def stage(
        self,
        version: int,
        base_version: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        checksum_algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO,
        parent_digest: str | None = None,
    ) -> StagedUpdate: ...

    def read_manifest(self, version: int, *, expected_digest: str | None = None) -> WeightManifest: ...

    def load_verified(
        self,
        version: int,
        manifest: WeightManifest,
        *,
        corrupt: str | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> VerifiedWeights: ...

    def gc(self, keep_versions: Iterable[int]) -> list[int]: ...


class DirectoryStagingStore:
    """Staged updates in `root/v{version:06d}/{weights.safetensors, manifest.json}` on a local or shared filesystem."""

    def __init__(self, root: str | Path, *, fsync: bool = True) -> None:
        self.root = Path(root).absolute()
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"DirectoryStagingStore({str(self.root)!r})"

    def _dirs(self, version: int) -> list[Path]:
        """Every staged directory of `version` here, newest first (one, unless an orphan of a crashed writer)."""
        if not self.root.is_dir():
            return []
        found = [
            p
            for p in self.root.iterdir()
            if (m := VERSION_DIR.match(p.name)) and int(m.group(1)) == version and (p / MANIFEST_FILE).is_file()
        ]
        return sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True)

    def version_dir(self, version: int) -> Path:
        """The directory of `version` here (the newest staged one; the plain name when none is)."""
        dirs = self._dirs(version)
        return dirs[0] if dirs else version_dir(self.root, version)

    def uri_for(self, version: int) -> str:
        return self.version_dir(version).as_uri()

    def versions(self) -> list[int]:
        """Versions fully staged here (hidden temporary directories of unfinished writes are not versions)."""
        if not self.root.is_dir():
            return []
        found = set()
        for p in self.root.iterdir():
            m = VERSION_DIR.match(p.name)
            if m and (p / MANIFEST_FILE).is_file():
                found.add(int(m.group(1)))
        return sorted(found)

    # -- put

    def stage(
        self,
        version: int,
        base_version: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        checksum_algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO,
        parent_digest: str | None = None,
    ) -> StagedUpdate:
        """Checksum and write `state_dict` as `version` (replacing `base_version`; trained from the weights of
        `parent_digest`, recorded in the manifest), atomically, into the directory its manifest digest names. The same content staged again is a no-op returning the existing record.

        Raises StagingError(kind="exists") when that directory holds another manifest (naming both digests),
        StagingError naming the tensor for a tensor that cannot be staged, and ValidationError for an invalid
        version/base pair.
        """
        t0 = time.perf_counter()
        tensors = prepare_for_save(state_dict, version)
        manifest = build_manifest(tensors, version, base_version, checksum_algo, parent_digest)
        return self.write(tensors, manifest, started=t0)

    def write(self, tensors: Mapping[str, torch.Tensor], manifest: WeightManifest, *, started: float) -> StagedUpdate:
        """Write `tensors`, already prepared (`prepare_for_save`) and checksummed into `manifest`, as `stage` does
        (the dist transport's durable copy of a snapshot it hashed once). `started`: when the stage began, for the
        timings. A manifest that is not these tensors' is caught by every later read, which verifies each tensor."""
        t0, t1 = started, time.perf_counter()
        version, base_version = manifest.version, manifest.base_version
        final = version_dir(self.root, version, manifest.digest)
        if final.exists():
            return self._existing(final, manifest, t0)
        tmp = self.root / f".tmp-v{version:06d}-{uuid.uuid4().hex}"
        writing = tmp
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            writing = weights_path = tmp / manifest.file
            metadata = {"version": str(version), "base_version": str(base_version)}
            if not self._write_into_free_file(weights_path, tensors, manifest, metadata):
                save_file(dict(tensors), str(weights_path), metadata=metadata)
            writing = tmp / MANIFEST_FILE
            writing.write_text(manifest.model_dump_json(indent=1))
            tf = time.perf_counter()
            if self.fsync:
                for p in (weights_path, tmp / MANIFEST_FILE, tmp):
                    fsync_path(p)
            fsync_s = time.perf_counter() - tf
            try:
                os.rename(tmp, final)
            except OSError:  # another writer staged the same content first (or other content under its name)
                shutil.rmtree(tmp, ignore_errors=True)
                return self._existing(final, manifest, t0)
            if self.fsync:
                tf = time.perf_counter()
                fsync_path(self.root)
                fsync_s += time.perf_counter() - tf
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)  # a write that could not finish leaves nothing, and its room
            if is_disk_full(e):  # one line naming the file; the version is not staged (the caller waits for room)
                raise DiskFull(writing, f"staging v{version}", e, need=manifest.total_bytes + STAGE_SLACK) from e
            raise
        t2 = time.perf_counter()
        return StagedUpdate(
            manifest=manifest,
            uri=self.uri_for(version),
            bytes=manifest.total_bytes,
            manifest_digest=manifest.digest,
            timings=StageTimings(checksum_s=t1 - t0, write_s=t2 - t1, fsync_s=fsync_s, total_s=t2 - t0),
        )

    def _write_into_free_file(
        self, path: Path, tensors: Mapping[str, torch.Tensor], manifest: WeightManifest, metadata: dict[str, str]
    ) -> bool:
        """Move the free file (a collected version's, kept by `gc(recycle=...)`) to `path` and overwrite it with
        `tensors` in place; False when there is none (then a new file is written)."""
        free = self.root / FREE_FILE
        try:
            os.rename(free, path)
        except FileNotFoundError:
            return False
        head, offsets = safetensors_layout([(e.name, e.dtype, e.shape, e.nbytes) for e in manifest.tensors], metadata)
        size = len(head) + manifest.total_bytes
        overwrite_safetensors(
            path, head, [(offsets[e.name], raw_bytes(tensors[e.name])) for e in manifest.tensors], size
        )
        return True

    def _existing(self, final: Path, manifest: WeightManifest, t0: float) -> StagedUpdate:
        """`final` exists: the record of what it holds when that is `manifest`, else the error naming both."""
        try:
            there = _read_manifest_at(final, manifest.version)
        except StagingError as e:
            raise StagingError(
                None,
                f"{final} exists and is unreadable ({e.reason}); staging {manifest.digest}",
                kind="exists",
                version=manifest.version,
            ) from e
        if there.digest != manifest.digest:
            raise StagingError(
                None,
                f"{final} holds manifest {there.digest}, not the one being staged {manifest.digest}",
                kind="exists",
                version=manifest.version,
            )
        took = time.perf_counter() - t0
        return StagedUpdate(
            manifest=there,
            uri=final.as_uri(),
            bytes=there.total_bytes,
            manifest_digest=there.digest,
            timings=StageTimings(checksum_s=took, write_s=0.0, fsync_s=0.0, total_s=took),
        )

    # -- get

    def read_manifest(self, version: int, *, expected_digest: str | None = None) -> WeightManifest:
        """The manifest stored with `version`; StagingError when absent, invalid, or not the expected digest."""
        return _read_manifest_at(self.version_dir(version), version, expected_digest=expected_digest)

    def load_verified(
        self,
        version: int,
        manifest: WeightManifest,
        *,
        corrupt: str | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> VerifiedWeights:
        """Read the staged tensors and verify each against `manifest` (from the directory its digest names); see
        staging_loader.read_verified."""
        named = version_dir(self.root, version, manifest.digest)
        where = named if named.is_dir() else self.version_dir(version)
        return read_verified(where, version, manifest, corrupt=corrupt, out=out)

    # -- housekeeping

    def gc(self, keep_versions: Iterable[int], *, recycle: Callable[[Path, Path], bool] | None = None) -> list[int]:
        """Delete staged versions older than the newest kept one and not in `keep_versions`; return them.

        Versions newer than every kept one are left alone (they may be an update in flight), and so are temporary
        directories of such versions; older abandoned temporary directories (a crashed writer) are removed.

        `recycle(weights_file, free_file)`: for a store whose files no other process reads (the dist transport's),
        keep one collected weights file as the free file the next `write` overwrites in place; it moves the file
        when nothing reads it and says whether it did. A shared directory's files may be mapped by ranks in other
        processes, so it never recycles (the default).
        """
        keep = set(keep_versions)
        if not keep or not self.root.is_dir():
            return []
        newest_kept = max(keep)
        deleted = []
        for p in sorted(self.root.iterdir()):
            m = VERSION_DIR.match(p.name) or TMP_DIR.match(p.name)
            if not m:
                continue
            v = int(m.group(1))
            if v < newest_kept and v not in keep:
                if recycle is not None and p.name.startswith("v") and not (self.root / FREE_FILE).exists():
                    recycle(p / WEIGHTS_FILE, self.root / FREE_FILE)
                shutil.rmtree(p)
                if p.name.startswith("v"):
                    deleted.append(v)
        return sorted(deleted)


def _read_manifest_at(directory: Path, version: int, *, expected_digest: str | None = None) -> WeightManifest:
    """The manifest in a version directory; StagingError when absent, invalid, or not the expected digest."""
    path = directory / MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise StagingError(None, f"no staged manifest at {path}", kind="not_found", version=version)
    return parse_manifest(raw, version, expected_digest=expected_digest, where=str(path))


def build_manifest(
    tensors: Mapping[str, torch.Tensor],
    version: int,
    base_version: int,
    checksum_algo: ChecksumAlgo,
    parent_digest: str | None = None,
) -> WeightManifest:
    """The manifest of `tensors` (prepared by `prepare_for_save`) staged as `version` on `base_version`: one entry
    per tensor with its checksum, in the state dict's order. The same tensors always give the same digest."""
    entries = tuple(
        TensorEntry(
            name=name,
            shape=tuple(t.shape),
            dtype=dtype_name(t.dtype),
            nbytes=t.numel() * t.element_size(),
            checksum=checksum_bytes(raw_bytes(t), checksum_algo),
        )
        for name, t in tensors.items()
    )
    return WeightManifest(
        version=version,
        base_version=base_version,
        checksum_algo=checksum_algo,
        tensors=entries,
        total_bytes=sum(e.nbytes for e in entries),
        file=WEIGHTS_FILE,
        parent_digest=parent_digest,
    )


def prepare_for_save(state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors safetensors can write: tied weights (shared storage) are cloned, so each is saved."""
    if not state_dict:
        raise StagingError(None, "nothing to stage: the state dict is empty", kind="missing", version=version)
    seen_storage: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if not isinstance(name, str) or not name:
            raise StagingError(repr(name), "tensor names must be non-empty strings", kind="manifest", version=version)
        if not isinstance(t, torch.Tensor):
            raise StagingError(
                name, f"expected a torch.Tensor, got {type(t).__name__}", kind="manifest", version=version
            )
        if dtype_name(t.dtype) not in DTYPE_SIZES:
            raise StagingError(name, f"dtype {dtype_name(t.dtype)} cannot be staged", kind="dtype", version=version)
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen_storage:
            t = t.clone()
        elif t.numel():
            seen_storage.add(ptr)
        out[name] = t
    return out


def open_store(uri: str) -> DirectoryStagingStore:
    """The store rooted at `uri` (`file:///path` or a plain path); ValueError naming any other scheme."""
    return DirectoryStagingStore(path_from_uri(uri))


def open_version(uri: str, version: int) -> DirectoryStagingStore:
    """The store holding `version` at the version URI a command names; see staging_format.version_root."""
    return DirectoryStagingStore(version_root(uri, version))


def read_manifest(uri: str, version: int, *, expected_digest: str | None = None) -> WeightManifest:
    """The manifest of `version` stored at its URI, checked to be for that version and, when given, the announced
    digest."""
    return _read_manifest_at(version_path(uri, version), version, expected_digest=expected_digest)
