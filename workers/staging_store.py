"""The directory staging store: the trainer writes a versioned update once, atomically; old versions are collected.

`DirectoryStagingStore(root)` keeps version `v` in `root/v{v:06d}/` as `weights.safetensors` + `manifest.json`
(workers.staging_format). `stage()` computes per-tensor checksums (xxh3-128 by default, blake3 optional), writes into
a hidden temporary directory, fsyncs, and renames it into place: a crash mid-write leaves no visible version.
`read_manifest()` reads a version's manifest back, checked against the announced digest; `load_verified()` reads
through workers.staging_loader; `gc()` deletes what no update needs any more. `open_store(uri)` picks a store by URI
scheme (`file://` or a plain path); the `StagingStore` protocol is what an object-store backend would implement later.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from rolledger.schemas.weights import DEFAULT_CHECKSUM_ALGO, DTYPE_SIZES, ChecksumAlgo, TensorEntry, WeightManifest
from rolledger.workers.staging_checksums import checksum_bytes, raw_bytes
from rolledger.workers.staging_format import (
    MANIFEST_FILE,
    TMP_DIR,
    VERSION_DIR,
    WEIGHTS_FILE,
    StagingError,
    path_from_uri,
    version_dir,
    version_root,
)
from rolledger.workers.staging_loader import VerifiedWeights, read_verified
from rolledger.workers.weights import dtype_name


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

    def uri_for(self, version: int) -> str: ...

    def versions(self) -> list[int]: ...

    def stage(
        self,
        version: int,
        base_version: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        checksum_algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO,
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

    def version_dir(self, version: int) -> Path:
        return version_dir(self.root, version)

    def uri_for(self, version: int) -> str:
        return self.version_dir(version).as_uri()

    def versions(self) -> list[int]:
        """Versions fully staged here (hidden temporary directories of unfinished writes are not versions)."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = VERSION_DIR.match(p.name)
            if m and (p / MANIFEST_FILE).is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    # -- put

    def stage(
        self,
        version: int,
        base_version: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        checksum_algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO,
    ) -> StagedUpdate:
        """Checksum and write `state_dict` as `version` (replacing `base_version`), atomically.

        Raises StagingError(kind="exists") when the version is already staged, StagingError naming the tensor for a
        tensor that cannot be staged, and ValidationError for an invalid version/base pair.
        """
        t0 = time.perf_counter()
        final = self.version_dir(version)
        if final.exists():
            raise StagingError(None, f"already staged at {final}", kind="exists", version=version)
        tensors = _prepare_for_save(state_dict, version)
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
        manifest = WeightManifest(
            version=version,
            base_version=base_version,
            checksum_algo=checksum_algo,
            tensors=entries,
            total_bytes=sum(e.nbytes for e in entries),
            file=WEIGHTS_FILE,
        )
        t1 = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-v{version:06d}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            weights_path = tmp / manifest.file
            save_file(tensors, str(weights_path), metadata={"version": str(version), "base_version": str(base_version)})
            (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=1))
            tf = time.perf_counter()
            if self.fsync:
                for p in (weights_path, tmp / MANIFEST_FILE, tmp):
                    _fsync_path(p)
            fsync_s = time.perf_counter() - tf
            try:
                os.rename(tmp, final)
            except OSError as e:  # another writer staged the same version first
                raise StagingError(None, f"already staged at {final} ({e})", kind="exists", version=version) from e
            if self.fsync:
                tf = time.perf_counter()
                _fsync_path(self.root)
                fsync_s += time.perf_counter() - tf
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        t2 = time.perf_counter()
        return StagedUpdate(
            manifest=manifest,
            uri=self.uri_for(version),
            bytes=manifest.total_bytes,
            manifest_digest=manifest.digest,
            timings=StageTimings(checksum_s=t1 - t0, write_s=t2 - t1, fsync_s=fsync_s, total_s=t2 - t0),
        )

    # -- get

    def read_manifest(self, version: int, *, expected_digest: str | None = None) -> WeightManifest:
        """The manifest stored with `version`; StagingError when absent, invalid, or not the expected digest."""
        path = self.version_dir(version) / MANIFEST_FILE
        try:
            manifest = WeightManifest.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            raise StagingError(None, f"no staged manifest at {path}", kind="not_found", version=version)
        except ValidationError as e:
            raise StagingError(None, f"invalid {MANIFEST_FILE}: {e}", kind="manifest", version=version) from e
        if manifest.version != version:
            raise StagingError(
                None, f"{path} is for version {manifest.version}, asked for {version}", kind="manifest", version=version
            )
        if expected_digest is not None and manifest.digest != expected_digest:
            raise StagingError(
                None,
                f"manifest digest {manifest.digest} is not the announced {expected_digest}",
                kind="manifest",
                version=version,
            )
        return manifest

    def load_verified(
        self,
        version: int,
        manifest: WeightManifest,
        *,
        corrupt: str | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> VerifiedWeights:
        """Read the staged tensors and verify each against `manifest`; see staging_loader.read_verified."""
        return read_verified(self.version_dir(version), version, manifest, corrupt=corrupt, out=out)

    # -- housekeeping

    def gc(self, keep_versions: Iterable[int]) -> list[int]:
        """Delete staged versions older than the newest kept one and not in `keep_versions`; return them.

        Versions newer than every kept one are left alone (they may be an update in flight), and so are temporary
        directories of such versions; older abandoned temporary directories (a crashed writer) are removed.
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
                shutil.rmtree(p)
                if p.name.startswith("v"):
                    deleted.append(v)
        return sorted(deleted)


def _prepare_for_save(state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
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


def _fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_store(uri: str) -> DirectoryStagingStore:
    """The store rooted at `uri` (`file:///path` or a plain path); ValueError naming any other scheme."""
    return DirectoryStagingStore(path_from_uri(uri))


def open_version(uri: str, version: int) -> DirectoryStagingStore:
    """The store holding `version` at the version URI a command names; see staging_format.version_root."""
    return DirectoryStagingStore(version_root(uri, version))


def read_manifest(uri: str, version: int, *, expected_digest: str | None = None) -> WeightManifest:
    """The manifest of `version` stored at its URI, checked to be for that version and, when given, the announced
    digest."""
    return open_version(uri, version).read_manifest(version, expected_digest=expected_digest)
