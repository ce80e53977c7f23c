"""Archive, then trim: the run log's old entries move to segment files, and Redis keeps only a live window.

Owns the pass that writes the archive of one run (its format and its reader are events/archive.py): the safe trim
point, writing, verifying and recording a segment, the trim itself (XTRIM MINID, never MAXLEN: reference notes 1.4)
and pruning the dedupe hash behind it.

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
and a snapshot ago) would be written again. `once:` keys (append_once's single-writer guards: a step, a staged version,
a group consumed or dropped) are pruned by the same rule, but for the run's end (`once:run-finished`), which stays.
A step and a staged version are numbered and their numbers only grow: before their keys go, the sequence's floor
field (`floor:once:step:`, `floor:once:UpdateStaged:v`) is raised past them, and the append script refuses any key at
or below it, so no trainer, however stale its view, takes a step or stages a version twice. A group's key has no
order to keep; it goes like an event id, a retry of it possible only from a view older than the live window and the
latest snapshot. Without this the hash grew by three fields per step (`./dev chaos --soak 4`: 1.8 KB -> 789 KB in 2,742
steps, Redis x1.56).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import redis
import structlog
import xxhash

from rolledger.events.archive import (
    DIGEST_ALGO,
    INDEX_SUFFIX,
    M_TRIMMED,
    PAGE,
    SEG_PREFIX,
    SEGMENT_SUFFIX,
    Manifest,
    Segment,
    fsync_path,
    load_segment,
    pack_fields,
    position,
    read_manifest,
    successor,
)
from rolledger.events.disk_full import DiskFull, is_disk_full
from rolledger.events.entries import FINISHED_FIELD
from rolledger.events.keys import archive_key, dedupe_key, log_key
from rolledger.events.snapshots import latest_snapshot
from rolledger.events.store import as_str
from rolledger.events.store_scripts import FLOOR_PREFIX, ONCE_SEQUENCES, RAISE_FLOOR_LUA

log = structlog.get_logger("archive")

_FLOOR = FLOOR_PREFIX.encode()
_FINISHED = FINISHED_FIELD.encode()
_SEQUENCES = tuple(f"once:{p}".encode() for p in ONCE_SEQUENCES)


def _numbered(name: bytes) -> tuple[str, int] | None:
    """(its sequence's floor field, its number) for a `once:` key of a growing sequence, else None."""
    for prefix in _SEQUENCES:
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            return (_FLOOR + prefix).decode(), int(name[len(prefix) :])
    return None


# KEYS: manifest. ARGV: expected last archived id ('' = none yet), segment field, "<count> <digest>", new last id,
# count, directory. Records the segment only if nobody recorded another since the caller read the manifest.
_RECORD_LUA = """
local last = redis.call('HGET', KEYS[1], 'last') or ''
if last ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3], 'last', ARGV[4], 'dir', ARGV[6])
redis.call('HINCRBY', KEYS[1], 'count', tonumber(ARGV[5]))
return 1
"""


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
        self._raise_floor = client.register_script(RAISE_FLOOR_LUA)

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
                        data = msgpack.packb([sid, pack_fields(fields)], use_bin_type=True)
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
        """Delete the dedupe fields whose stream id fell below `minid`: event ids, and `once:` keys but the run's end.
        A numbered key of a growing sequence (a step, a staged version) goes only after its sequence's floor was
        raised past it, so the append script still refuses it (a crash between the two leaves both: harmless)."""
        limit = position(minid)
        stale: list[bytes] = []
        floored: list[bytes] = []
        floors: dict[str, int] = {}
        pruned = 0
        key = dedupe_key(self.run_id)
        for name, value in self.client.hscan_iter(key, count=1000):
            if name.startswith(_FLOOR) or name == _FINISHED:
                continue
            try:
                below = position(as_str(value)) < limit
            except ValueError:
                continue
            if not below:
                continue
            numbered = _numbered(name)
            if numbered is not None:
                field, number = numbered
                floors[field] = max(number, floors.get(field, -1))
                floored.append(name)
                continue
            stale.append(name)
            if len(stale) >= 1000:
                pruned += int(self.client.hdel(key, *stale))
                stale = []
        for field, number in floors.items():
            self._raise_floor(keys=[key], args=[field, number])
        for batch in (stale, *(floored[i : i + 1000] for i in range(0, len(floored), 1000))):
            if batch:
                pruned += int(self.client.hdel(key, *batch))
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
