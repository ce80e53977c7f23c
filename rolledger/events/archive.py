"""Archive, then trim: the run log's old entries move to segment files, and Redis keeps only a live window.

Owns the archive of one run: segment files, their manifest in Redis (`keys.archive_key`), the safe trim point, the
trim itself (XTRIM MINID, never MAXLEN: reference notes 1.4), pruning the dedupe hash behind it, and the one reader
that yields a run's entries from archive + live stream as one log (`scan_run`, `iter_run`).

Segment files live in `<run dir>/archive/` and are named by their first and last stream ids:
`<first>_<last>.msgpack` holds the raw entries, one msgpack array `[stream id, {field: value}]` per entry (`e` = the
codec bytes, `t` = the event type), readable with any msgpack tool (`python -m msgpack`, `msgpack2json -c`);
`<first>_<last>.json` beside it holds first id, last id, count and the file's digest (xxh3-128 of its bytes). The
manifest hash in Redis repeats count and digest per segment, so an altered file *and* an altered sidecar are both
caught, and a deleted file is reported by its ids.

Order of one archiver pass (`Archiver.run_once`), each step idempotent, so a crash anywhere loses and duplicates
nothing:

1. The safe point: every entry below it is needed by no one. It stays behind each consumer group's next undelivered
   entry and its oldest pending entry, behind the latest reducer snapshot (a restarted follower rebuilds from the
   snapshot + the tail after it), and at least `keep_live` entries behind the end (live followers tail the stream).
2. Entries after the manifest's last archived id and below the safe point are written to a temp file, renamed into
   place, re-read and verified (digest, count, ids). A crash here leaves an orphan file the next pass removes.
   A full disk (ENOSPC, EDQUOT) anywhere in this step removes what it wrote and raises `DiskFull` naming the file
   (events/disk_full.py): nothing is recorded, nothing trimmed, the entries stay in Redis for a later pass.
3. The segment is recorded in the manifest with a compare-and-set on the last archived id (one Lua call): two
   archivers cannot both record one range.
4. XTRIM MINID to just after the last archived id (never past the safe point), then the dedupe hash's event ids whose
   stream id fell below it are deleted. A crash before this step only delays the trim to the next pass.

Idempotent appends after pruning: an append retried while its original entry is still in the live window returns
the original stream id, as before; a retry of an event already archived and trimmed (at least `keep_live` entries
and a snapshot ago) would be written again. `once:` keys (append_once guards, one per staged version) are kept.
"""

from __future__ import annotations

import itertools
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import redis
import structlog
import xxhash

from rolledger.events.disk_full import DiskFull, is_disk_full
from rolledger.events.keys import archive_key, dedupe_key, log_key
from rolledger.events.scan import LogScan, add_entry, scan_log
from rolledger.events.snapshots import latest_snapshot
from rolledger.events.store import StoredEvent, as_str

log = structlog.get_logger("archive")

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

# KEYS: manifest. ARGV: expected last archived id ('' = none yet), segment field, "<count> <digest>", new last id,
# count, directory. Records the segment only if nobody recorded another since the caller read the manifest.
_RECORD_LUA = """
local last = redis.call('HGET', KEYS[1], 'last') or ''
if last ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3], 'last', ARGV[4], 'dir', ARGV[6])
redis.call('HINCRBY', KEYS[1], 'count', tonumber(ARGV[5]))
return 1
"""


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


def _pack_fields(fields: dict[bytes, bytes]) -> dict[str, bytes | str]:
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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------- the archiver


@dataclass(frozen=True)
class ArchivePass:
    """What one archiver pass did."""

    segments: tuple[Segment, ...]  # the segments written
    trimmed: int  # entries the live stream lost to XTRIM (all of them archived before)
    trimmed_to: str | None  # the MINID
    pruned: int  # dedupe fields deleted
    live: int  # entries left in the live stream


