"""The archive of one run's log, as stored and as read: segment files, their manifest in Redis
(`keys.archive_key`), reading and verifying a segment, and the one reader that yields a run's entries from archive +
live stream as one log (`scan_run`, `iter_run`). The archiver that writes segments and trims the live stream behind
them is events/archiver.py (archive, then trim).

Segment files live in `<run dir>/archive/` and are named by their first and last stream ids:
`<first>_<last>.msgpack` holds the raw entries, one msgpack array `[stream id, {field: value}]` per entry (`e` = the
codec bytes, `t` = the event type), readable with any msgpack tool (`python -m msgpack`, `msgpack2json -c`);
`<first>_<last>.json` beside it holds first id, last id, count and the file's digest (xxh3-128 of its bytes). The
manifest hash in Redis repeats count and digest per segment, so an altered file *and* an altered sidecar are both
caught, and a deleted file is reported by its ids.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import redis
import xxhash

from rolledger.events.keys import archive_key, log_key
from rolledger.events.scan import LogScan, add_entry, scan_log
from rolledger.events.store import StoredEvent, as_str

ARCHIVE_DIRNAME = "archive"
SEGMENT_SUFFIX = ".msgpack"
INDEX_SUFFIX = ".json"
DIGEST_ALGO = "xxh3_128"
PAGE = 1000

# Manifest fields (archive_key hash).
M_DIR = "dir"  # absolute path of the segment directory when the segments were written
M_LAST = "last"  # stream id of the last archived entry
M_COUNT = "count"  # entries archived, all segments together
M_TRIMMED = "trimmed"  # the MINID the live stream was last trimmed to
SEG_PREFIX = "seg:"  # seg:<first>:<last> -> "<count> <digest>"


def position(stream_id: str) -> tuple[int, int]:
    """A stream id `ms-seq` as a sortable pair."""
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def successor(stream_id: str) -> str:
    """The smallest stream id after `stream_id`."""
    ms, seq = position(stream_id)
    return f"{ms}-{seq + 1}"


def archive_dir(run_dir: Path) -> Path:
    """Where a run directory keeps its segments."""
    return run_dir / ARCHIVE_DIRNAME


@dataclass(frozen=True)
class Segment:
    """One archived segment as the manifest records it."""

    first_id: str
    last_id: str
    count: int
    digest: str

    @property
    def name(self) -> str:
        return f"{self.first_id}_{self.last_id}"

    def ids(self) -> str:
        return f"{self.first_id}..{self.last_id}"


@dataclass(frozen=True)
class Manifest:
    directory: Path | None
    last_id: str | None
    count: int
    trimmed: str | None
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class SegmentProblem:
    """A segment the reader could not use: its ids and why (missing, tampered, out of order), or entries lost
    between the archive and the live stream."""

    first_id: str
    last_id: str
    reason: str

    def line(self) -> str:
        return f"archived segment {self.first_id}..{self.last_id}: {self.reason}"


@dataclass
class RunScan(LogScan):
    """A read-only pass over archive + live stream: `LogScan`'s entries in log order, plus the segment problems."""

    problems: list[SegmentProblem] = field(default_factory=list)


class SegmentError(Exception):
    def __init__(self, segment: Segment, reason: str) -> None:
        super().__init__(f"archived segment {segment.ids()}: {reason}")
        self.segment = segment
        self.reason = reason


# ---------------------------------------------------------------------- manifest


def read_manifest(client: redis.Redis, run_id: str) -> Manifest:
    raw: Any = client.hgetall(archive_key(run_id))
    fields = {as_str(k): as_str(v) for k, v in (raw or {}).items()}
    segments = []
    for name, value in fields.items():
        if not name.startswith(SEG_PREFIX):
            continue
        first, _, last = name.removeprefix(SEG_PREFIX).partition(":")
        count, _, digest = value.partition(" ")
        segments.append(Segment(first, last, int(count), digest))
    segments.sort(key=lambda s: position(s.first_id))
    return Manifest(
        directory=Path(fields[M_DIR]) if M_DIR in fields else None,
        last_id=fields.get(M_LAST),
        count=int(fields.get(M_COUNT, 0)),
        trimmed=fields.get(M_TRIMMED),
        segments=tuple(segments),
    )


def trimmed_before(client: redis.Redis, run_id: str) -> str | None:
    """The MINID the live stream was trimmed to (entries below it are only in the archive); None if never trimmed."""
    got = client.hget(archive_key(run_id), M_TRIMMED)
    return as_str(got) if got is not None else None


# ---------------------------------------------------------------------- segment files


def pack_fields(fields: dict[bytes, bytes]) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for k, v in (fields or {}).items():
        name = as_str(k)
        if name == "t":
            try:
                out[name] = v.decode()
                continue
            except UnicodeDecodeError:
                pass
        out[name] = v
    return out


def _unpack_fields(fields: dict[str, Any]) -> dict[bytes, bytes]:
    return {k.encode(): (v if isinstance(v, bytes) else str(v).encode()) for k, v in fields.items()}


def _digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return f"{DIGEST_ALGO}:{h.hexdigest()}"


