"""Consumer groups over the run log: crash-safe at-least-once delivery, reclaiming from dead consumers, dead letters.

The read loop (`GroupConsumer.read`), in order:

1. After (re)start, this consumer's own pending entries (XREADGROUP from id 0): what it read before a crash and never
   acknowledged. Read until empty, then never again (later leftovers are reclaimed by step 2).
2. XAUTOCLAIM of entries pending longer than `claim_idle_ms` in any consumer of the group (dead or slow ones, and this
   one's own unacknowledged failures), on a timer: at most once per `claim_every_ms` (default a quarter of
   `claim_idle_ms`, at most 1 s), not on every read; `nack` makes the next read scan at once.
   After a Redis outage the client rode out (events.outage.outages), step 1 runs again: an XREADGROUP whose reply
   was lost to the dropped connection left its entries in this consumer's pending list, and redis-py's retry read
   new ones; the lost ones come back from there. One scan step per read, the cursor kept between reads.
3. New entries (XREADGROUP `>`), blocking up to `block_ms`.

Heartbeats. A consumer working on an entry for a long time (a rank generating a group) keeps its claim alive with
`refresh(ids)`: one Lua round trip that, for each id still pending *to this consumer*, resets its idle time (XCLAIM
to itself with min-idle 0 and JUSTID, which leaves the delivery counter alone), and returns the ids it still owns.
An id another consumer has reclaimed is not taken back: the caller learns it lost the claim and stops working on it.
So step 2 reclaims only entries whose owner missed its heartbeats for `claim_idle_ms` (the run's
`recovery.lost_after_s`), not entries that are merely slow.

Delivery is at least once: a handler must be idempotent or record its completion atomically with the XACK (MULTI,
or a Lua script; see tests/_consumer_proc.py). Entries are never fatal to the consumer:

- delivered more than `max_deliveries` times -> dead letter "delivered N times", acknowledged;
- malformed (garbage bytes, unknown type, newer schema, invalid field) -> dead letter with the DecodeError reason,
  acknowledged;
- body gone (trimmed or deleted while pending; redis-py shows `{}`) -> dead letter "payload lost ...", acknowledged.

The stream is the run log by default. A work group (events/work.py: "rollout", "reward") reads its own work stream
instead (`GroupConsumer.work`), which holds only the events it must act on, and deletes each entry with its
acknowledgement (XACK + XDEL in one Lua call) so the work stream holds only work not yet done; the log is never touched.
A work delivery's `stream_id` is the work entry's id (what `ack`, `nack`, `refresh` take) and `log_id` the event's
stream id in the log.

Within a group entries are balanced by readiness, not partitioned: two consumers may process one aggregate's events
out of order. Per-key order needs a stream (and one consumer) per key.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import redis

from rolledger.events.codec import SHARED, DecodeError, decode_shared
from rolledger.events.keys import log_key, work_key
from rolledger.events.outage import outages
from rolledger.events.store import (
    PAYLOAD_LOST,
    MalformedEntry,
    as_str,
    dead_letter,
    entry_payloads,
    event_key,
    event_reason,
)
from rolledger.events.work import GROUPS, LOG_ID_FIELD, LOG_INDEX_FIELD, ROUTES
from rolledger.schemas.events import Event

# For each id: refresh it if this consumer owns it (XPENDING names the owner), else leave it. Returns the owned ids.
_REFRESH_LUA = """
local owned = {}
for i = 3, #ARGV do
  local rows = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #rows == 1 and rows[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    owned[#owned + 1] = ARGV[i]
  end
