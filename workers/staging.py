"""Weight staging: the trainer writes a versioned update once; every rank reads it back verified, or refuses it.

This module owns the bytes of the weight-update transaction's *prepare* phase:

- `DirectoryStagingStore(root)` keeps version `v` in `root/v{v:06d}/` as `weights.safetensors` + `manifest.json`.
  `stage()` computes per-tensor checksums (xxh3-128 by default, blake3 optional), writes into a hidden temporary
  directory, fsyncs, and renames it into place: a crash mid-write leaves no visible version.
- `load_verified()` copies a staged file into private host memory (fresh tensors, or the rank's reusable buffers via
  `out=`), so the verified bytes cannot change under the rank afterwards, and checks every tensor's presence, dtype,
  shape, extent in the file and checksum against the manifest the coordinator announced. The copy goes through a
  read-only mapping in 1 MiB chunks, each hashed while still in cache: verification costs about one extra pass
  over cached data rather than a second trip through memory. Any problem raises `StagingError` naming the tensor and
  a short `kind` a RankPrepareFailed event can carry.
- `open_store(uri)` picks a store by URI scheme (`file://` or a plain path); the `StagingStore` protocol is what an
  object-store backend would implement later.

The safetensors header (8-byte little-endian length, then JSON) is parsed here rather than by `safe_open`, so that a
truncated or mislabelled file still names the tensor at fault instead of failing as a whole.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import struct
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

import blake3
import torch
import xxhash
from pydantic import ValidationError
from safetensors.torch import save_file

from rolledger.schemas.weights import DEFAULT_CHECKSUM_ALGO, DTYPE_SIZES, ChecksumAlgo, TensorEntry, WeightManifest
from rolledger.workers.weights import dtype_name

WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_TMP_DIR = re.compile(r"^\.tmp-v(\d{6,})-[0-9a-f]+$")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
READ_CHUNK_BYTES = 1 << 20  # copy-then-hash granularity: small enough to stay in L2, large enough to amortise calls

# safetensors header dtype code <-> manifest dtype name (workers.weights.dtype_name)
_ST_TO_NAME: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}

FailureKind = Literal[
    "missing", "extra", "shape", "dtype", "checksum", "truncated", "unreadable", "manifest", "exists", "not_found"
]


class StagingError(RuntimeError):
    """A staged update cannot be written or fails verification. `tensor` names the culprit when there is one."""

    def __init__(self, tensor: str | None, reason: str, *, kind: FailureKind, version: int | None = None) -> None:
        where = f"version {version}: " if version is not None else ""
        what = f"tensor {tensor!r}: " if tensor is not None else ""
        super().__init__(f"{where}{what}{reason}")
        self.tensor = tensor
        self.reason = reason
        self.kind: FailureKind = kind
        self.version = version


# --------------------------------------------------------------------------------------------------- checksums


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (any dtype, any rank including 0-dim)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def checksum_bytes(data: memoryview | bytes, algo: ChecksumAlgo) -> str:
    """Hex checksum of raw bytes: xxh3-128 (32 hex digits) or blake3 (64 hex digits)."""
    if algo == "xxh3_128":
        return xxhash.xxh3_128_hexdigest(data)
    if algo == "blake3":
        return blake3.blake3(data).hexdigest()
    raise ValueError(f"unknown checksum_algo {algo!r}; expected 'xxh3_128' or 'blake3'")


class _Hasher(Protocol):
    def update(self, data: memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def _new_hasher(algo: ChecksumAlgo) -> _Hasher:
    """A streaming hasher whose hexdigest equals checksum_bytes(all the bytes fed, algo)."""
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    if algo == "blake3":
        return blake3.blake3()
    raise ValueError(f"unknown checksum_algo {algo!r}; expected 'xxh3_128' or 'blake3'")


def checksum(t: torch.Tensor, algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO) -> str:
    """Checksum of a tensor's C-order bytes; for xxh3_128 this equals workers.weights.tensor_checksum."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return checksum_bytes(_raw_bytes(t.contiguous()), algo)


# --------------------------------------------------------------------------------------------------- results


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


@dataclass(frozen=True)
class LoadTimings:
    header_s: float  # header parsed and checked against the manifest (names, dtypes, shapes, extents)
    read_s: float  # bytes read into host memory
    checksum_s: float
    total_s: float
    nbytes: int

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


# --------------------------------------------------------------------------------------------------- the file format


@dataclass(frozen=True)
class _HeaderEntry:
    name: str
    dtype: str  # manifest name, or the raw safetensors code when unknown
    shape: tuple[int, ...]
    start: int  # absolute file offsets
    end: int


def _open_weights(path: Path, version: int | None) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StagingError(None, f"weights file {str(path)!r} does not exist", kind="not_found", version=version)
    except OSError as e:
        raise StagingError(None, f"cannot open {str(path)!r}: {e}", kind="unreadable", version=version) from e