def load_segment(directory: Path | None, segment: Segment) -> list[tuple[str, dict[bytes, bytes]]]:
    """The entries of a segment, verified against the manifest (digest, count, first and last id, order)."""
    if directory is None:
        raise SegmentError(segment, "missing: the run has no archive directory")
    path = directory / (segment.name + SEGMENT_SUFFIX)
    if not path.is_file():
        raise SegmentError(segment, f"missing: no file {path}")
    digest = _digest(path)
    if digest != segment.digest:
        raise SegmentError(segment, f"tampered: {path} has digest {digest}, the manifest recorded {segment.digest}")
    entries: list[tuple[str, dict[bytes, bytes]]] = []
    try:
        with path.open("rb") as f:
            for item in msgpack.Unpacker(f, raw=False, strict_map_key=False):
                entries.append((str(item[0]), _unpack_fields(item[1])))
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise SegmentError(segment, f"unreadable: {path}: {exc}") from None
    if len(entries) != segment.count:
        raise SegmentError(segment, f"holds {len(entries)} entries, the manifest recorded {segment.count}")
    ids = [position(e[0]) for e in entries]
    if entries and (entries[0][0] != segment.first_id or entries[-1][0] != segment.last_id):
        raise SegmentError(segment, f"runs {entries[0][0]}..{entries[-1][0]}, not the ids it is named by")
    if any(a >= b for a, b in itertools.pairwise(ids)):
        raise SegmentError(segment, "its entry ids are not increasing")
    return entries


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so a rename or a new entry in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- reading archive + live as one log


def _resolve_dir(manifest: Manifest, directory: Path | None) -> Path | None:
    if directory is not None and directory.is_dir():
        return directory
    return manifest.directory if manifest.directory is not None else directory


def _after(stream_id: str, start: str) -> bool:
    if start in ("-", ""):
        return True
    if start.startswith("("):
        return position(stream_id) > position(start[1:])
    return position(stream_id) >= position(start)


def scan_run(
    client: redis.Redis, run_id: str, directory: Path | None = None, start: str = "-", *, batch: int = PAGE
) -> RunScan:
    """Every entry of the run from `start` on, archived segments first then the live stream, decoded or reported
    (as `scan_log` does), plus every segment problem: a missing or tampered segment (named by its ids; its entries
    are not in the result) and entries lost between the archive and the live stream. Writes nothing.

    `directory`: where to look for segments first (e.g. `<run dir>/archive` of a moved run); else the directory the
    manifest recorded."""
    manifest = read_manifest(client, run_id)
    out = RunScan()
    where = _resolve_dir(manifest, directory)
    prev: str | None = None
    for seg in manifest.segments:
        if prev is not None and position(seg.first_id) <= position(prev):
            out.problems.append(SegmentProblem(seg.first_id, seg.last_id, f"overlaps the segment ending at {prev}"))
            continue
        prev = seg.last_id
        if not _after(seg.last_id, start):
            continue
        try:
            entries = load_segment(where, seg)
        except SegmentError as exc:
            out.problems.append(SegmentProblem(seg.first_id, seg.last_id, exc.reason))
            continue
        for raw_id, fields in entries:
            if not _after(raw_id, start):
                continue
            add_entry(out, raw_id, fields)
    lo = start
    if manifest.last_id is not None and _after(manifest.last_id, start):
        lo = "(" + manifest.last_id
    live = scan_log(client, run_id, lo, batch=batch)
    out.entries.extend(live.entries)
    out.undecodable.extend(live.undecodable)
    if manifest.last_id is not None and start in ("-", ""):
        out.problems.extend(_continuity(client, run_id, manifest, live.length))
    return out


def _continuity(client: redis.Redis, run_id: str, manifest: Manifest, live_after: int) -> list[SegmentProblem]:
    """Entries the stream ever took (XINFO STREAM entries-added) = archived + live after the archive: else some
    were lost between them (trimmed unarchived, or deleted)."""
    problems = []
    archived = sum(s.count for s in manifest.segments)
    first = manifest.segments[0].first_id if manifest.segments else "0-0"
    last = manifest.last_id or "0-0"
    if archived != manifest.count:
        problems.append(
            SegmentProblem(first, last, f"the manifest counts {manifest.count} entries, its segments {archived}")
        )
    try:
        info: Any = client.xinfo_stream(log_key(run_id))
    except redis.ResponseError:
        return problems
    added = info.get("entries-added")
    if added is not None and int(added) != manifest.count + live_after:
        lost = int(added) - manifest.count - live_after
        problems.append(
            SegmentProblem(
                first,
                last,
                f"the stream took {added} entries; the archive holds {manifest.count} and the live stream "
                f"{live_after} after it: {lost} missing from both",
            )
        )
    return problems


def iter_run(
    client: redis.Redis, run_id: str, directory: Path | None = None, start: str = "-"
) -> Iterator[StoredEvent]:
    """The run's decoded events from archive + live stream (undecodable entries skipped); raises SegmentError-like
    `ArchiveBroken` when a segment is missing or tampered, since a caller folding the log must not skip part of it."""
    scan = scan_run(client, run_id, directory, start)
    if scan.problems:
        raise ArchiveBroken(scan.problems)
    yield from scan.entries


class ArchiveBroken(Exception):
    """A reader that needs the whole log found archived segments missing or tampered."""

    def __init__(self, problems: list[SegmentProblem]) -> None:
        super().__init__("; ".join(p.line() for p in problems))
        self.problems = problems