class Archiver:
    """Archives a run's log into `directory` and trims the live stream behind it (see the module docstring).

    `keep_live`: entries always left in the live stream (tailing followers read them); `archive_every`: a pass writes
    a segment only once at least this many entries beyond `keep_live` are waiting (segments are about this long)."""

    def __init__(
        self, client: redis.Redis, run_id: str, directory: Path, *, keep_live: int = 10_000, archive_every: int = 10_000
    ) -> None:
        if keep_live < 0:
            raise ValueError(f"keep_live must be >= 0, got {keep_live}")
        if archive_every < 1:
            raise ValueError(f"archive_every must be >= 1, got {archive_every}")
        self.client = client
        self.run_id = run_id
        self.directory = directory.absolute()
        self.keep_live = keep_live
        self.archive_every = archive_every
        self.key = log_key(run_id)
        self._record = client.register_script(_RECORD_LUA)

    # ------------------------------------------------------------------ the safe point
    def safe_point(self) -> str:
        """Entries with ids below this are needed by no consumer group (delivered and acknowledged) and covered by
        the latest snapshot. "0-1" (nothing can go) when the run has no snapshot."""
        bounds: list[str] = []
        snap = latest_snapshot(self.client, self.run_id)
        bounds.append(successor(snap.stream_id) if snap is not None else "0-1")
        try:
            groups: Any = self.client.xinfo_groups(self.key)
        except redis.ResponseError:  # no stream yet
            groups = []
        for g in groups:
            bounds.append(successor(as_str(g["last-delivered-id"])))
            if int(g["pending"]) > 0:
                summary: Any = self.client.xpending(self.key, g["name"])
                if summary.get("min") is not None:
                    bounds.append(as_str(summary["min"]))
        return min(bounds, key=position)

    # ------------------------------------------------------------------ steps
    def write_segment(self, below: str, max_entries: int) -> Segment | None:
        """Write the entries after the last archived one with ids below `below` (at most `max_entries`) to a new
        verified segment and record it in the manifest; None when there is nothing to write (or another archiver
        recorded a segment meanwhile: this one's file is then removed)."""
        if max_entries < 1:
            return None
        manifest = read_manifest(self.client, self.run_id)
        try:
            return self._write_segment(manifest, below, max_entries)
        except OSError as e:  # nothing recorded: the entries stay in Redis, untrimmed, for a later pass
            if not is_disk_full(e) or isinstance(e, DiskFull):
                raise
            raise DiskFull(e.filename or self.directory, "archive segment", e) from e

    def _write_segment(self, manifest: Manifest, below: str, max_entries: int) -> Segment | None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_orphans(manifest)
        lo = "(" + manifest.last_id if manifest.last_id else "-"
        limit = position(below)
        tmp = self.directory / f".segment.{uuid.uuid4().hex}.tmp"
        h = xxhash.xxh3_128()
        count, first, last = 0, "", ""
        try:
            with tmp.open("wb") as f:
                while count < max_entries:
                    page: Any = self.client.xrange(self.key, lo, "+", count=min(PAGE, max_entries - count))
                    done = not page
                    for raw_id, fields in page or []:
                        sid = as_str(raw_id)
                        if position(sid) >= limit:
                            done = True
                            break
                        data = msgpack.packb([sid, _pack_fields(fields)], use_bin_type=True)
                        f.write(data)
                        h.update(data)
                        first = first or sid
                        last = sid
                        count += 1
                    if done or len(page) < PAGE:
                        break
                    lo = "(" + last
                f.flush()
                os.fsync(f.fileno())
            if count == 0:
                tmp.unlink()
                return None
            segment = Segment(first, last, count, f"{DIGEST_ALGO}:{h.hexdigest()}")
            path = self.directory / (segment.name + SEGMENT_SUFFIX)
            os.replace(tmp, path)
        except OSError as e:
            if is_disk_full(e):
                raise DiskFull(tmp, "archive segment", e) from e
            raise
        finally:
            tmp.unlink(missing_ok=True)
        index = {
            "run_id": self.run_id,
            "first_id": first,
            "last_id": last,
            "count": count,
            "digest": segment.digest,
            "format": "msgpack: one [stream id, {field: value}] per entry; e = event codec bytes, t = event type",
        }
        try:
            _write_atomic(path.with_suffix(INDEX_SUFFIX), (json.dumps(index, indent=2) + "\n").encode())
            fsync_path(self.directory)
        except OSError as e:  # a segment without its index is an orphan: remove it now, its room with it
            path.unlink(missing_ok=True)
            if is_disk_full(e):
                raise DiskFull(path.with_suffix(INDEX_SUFFIX), "archive segment", e) from e
            raise
        load_segment(self.directory, segment)  # verify what is on disk before anything relies on it
        recorded = self._record(
            keys=[archive_key(self.run_id)],
            args=[
                manifest.last_id or "",
                f"{SEG_PREFIX}{first}:{last}",
                f"{count} {segment.digest}",
                last,
                count,
                str(self.directory),
            ],
        )
        if int(recorded) != 1:  # another archiver recorded a segment since we read the manifest
            path.unlink(missing_ok=True)
            path.with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)
            return None
        return segment

    def trim(self) -> tuple[int, str | None, int]:
        """XTRIM MINID to just after the last archived entry, never past the safe point; then prune the dedupe hash
        below the same id. Returns (entries trimmed, the MINID or None, dedupe fields pruned)."""
        manifest = read_manifest(self.client, self.run_id)
        if manifest.last_id is None:
            return 0, None, 0
        minid = min(successor(manifest.last_id), self.safe_point(), key=position)
        if position(minid) <= (0, 1):
            return 0, None, 0
        trimmed = int(self.client.xtrim(self.key, minid=minid, approximate=False))
        previous = manifest.trimmed
        if previous is None or position(minid) > position(previous):
            self.client.hset(archive_key(self.run_id), M_TRIMMED, minid)
        return trimmed, minid, self._prune_dedupe(minid)

    def _prune_dedupe(self, minid: str) -> int:
        limit = position(minid)
        stale: list[bytes] = []
        pruned = 0
        key = dedupe_key(self.run_id)
        for name, value in self.client.hscan_iter(key, count=1000):
            if name.startswith(b"once:"):
                continue
            try:
                below = position(as_str(value)) < limit
            except ValueError:
                continue
            if below:
                stale.append(name)
            if len(stale) >= 1000:
                pruned += int(self.client.hdel(key, *stale))
                stale = []
        if stale:
            pruned += int(self.client.hdel(key, *stale))
        return pruned

    def _remove_orphans(self, manifest: Manifest) -> None:
        """Files of segments a crashed pass wrote but never recorded (ids after the last recorded one), and temps."""
        recorded = {s.name for s in manifest.segments}
        after = position(manifest.last_id) if manifest.last_id else (0, 0)
        for path in self.directory.iterdir():
            if path.name.startswith(".segment.") or (path.name.startswith(".") and path.name.endswith(".tmp")):
                path.unlink(missing_ok=True)
                continue
            if path.suffix not in (SEGMENT_SUFFIX, INDEX_SUFFIX) or path.stem in recorded:
                continue
            first = path.stem.partition("_")[0]
            try:
                if position(first) > after:
                    path.unlink(missing_ok=True)
            except ValueError:
                continue

    # ------------------------------------------------------------------ one pass
    def due(self, live: int) -> bool:
        return live - self.keep_live >= self.archive_every

    def run_once(self, *, force: bool = False) -> ArchivePass:
        """One pass: while at least `archive_every` entries wait beyond `keep_live`, archive them in segments of
        `archive_every` (with `force`: everything beyond `keep_live`, the last segment shorter), then trim behind the
        archive."""
        manifest = read_manifest(self.client, self.run_id)
        if manifest.last_id is not None and (
            manifest.trimmed is None or position(manifest.trimmed) <= position(manifest.last_id)
        ):
            self.trim()  # a pass that died after recording its segment: finish it, so the live count below is right
        live = int(self.client.xlen(self.key))
        waiting = live - self.keep_live
        segments: list[Segment] = []
        below = self.safe_point() if (force and waiting > 0) or self.due(live) else None
        while below is not None and (waiting >= self.archive_every or (force and waiting > 0)):
            segment = self.write_segment(below, min(self.archive_every, waiting))
            if segment is None:
                break
            segments.append(segment)
            waiting -= segment.count
        trimmed, minid, pruned = self.trim()
        result = ArchivePass(tuple(segments), trimmed, minid, pruned, int(self.client.xlen(self.key)))
        if segments or trimmed:
            log.info(
                "log archived",
                run=self.run_id,
                segments=[s.ids() for s in segments],
                entries=sum(s.count for s in segments),
                trimmed=trimmed,
                trimmed_to=minid,
                dedupe_pruned=pruned,
                live=result.live,
            )
        return result


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
