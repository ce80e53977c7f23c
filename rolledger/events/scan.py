"""A read-only scan of a run's log: every entry, decoded or not, and nothing written.

`EventLog.read` (events/store.py) is the reader of live workers: it dead-letters an undecodable entry into the run's
Redis as it passes it, once. `audit` and `replay` must not change the run they look at, so they read through this
module instead: `scan_log` pages XRANGE over the log and returns the decoded events in log order plus, for every
event (or whole entry) that could not be decoded, its stream id, the type its `t` field names (if any) and the
reason. An entry may hold several events (events/store.py `entry_payloads`). It issues only XRANGE/XLEN/EXISTS
(reads), never XADD, EVAL or HSET.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from rolledger.events.codec import DecodeError, decode
from rolledger.events.keys import log_key
from rolledger.events.store import (
    DeadLetter,
    MalformedEntry,
    StoredEvent,
    as_str,
    entry_payloads,
    entry_types,
    event_reason,
)
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
    scanned: int = 0  # stream entries looked at

    @property
    def length(self) -> int:
        """How many stream entries the scan looked at, decoded or not (an entry holds one append's events)."""
        return self.scanned


def scan_entry(raw_id: Any, fields: Any) -> list[StoredEvent | Undecodable]:
    """One XRANGE entry as its events, each decoded or the reason it is none (the whole entry's, when it holds no
    event bytes at all)."""
    stream_id = as_str(raw_id)
    types = entry_types(fields)
    try:
        payloads = entry_payloads(fields)
    except MalformedEntry as exc:
        return [Undecodable(stream_id, ",".join(types) or None, exc.reason)]
    out: list[StoredEvent | Undecodable] = []
    for k, data in enumerate(payloads):
        try:
            out.append(StoredEvent(stream_id, decode(data)))
        except DecodeError as exc:
            named = types[k] if len(types) == len(payloads) else None
            reason = event_reason(None if len(payloads) == 1 else k, exc.reason)
            out.append(Undecodable(stream_id, named or exc.event_type, reason))
    return out


def add_entry(scan: LogScan, raw_id: Any, fields: Any) -> None:
    """Add one XRANGE entry's events (decoded or reported) to `scan`."""
    scan.scanned += 1
    for item in scan_entry(raw_id, fields):
        if isinstance(item, Undecodable):
            scan.undecodable.append(item)
        else:
            scan.entries.append(item)


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
            add_entry(out, raw_id, fields)
        if not page or len(page) < batch:
            return out
        lo = "(" + as_str(page[-1][0])


def log_exists(client: redis.Redis, run_id: str) -> bool:
    """Whether the run has a log with at least one entry."""
    return int(client.exists(log_key(run_id))) > 0 and int(client.xlen(log_key(run_id))) > 0


def read_dead_letters(client: redis.Redis, run_id: str) -> list[DeadLetter]:
    """The run's dead-letter entries (a read: XRANGE only)."""
    return _read_dead_letters(client, run_id)
