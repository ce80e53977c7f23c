"""The on-disk form of a staged version, and what can be checked of it without reading the tensor bytes.

Owns the layout (version `v` lives in `root/v{v:06d}/` as `weights.safetensors` + `manifest.json`; unfinished
writes are hidden `.tmp-v{v:06d}-<hex>` directories), version URIs (`file://` or a plain path), `StagingError` (the
one error of staging, naming the tensor at fault and a short `kind` a RankPrepareFailed event can carry), and the
safetensors header: parsed here rather than by `safe_open`, so that a truncated or mislabelled file still names the
tensor at fault instead of failing as a whole, and checked against the manifest (names, dtypes, shapes, extents).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlparse

from pydantic import ValidationError

from rolledger.schemas.weights import DTYPE_SIZES, TensorEntry, WeightManifest

WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"
FREE_FILE = ".free-weights.safetensors"  # a collected version's weights file, kept to be overwritten by the next one
VERSION_DIR = re.compile(r"^v(\d{6,})(?:-([0-9a-f]{12}))?$")  # v000010-<manifest digest[:12]> (or v000010, older)
DIGEST_PREFIX = 12
TMP_DIR = re.compile(r"^\.tmp-v(\d{6,})-[0-9a-f]+$")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
_HEADER_ALIGN = 8  # the safetensors library pads its header with spaces to this

# safetensors header dtype code <-> manifest dtype name (workers.weights.tensors.dtype_name)
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


FailureKind = Literal[
    "missing",
    "extra",
    "shape",
    "dtype",
    "checksum",
    "truncated",
    "unreadable",
    "manifest",
    "exists",
    "not_found",
    "transport",
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


def check_manifest(
    manifest: WeightManifest, version: int, *, expected_digest: str | None = None, where: str = "manifest"
) -> WeightManifest:
    """`manifest` if it is for `version` (and has `expected_digest` when given); StagingError naming `where` (a path,
    a URI) otherwise. The one check every transport applies to the manifest it is handed or fetches."""
    if manifest.version != version:
        raise StagingError(
            None, f"{where} is for version {manifest.version}, asked for {version}", kind="manifest", version=version
        )
    if expected_digest is not None and manifest.digest != expected_digest:
        raise StagingError(
            None,
            f"manifest digest {manifest.digest} is not the announced {expected_digest}",
            kind="manifest",
            version=version,
        )
    return manifest


def parse_manifest(raw: str | bytes, version: int, *, expected_digest: str | None = None, where: str) -> WeightManifest:
    """A manifest read from `where` (JSON), validated and checked as `check_manifest` does."""
    try:
        manifest = WeightManifest.model_validate_json(raw)
    except ValidationError as e:
        raise StagingError(None, f"invalid manifest from {where}: {e}", kind="manifest", version=version) from e
    return check_manifest(manifest, version, expected_digest=expected_digest, where=where)


# --------------------------------------------------------------------------------------------------- layout and URIs


def version_dir(root: Path, version: int, digest: str = "") -> Path:
    """Where `version` with manifest digest `digest` lives under the store root `root` (content-addressed:
    `v000010-<digest[:12]>`; without a digest the older, plain `v000010`)."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return root / (f"v{version:06d}-{digest[:DIGEST_PREFIX]}" if digest else f"v{version:06d}")


def version_path(uri: str, version: int) -> Path:
    """The directory a version URI names, checked to be a directory of `version` (the command's version, never
    read from the folder's name alone): a URI that is not is a StagingError naming both."""
    path = path_from_uri(uri).absolute()
    m = VERSION_DIR.match(path.name)
    if m is None or int(m.group(1)) != version:
        raise StagingError(
            None, f"{uri!r} is not the directory of version {version}", kind="not_found", version=version
        )
    return path


def path_from_uri(uri: str) -> Path:
    """The local path a staging URI (`file://` or a plain path) names; ValueError naming any other scheme."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI {uri!r} names host {parsed.netloc!r}; only local paths are supported")
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return Path(uri)
    raise ValueError(f"unknown staging URI scheme {parsed.scheme!r} in {uri!r}; supported: file:// or a plain path")


def version_root(uri: str, version: int) -> Path:
    """The store root holding `version` at the version URI a command names (StagedUpdate.uri / UpdateStaged carry
    it). The version is the caller's (the command's), never read from the folder's name: a URI that is not that
    version's directory is a StagingError naming both."""
    return version_path(uri, version).parent


# --------------------------------------------------------------------------------------------------- the file format


_NAME_TO_ST = {v: k for k, v in _ST_TO_NAME.items()}


def safetensors_layout(
    tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]
) -> tuple[bytes, dict[str, int]]:
    """The head of a safetensors file (8-byte little-endian length + JSON header padded with spaces) for `tensors`
    given as (name, manifest dtype name, shape, nbytes), and each tensor's absolute offset in the file. Laid out as
    the safetensors library lays out its own files (largest element size first, then by name, so every tensor stays
    aligned), so `safe_open`, vLLM's loader and `read_header` read it alike (tests/test_staging.py checks this
    against `safetensors.torch.load_file`). For writing into an existing file, which the library cannot do."""
    order = sorted(tensors, key=lambda t: (-DTYPE_SIZES[t[1]], t[0]))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    rel, at = {}, 0
    for name, dtype, shape, nbytes in order:
        header[name] = {"dtype": _NAME_TO_ST[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        rel[name] = at
        at += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _HEADER_ALIGN)
    base = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {name: base + off for name, off in rel.items()}


def overwrite_safetensors(path: Path, head: bytes, pieces: list[tuple[int, memoryview]], size: int) -> None:
    """Write a safetensors file into the existing file `path` in place (its size set to `size`): `head` at 0, each
    (offset, bytes) piece at its offset. Overwriting pages the page cache already holds costs a fraction of a new
    file's, whose pages must first be found (bench/bench_transport.py)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        for offset, data in [(0, memoryview(head)), *pieces]:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str  # manifest name, or the raw safetensors code when unknown
    shape: tuple[int, ...]
    start: int  # absolute file offsets
    end: int


def open_weights(path: Path, version: int | None) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StagingError(None, f"weights file {str(path)!r} does not exist", kind="not_found", version=version)
    except OSError as e:
        raise StagingError(None, f"cannot open {str(path)!r}: {e}", kind="unreadable", version=version) from e


def read_header(fd: int, version: int | None) -> tuple[list[HeaderEntry], int]:
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
    entries: list[HeaderEntry] = []
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
        entries.append(HeaderEntry(name, _ST_TO_NAME.get(code, code), shape, base + start, base + end))
    entries.sort(key=lambda e: e.start)
    return entries, size


def check_against_manifest(
    entries: list[HeaderEntry], size: int, manifest: WeightManifest
) -> list[tuple[HeaderEntry, TensorEntry]]:
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