end
return owned
"""


# A work stream's acknowledgement: XACK, then XDEL of the same ids, in one call (never deleted while pending).
_ACK_AND_DELETE_LUA = """
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
return redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
"""


class Delivery(NamedTuple):
    """One delivered entry; `deliveries` counts this delivery (1 the first time). `log_id`: the event's stream id in
    the log (= `stream_id` for a consumer of the log; a work entry's `s` field for a work group)."""

    stream_id: str
    event: Event
    deliveries: int
    log_id: str = ""


class GroupConsumer:
    """One consumer of a consumer group on the run log."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        group: str,
        consumer: str,
        *,
        max_deliveries: int = 5,
        claim_idle_ms: int = 30_000,
        start_id: str = "0",
        stream: str | None = None,
        trim_acked: bool = False,
        claim_every_ms: int | None = None,
    ) -> None:
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {max_deliveries}")
        if claim_idle_ms < 0:
            raise ValueError(f"claim_idle_ms must be >= 0, got {claim_idle_ms}")
        self.client = client
        self.run_id = run_id
        self.key = stream if stream is not None else log_key(run_id)
        self.trim_acked = trim_acked  # delete acknowledged entries (a work stream; never the log)
        self.group = group
        self.consumer = consumer
        self.max_deliveries = max_deliveries
        self.claim_idle_ms = claim_idle_ms
        self.start_id = start_id
        self._own_cursor: str | None = "0"  # None once the own pending list has been drained
        self._refresh = client.register_script(_REFRESH_LUA)
        self._ack_and_delete = client.register_script(_ACK_AND_DELETE_LUA)
        self._claim_cursor = "0-0"
        self.claim_every_ms = claim_every_ms
        self._claim_at = 0.0  # monotonic time of the next XAUTOCLAIM scan
        self._outages = outages(client)

    @classmethod
    def work(
        cls,
        client: redis.Redis,
        run_id: str,
        group: str,
        consumer: str,
        *,
        max_deliveries: int = 5,
        claim_idle_ms: int = 30_000,
        claim_every_ms: int | None = None,
    ) -> GroupConsumer:
        """A consumer of a work group's own stream (events/work.py), deleting entries as it acknowledges them."""
        if group not in GROUPS:
            raise ValueError(f"{group!r} is not a work group (events.work.GROUPS: {', '.join(GROUPS)})")
        SHARED.share(t for t, g in ROUTES.items() if g == group)  # its events are decoded once in this process
        return cls(
            client,
            run_id,
            group,
            consumer,
            max_deliveries=max_deliveries,
            claim_idle_ms=claim_idle_ms,
            claim_every_ms=claim_every_ms,
            stream=work_key(run_id, group),
            trim_acked=True,
        )

    def _claim_due(self) -> bool:
        """Whether this read scans for reclaimable entries (see the module docstring, step 2)."""
        now = time.monotonic()
        if now < self._claim_at:
            return False
        every = self.claim_every_ms if self.claim_every_ms is not None else min(self.claim_idle_ms // 4, 1000)
        self._claim_at = now + every / 1000
        return True

    @property
    def name(self) -> str:
        return f"{self.group}/{self.consumer}"

    def ensure_group(self) -> None:
        """Create the group (and the stream) if missing; an existing group is left as it is."""
        try:
            self.client.xgroup_create(self.key, self.group, id=self.start_id, mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # ------------------------------------------------------------------ reading
    def read(self, *, count: int = 100, block_ms: int = 1000) -> list[Delivery]:
        """Up to `count` deliveries: own leftovers first, then reclaimed ones, then new ones (waiting up to block_ms).

        Returns [] when nothing arrived within block_ms. Dead-lettered entries are acknowledged and not returned.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if (seen := outages(self.client)) != self._outages:
            self._outages, self._own_cursor = seen, "0"  # a reply lost in the outage: its entries are pending here
        while self._own_cursor is not None:
            reply: Any = self.client.xreadgroup(self.group, self.consumer, {self.key: self._own_cursor}, count=count)
            entries = reply[0][1] if reply else []
            if not entries:
                self._own_cursor = None
                break
            self._own_cursor = as_str(entries[-1][0])
            out = self._deliver(entries, self._delivery_counts([as_str(e[0]) for e in entries]))
            if out:
                return out

        if self._claim_due():
            claimed = self._autoclaim(count)
            if claimed:
                return claimed

        reply = self.client.xreadgroup(self.group, self.consumer, {self.key: ">"}, count=count, block=block_ms)
        entries = reply[0][1] if reply else []
        return self._deliver(entries, {})

    def _autoclaim(self, count: int) -> list[Delivery]:
        reply: Any = self.client.xautoclaim(
            self.key, self.group, self.consumer, self.claim_idle_ms, self._claim_cursor, count=count
        )
        self._claim_cursor = as_str(reply[0])
        entries = [e for e in reply[1] if e[0] is not None]
        if len(entries) < len(reply[1]):
            # Redis 6.2 claims deleted entries as nil without their ids: re-read the own pending list to find them.
            self._own_cursor = "0"
        for gone in reply[2] if len(reply) > 2 else []:  # 7.0+: dangling ids XAUTOCLAIM dropped from the PEL
            dead_letter(
                self.client, self.run_id, stream_id=as_str(gone), raw=None, reason=PAYLOAD_LOST, consumer=self.name
            )
        if not entries:
            return []
        return self._deliver(entries, self._delivery_counts([as_str(e[0]) for e in entries]))

    def _delivery_counts(self, ids: Sequence[str]) -> dict[str, int]:
        """Delivery counters of entries this consumer now holds (XPENDING over their id range, then one by one)."""
        rows = self.client.xpending_range(self.key, self.group, ids[0], ids[-1], len(ids), consumername=self.consumer)
        counts = {as_str(r["message_id"]): int(r["times_delivered"]) for r in rows}
        for missing in (i for i in ids if i not in counts):
            row = self.client.xpending_range(self.key, self.group, missing, missing, 1)
            counts[missing] = int(row[0]["times_delivered"]) if row else 1
        return counts

    def _deliver(self, entries: Sequence[Any], counts: dict[str, int]) -> list[Delivery]:
        """The entries' events as deliveries. An entry may hold several events (a log entry, events/store.py
        `entry_payloads`; a reward work entry, events/work.py BATCHED): each is a delivery of the same entry (one
        `ack` takes them all). Dead letters are keyed per event: its log entry's id and its place in it."""
        out: list[Delivery] = []
        for raw_id, fields in entries:
            stream_id = as_str(raw_id)
            n = counts.get(stream_id, 1)
            in_log = fields.get(LOG_ID_FIELD) if fields else None
            log_id = as_str(in_log) if in_log is not None else stream_id  # a dead letter names the log's entry ...
            in_entry = fields.get(LOG_INDEX_FIELD) if fields else None
            places = as_str(in_entry).split(",") if in_entry is not None else None  # ... and each event's place in it
            try:
                payloads = entry_payloads(fields)
            except MalformedEntry as exc:
                self._dead_letter(stream_id, log_id, None, exc.reason, once=log_id if places is None else stream_id)
                self.ack(stream_id)
                continue
            delivered = len(out)
            for k, data in enumerate(payloads):
                if places is not None and len(places) == len(payloads):
                    place: str | int | None = places[k]  # a work entry: the event's place in its log entry
                else:
                    place = None if len(payloads) == 1 else k
                once = event_key(log_id, place)
                if n > self.max_deliveries:
                    self._dead_letter(stream_id, log_id, data, f"delivered {n} times", once=f"{self.group}/{once}")
                    continue
                try:
                    event = decode_shared(data)  # the process's tail reads the same bytes: decoded once
                except DecodeError as exc:
                    self._dead_letter(stream_id, log_id, data, event_reason(place, exc.reason), once=once)
                    continue
                out.append(Delivery(stream_id, event, n, log_id))
            if len(out) == delivered:  # nothing of it to process: acknowledged here (else by whoever processes it)
                self.ack(stream_id)
        return out

    def _dead_letter(self, stream_id: str, log_id: str, raw: bytes | None, reason: str, *, once: str) -> None:
        dead_letter(
            self.client, self.run_id, stream_id=log_id, raw=raw, reason=reason, consumer=self.name, once_key=once
        )

    # ------------------------------------------------------------------ acknowledging
    def ack(self, *stream_ids: str) -> None:
        """Mark entries processed (XACK); unknown or already acknowledged ids are ignored by Redis."""
        if not stream_ids:
            return
        if not self.trim_acked:
            self.client.xack(self.key, self.group, *stream_ids)
            return
        self._ack_and_delete(keys=[self.key], args=[self.group, *stream_ids])  # one round trip, both or neither

    def nack(self, *stream_ids: str) -> None:
        """Give entries back for redelivery at the next read of any consumer in the group, without waiting for
        claim_idle_ms (sets their idle time to claim_idle_ms; the delivery counter is left as it is)."""
        if stream_ids:
            self.client.xclaim(
                self.key, self.group, self.consumer, 0, list(stream_ids), idle=self.claim_idle_ms, justid=True
            )
            self._claim_cursor = "0-0"
            self._claim_at = 0.0

    def refresh(self, *stream_ids: str) -> set[str]:
        """The heartbeat: reset the idle time of those of `stream_ids` this consumer still owns, in one round trip;
        returns them. An id missing from the result was reclaimed by another consumer (or acknowledged)."""
        if not stream_ids:
            return set()
        reply: Any = self._refresh(keys=[self.key], args=[self.group, self.consumer, *stream_ids])
        return {as_str(i) for i in reply}

    def pending(self) -> int:
        """Entries delivered to the whole group and not yet acknowledged (XPENDING summary)."""
        return int(self.client.xpending(self.key, self.group)["pending"])

    def pending_mine(self) -> int:
        """Entries delivered to this consumer and not yet acknowledged."""
        for row in self.client.xpending(self.key, self.group)["consumers"]:
            if as_str(row["name"]) == self.consumer:
                return int(row["pending"])
        return 0
