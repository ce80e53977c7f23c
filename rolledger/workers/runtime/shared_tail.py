"""One tail of a run's log per process: the log is read and decoded once, and every Follower of the process
(workers/runtime/runtime.py) folds the same decoded events.

`shared_tail(log)` returns the process's `SharedTail` for the log's run and Redis connection pool (one per pair,
kept while a follower uses it). A tail holds a buffer of decoded entries: everything after `start` up to `scanned`
(the last entry looked at, malformed ones included). A follower asks for the entries after its position:

- served from the buffer when the buffer has them (no Redis command, no decode);
- `through`: the caller needs at least everything up to that id (a `catch_up`'s "the whole log as of this call"):
  read now when the buffer stops short of it;
- `block_ms`: when nothing is there, one blocking XREAD for the whole process.

Only one thread reads the log at a time (`_fetch`); the others wait for it with their own deadline and then find
its entries in the buffer, so N followers cost one read and one decode per entry, not N. A follower behind the
buffer (one created late, starting from the first entry) reads that gap itself, then joins the buffer. Entries every
registered follower has folded leave the buffer. Decoded events are shared between followers: events are frozen
records and the reducer copies what it keeps, so no follower can change another's. A work consumer of the same process
(the reward worker's SampleFinished, a rank's GroupAdmitted) gets the very event the tail decoded, or the tail the one
it decoded (events/codec.SharedDecodes): one decode per event per process.

Trust: the tail reads the run's own live log, which only rolledger's processes write (every append goes through
`events.codec.encode`), and says so (`Trust.OWN_LOG`); since events became msgspec records both trusts decode alike,
every field checked, and a malformed entry is still dead-lettered. `replay`, `audit` and `lineage` read with
`Trust.VALIDATE` (they may be given a log from anywhere).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from rolledger.events.codec import Trust
from rolledger.events.store import EventLog, StoredEvent
from rolledger.workflows.replay import position

T = TypeVar("T")


class PerRun(Generic[T]):
    """One object per run and Redis connection pool in this process (a shared tail, a shared fold): made on first
    use, kept while someone holds it."""

    def __init__(self) -> None:
        self._made: weakref.WeakValueDictionary[tuple[int, str], T] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def get(self, log: EventLog, make: Callable[[EventLog], T]) -> T:
        key = (id(getattr(log.client, "connection_pool", log.client)), log.run_id)  # a cluster client has no pool
        with self._lock:
            found = self._made.get(key)
            if found is None:
                found = self._made[key] = make(log)
            return found


class Position(Protocol):
    """What the tail needs of a follower: how far it has folded."""

    last_id: str


class SharedTail:
    """See the module docstring."""

    def __init__(self, log: EventLog) -> None:
        self.log = EventLog(log.client, log.run_id)  # its own instance: last_scanned_id is per reader
        self._fetch = threading.Lock()  # held by the one thread reading the log
        self._lock = threading.Lock()  # guards the buffer
        self._events: list[StoredEvent] = []
        self._keys: list[tuple[int, int]] = []
        self._start: str | None = None  # the buffer holds every entry after start ...
        self._scanned = "0-0"  # ... up to and including scanned
        self._readers: weakref.WeakSet[Position] = weakref.WeakSet()
        self.reads = 0  # log reads this tail made (tests and benchmarks count them)

    def register(self, reader: Position) -> None:
        with self._lock:
            self._readers.add(reader)

    def after(self, after_id: str, *, block_ms: int = 0, through: str | None = None) -> list[StoredEvent]:
        """The entries after `after_id`: at least every one up to `through` when given; waiting up to `block_ms`
        for a first one when there is none."""
        with self._lock:
            if self._start is None:
                self._start = self._scanned = after_id
            behind = position(after_id) < position(self._start)
            start = self._start
        gap: list[StoredEvent] = []
        if behind:  # older than the buffer: read the gap directly (a follower created late)
            gap = list(self.log.read("(" + after_id if after_id != "0-0" else "-", start, trust=Trust.OWN_LOG))
            after_id = start
        if through is not None and position(self._scanned) < position(through):
            self._read_until(through)
        got = self._buffered(after_id)
        if not got and not gap and block_ms > 0:
            got = self._wait_for_more(after_id, block_ms)
        return gap + got

    def _buffered(self, after_id: str) -> list[StoredEvent]:
        with self._lock:
            i = bisect.bisect_right(self._keys, position(after_id))
            return self._events[i:]

    def _append(self, got: list[StoredEvent], scanned: str | None) -> None:
        with self._lock:
            last_id, key = "", (0, 0)
            for stored in got:
                if stored.stream_id != last_id:  # the events of one entry (an append's, ~18 in a run) share its id
                    last_id, key = stored.stream_id, position(stored.stream_id)
                self._events.append(stored)
                self._keys.append(key)
            if scanned is not None and position(scanned) > position(self._scanned):
                self._scanned = scanned
            self._trim()

    def _trim(self) -> None:
        """Drop what every registered follower has folded (caller holds _lock)."""
        readers = list(self._readers)
        if not readers or not self._events:
            return
        low = min(min(position(r.last_id) for r in readers), position(self._scanned))
        n = bisect.bisect_right(self._keys, low)
        if n:
            del self._events[:n], self._keys[:n]
            self._start = f"{low[0]}-{low[1]}"  # the buffer still holds every entry after it

    def _read_until(self, through: str) -> None:
        with self._fetch:
            if position(self._scanned) >= position(through):
                return  # another thread read it meanwhile
            self.reads += 1
            self.log.last_scanned_id = None
            got = list(self.log.read("(" + self._scanned if self._scanned != "0-0" else "-", "+", trust=Trust.OWN_LOG))
            self._append(got, self.log.last_scanned_id)

    def _wait_for_more(self, after_id: str, block_ms: int) -> list[StoredEvent]:
        """One blocking read for the process; a thread that finds another one reading waits for it (up to its own
        deadline) and takes what it read from the buffer."""
        if not self._fetch.acquire(timeout=block_ms / 1000):
            return self._buffered(after_id)
        try:
            got = self._buffered(after_id)  # what the previous holder read while we waited for the lock
            if got:
                return got
            self.reads += 1
            self.log.last_scanned_id = None
            new = self.log.tail(self._scanned, block_ms=block_ms, trust=Trust.OWN_LOG)
            self._append(new, self.log.last_scanned_id)
        finally:
            self._fetch.release()
        return self._buffered(after_id)


_TAILS: PerRun[SharedTail] = PerRun()


def shared_tail(log: EventLog) -> SharedTail:
    """This process's tail of `log`'s run on `log`'s connection pool (made on first use)."""
    return _TAILS.get(log, SharedTail)
