"""A read-only scan of a run's log: every entry, decoded or not, and nothing written.

`EventLog.read` (events/store.py) is the reader of live workers: it dead-letters an undecodable entry into the run's
Redis as it passes it, once. `audit` and `replay` must not change the run they look at, so they read through this
module instead: `scan_log` pages XRANGE over the log and returns the decoded entries in log order plus, for every
entry that could not be decoded, its stream id, the type its `t` field names (if any) and the reason. It issues only
XRANGE/XLEN/EXISTS (reads), never XADD, EVAL or HSET.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from rolledger.events.codec import DecodeError, decode
from rolledger.events.keys import log_key
from rolledger.events.store import PAYLOAD_FIELD, PAYLOAD_LOST, TYPE_FIELD, DeadLetter, StoredEvent, as_str
from rolledger.events.store import read_dead_letters as _read_dead_letters


@dataclass(frozen=True)
class Undecodable:
    """A log entry that is not an event: where it is, what its `t` field says it is, and why it did not decode."""

    stream_id: str
    event_type: str | None
    reason: str


@dataclass
class LogScan:
    """What a read-only pass over the log found."""

    entries: list[StoredEvent] = field(default_factory=list)
    undecodable: list[Undecodable] = field(default_factory=list)

    @property
    def length(self) -> int:
        """How many entries the log holds (decoded or not)."""
        return len(self.entries) + len(self.undecodable)


def scan_entry(raw_id: Any, fields: Any) -> StoredEvent | Undecodable:
    """One XRANGE entry as an event or as the reason it is none."""
    stream_id = as_str(raw_id)
    fields = fields or {}
    type_field = fields.get(TYPE_FIELD)
    event_type = as_str(type_field) if type_field is not None else None
    data = fields.get(PAYLOAD_FIELD)
    if data is None:
        reason = PAYLOAD_LOST if not fields else f"entry has no {PAYLOAD_FIELD!r} field"
        return Undecodable(stream_id, event_type, reason)
    try:
        return StoredEvent(stream_id, decode(data))
    except DecodeError as exc:
        return Undecodable(stream_id, event_type or exc.event_type, exc.reason)


def scan_log(client: redis.Redis, run_id: str, start: str = "-", end: str = "+", *, batch: int = 1000) -> LogScan:
    """Every entry of the run's log in [start, end], decoded or reported; writes nothing."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    key = log_key(run_id)
    out = LogScan()
    lo = start
    while True:
        page: Any = client.xrange(key, lo, end, count=batch)
        for raw_id, fields in page or []:
            item = scan_entry(raw_id, fields)
            if isinstance(item, Undecodable):
                out.undecodable.append(item)
            else:
                out.entries.append(item)
        if not page or len(page) < batch:
            return out
        lo = "(" + as_str(page[-1][0])


def log_exists(client: redis.Redis, run_id: str) -> bool:
    """Whether the run has a log with at least one entry."""
    return int(client.exists(log_key(run_id))) > 0 and int(client.xlen(log_key(run_id))) > 0


def read_dead_letters(client: redis.Redis, run_id: str) -> list[DeadLetter]:
    """The run's dead-letter entries (a read: XRANGE only)."""
    return _read_dead_letters(client, run_id)