def _read_header(fd: int, version: int | None) -> tuple[list[_HeaderEntry], int]:
    """Parse the safetensors header of an open file; returns its tensor entries (in file order) and the file size."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise StagingError(None, f"file is {size} bytes, too short for a header", kind="truncated", version=version)
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER_BYTES or 8 + n > size:
        raise StagingError(
            None,
            f"header claims {n} bytes but the file has {size}: corrupt or truncated",
            kind="unreadable",
            version=version,
        )
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise StagingError(None, f"unreadable safetensors header: {e}", kind="unreadable", version=version) from e
    if not isinstance(header, dict):
        raise StagingError(None, "unreadable safetensors header: not a JSON object", kind="unreadable", version=version)
    base = 8 + n
    entries: list[_HeaderEntry] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise StagingError(name, f"malformed header entry {info!r}", kind="unreadable", version=version) from e
        if not 0 <= start <= end:
            raise StagingError(name, f"bad data_offsets [{start}, {end})", kind="unreadable", version=version)
        entries.append(_HeaderEntry(name, _ST_TO_NAME.get(code, code), shape, base + start, base + end))
    entries.sort(key=lambda e: e.start)
    return entries, size


def _check_against_manifest(
    entries: list[_HeaderEntry], size: int, manifest: WeightManifest
) -> list[tuple[_HeaderEntry, TensorEntry]]:
    """Everything checkable without reading tensor bytes; returns (header, manifest) pairs in file order."""
    v = manifest.version
    by_name = {e.name: e for e in entries}
    expected = {t.name: t for t in manifest.tensors}
    for name in sorted(expected.keys() - by_name.keys()):
        raise StagingError(name, "missing from the staged file", kind="missing", version=v)
    for name in sorted(by_name.keys() - expected.keys()):
        raise StagingError(name, "in the staged file but not in the manifest", kind="extra", version=v)
    pairs = []
    for h in entries:
        want = expected[h.name]
        if h.dtype != want.dtype:
            raise StagingError(
                h.name, f"dtype mismatch: file has {h.dtype}, manifest says {want.dtype}", kind="dtype", version=v
            )
        if h.shape != want.shape:
            raise StagingError(
                h.name, f"shape mismatch: file has {h.shape}, manifest says {want.shape}", kind="shape", version=v
            )
        if h.end - h.start != want.nbytes:
            raise StagingError(
                h.name, f"file holds {h.end - h.start} bytes, manifest says {want.nbytes}", kind="unreadable", version=v
            )
        if h.end > size:
            raise StagingError(
                h.name,
                f"truncated: needs file bytes [{h.start}, {h.end}) but the file has {size}",
                kind="truncated",
                version=v,
            )
        pairs.append((h, want))
    return pairs


# --------------------------------------------------------------------------------------------------- stores


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
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        return self.root / f"v{version:06d}"

    def uri_for(self, version: int) -> str:
        return self.version_dir(version).as_uri()

    def versions(self) -> list[int]:
        """Versions fully staged here (hidden temporary directories of unfinished writes are not versions)."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _VERSION_DIR.match(p.name)
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
                checksum=checksum_bytes(_raw_bytes(t), checksum_algo),
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
        """Read the staged tensors into host memory and verify each against `manifest`, or raise StagingError.

        `out`: preallocated CPU buffers (name -> contiguous tensor of the manifest's shape and dtype) to read into
        instead of allocating; a rank reusing its staging buffer skips first-touch page faults.
        `corrupt`: fault injection: flip one byte of that tensor after reading, as a bad transfer would, so the
        checksum check must catch it.
        """
        if version != manifest.version:
            raise StagingError(
                None,
                f"manifest is for version {manifest.version}, asked for {version}",
                kind="manifest",
                version=version,
            )
        if corrupt is not None:
            entry = manifest.entry(corrupt)
            if entry.nbytes == 0:
                raise ValueError(f"cannot corrupt tensor {corrupt!r}: it has no bytes")
        t0 = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        read_s = checksum_s = 0.0
        fd = _open_weights(self.version_dir(version) / manifest.file, version)
        try:
            entries, size = _read_header(fd, version)
            pairs = _check_against_manifest(entries, size, manifest)
            t1 = time.perf_counter()
            # Every extent was checked against the file size above, so the mapping covers every byte read. The file
            # is immutable once staged; one truncated *during* this read would kill the process (SIGBUS), which the
            # update coordinator sees as a rank missing its prepare deadline: the update still aborts.
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm, memoryview(mm) as src:
                for h, want in pairs:
                    dest = _destination(want, out)
                    buf = _raw_bytes(dest)
                    flip_at = len(buf) // 2 if corrupt == h.name else -1
                    hasher = _new_hasher(manifest.checksum_algo)
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
            m = _VERSION_DIR.match(p.name) or _TMP_DIR.match(p.name)
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


def _destination(want: TensorEntry, out: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
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


def _fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------- URIs


def _path_from_uri(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI {uri!r} names host {parsed.netloc!r}; only local paths are supported")
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return Path(uri)
    raise ValueError(f"unknown staging URI scheme {parsed.scheme!r} in {uri!r}; supported: file:// or a plain path")


def open_store(uri: str) -> DirectoryStagingStore:
    """The store rooted at `uri` (`file:///path` or a plain path); ValueError naming any other scheme."""
    return DirectoryStagingStore(_path_from_uri(uri))


def open_version(uri: str, version: int) -> DirectoryStagingStore:
    """The store holding `version` at the version URI a command names (StagedUpdate.uri / UpdateStaged carry it).
    The version is the caller's (the command's), never read from the folder's name: a URI that is not that
    version's directory is a StagingError naming both."""
    path = _path_from_uri(uri).absolute()
    store = DirectoryStagingStore(path.parent)
    if store.version_dir(version) != path:
        raise StagingError(
            None, f"{uri!r} is not the directory of version {version}", kind="not_found", version=version
        )
    return store


def read_manifest(uri: str, version: int, *, expected_digest: str | None = None) -> WeightManifest:
    """The manifest of `version` stored at its URI, checked to be for that version and, when given, the announced
    digest."""
    return open_version(uri, version).read_manifest(version, expected_digest=expected_digest)


def load_verified(
    uri: str,
    version: int,
    manifest: WeightManifest,
    *,
    corrupt: str | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> VerifiedWeights:
    """Read and verify `version` at its URI against `manifest` (which must be for that version); see
    DirectoryStagingStore.load_verified."""
    return open_version(uri, version).load_verified(version, manifest, corrupt=corrupt, out=out)
