"""The snapshot store: reducer snapshots of a run on their own Redis stream (`keys.snapshots_key`).

A snapshot is the reducer state as of one log entry: the stream id and event id of the last event folded, the state's
digest, and the state itself (msgpack of its `to_dict()`). This module only writes and reads them; what a snapshot is
*for* (replay = snapshot + tail, the determinism check) is pure and lives in `rolledger.workflows.replay`, which
takes any object shaped like `Snapshot`. It never imports the reducer: the state is anything with `last_event_id`,
`digest()` and `to_dict()` (`SnapshotSource`).

Retention: a snapshot holds the whole state, so keeping every one would grow with the log. `take_snapshot` keeps the
first one and the newest `KEEP_LATEST` (the trim runs in the same Lua call as the XADD); storage is then bounded by a
few states, and the replay check still compares every kept snapshot with the log.

Off the decision thread: `SnapshotWriter` takes snapshots on a thread of its own. The caller hands it a *frozen*
state (a SnapshotSource holding a copy, e.g. `RunState.frozen()`: a plain dict taken on the caller's thread, O(live
state)); the digest, the msgpack and the XADD happen on the writer's thread. One snapshot is in flight at a time and
a newer one replaces one still waiting (only the newest matters). `due` says when one is due: every `every_events`
events or `every_s` seconds (with at least one new event), whichever comes first.

What a snapshot costs per event stays bounded: a snapshot's cost follows the live state (a digest of every open group
and sample), so a fixed count would make each event dearer as the live state grows (at 512 groups x 16 samples in
flight, a snapshot every 500 events cost more CPU than every other role of the run together). The count rule is
therefore stretched to at least `cost / budget_per_event_s` events, where `cost` is the CPU the previous snapshot took
(the caller's copy plus the writer's digest and encoding): with the default 2 us per event, a 1 ms snapshot keeps the
500-event cadence and a 100 ms one is taken every 50,000 events. The time rule is not stretched, so a restart never
replays more than `every_s` seconds of log past its snapshot.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import redis
import structlog

from rolledger.events.keys import snapshots_key

KEEP_LATEST = 3  # besides the first snapshot

# KEYS: the snapshots stream. ARGV: how many of the newest to keep, then the XADD field/value pairs. Adds the entry,
# then deletes every entry between the first and the newest ARGV[1]; returns the new entry's id.
_ADD_AND_TRIM_LUA = """
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
local keep = tonumber(ARGV[1])
local n = redis.call('XLEN', KEYS[1])
if n > keep + 1 then
  local old = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', n - keep)
  for i = 2, #old do redis.call('XDEL', KEYS[1], old[i][1]) end
end
return id
"""

# Field names of one entry of the snapshots stream.
F_AT = b"at"  # stream id of the last event folded into the state
F_EVENT = b"event"  # its event id
F_DIGEST = b"digest"
F_STATE = b"state"  # msgpack of the state's to_dict()


class SnapshotSource(Protocol):
    """What the store needs of a state to snapshot it (the reducer's RunState is one)."""

    @property
    def last_event_id(self) -> str: ...

    def digest(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Snapshot:
    stream_id: str  # of the last event folded into the state
    event_id: str
    digest: str
    state: bytes  # msgpack of the state's to_dict()

    def state_dict(self) -> dict[str, Any]:
        """The state as the dict it was taken from (feed it to RunState.from_dict)."""
        data: dict[str, Any] = msgpack.unpackb(self.state, raw=False, strict_map_key=False)
        return data


def take_snapshot(
    client: redis.Redis, run_id: str, state: SnapshotSource, stream_id: str, *, keep_latest: int = KEEP_LATEST
) -> Snapshot:
    """Store `state`, which has folded the log up to and including `stream_id`; keep the first snapshot and the
    newest `keep_latest` (older ones in between are deleted)."""
    if keep_latest < 1:
        raise ValueError(f"keep_latest must be >= 1, got {keep_latest}")
    snap = Snapshot(stream_id, state.last_event_id, state.digest(), msgpack.packb(state.to_dict()))
    client.eval(
        _ADD_AND_TRIM_LUA,
        1,
        snapshots_key(run_id),
        keep_latest,
        F_AT,
        snap.stream_id,
        F_EVENT,
        snap.event_id,
        F_DIGEST,
        snap.digest,
        F_STATE,
        snap.state,
    )
    return snap


def _snapshot(fields: Any) -> Snapshot:
    f: dict[bytes, bytes] = dict(fields or {})
    return Snapshot(f[F_AT].decode(), f[F_EVENT].decode(), f[F_DIGEST].decode(), f[F_STATE])


def stored_snapshots(client: redis.Redis, run_id: str) -> list[Snapshot]:
    """Every stored snapshot of the run, oldest first."""
    entries: Any = client.xrange(snapshots_key(run_id)) or []
    return [_snapshot(fields) for _, fields in entries]


def latest_snapshot(client: redis.Redis, run_id: str) -> Snapshot | None:
    """The newest stored snapshot, to start a replay from (snapshot + tail); None when there is none."""
    entries: Any = client.xrevrange(snapshots_key(run_id), count=1) or []
    return _snapshot(entries[0][1]) if entries else None


class SnapshotWriter:
    """Takes snapshots on its own thread (module docstring): `submit` returns at once; `close` waits for the last."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        *,
        every_events: int = 500,
        every_s: float = 30.0,
        budget_per_event_s: float = 2e-6,
        keep_latest: int = KEEP_LATEST,
        events_at_start: int = 0,
    ) -> None:
        if every_events < 1 or every_s <= 0 or budget_per_event_s <= 0:
            raise ValueError(
                f"every_events must be >= 1, every_s and budget_per_event_s > 0, got {every_events}, {every_s} and "
                f"{budget_per_event_s}"
            )
        self.client, self.run_id, self.keep_latest = client, run_id, keep_latest
        self.every_events, self.every_s, self.budget_per_event_s = every_events, every_s, budget_per_event_s
        self.last_cost_s = 0.0  # CPU of the newest snapshot taken: the caller's copy plus the writer's part
        self.taken = 0
        self.failed = 0
        self.last: Snapshot | None = None
        self._at_events = events_at_start
        self._at_time = time.monotonic()
        self._pending: tuple[SnapshotSource, str, float] | None = None
        self._busy = False
        self._cond = threading.Condition()
        self._closed = False
        self._log = structlog.get_logger("rolledger.snapshots").bind(run_id=run_id)
        self._thread = threading.Thread(target=self._run, name=f"snapshots-{run_id}", daemon=True)
        self._thread.start()

    def due(self, events_applied: int, now: float | None = None) -> bool:
        """Whether a snapshot is due at `events_applied` events: by count (stretched by the last snapshot's cost,
        module docstring), or by time with new events."""
        new = events_applied - self._at_events
        t = time.monotonic() if now is None else now
        by_count = max(self.every_events, self.last_cost_s / self.budget_per_event_s)
        return new >= by_count or (new > 0 and t - self._at_time >= self.every_s)

    def submit(self, frozen: SnapshotSource, stream_id: str, events_applied: int, *, copy_cost_s: float = 0.0) -> None:
        """Queue a snapshot of `frozen` (a copy the caller no longer changes, which cost the caller `copy_cost_s` of
        CPU to make) at `stream_id`; returns at once."""
        with self._cond:
            self._pending = (frozen, stream_id, copy_cost_s)
            self._at_events, self._at_time = events_applied, time.monotonic()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                frozen, stream_id, copy_cost_s = self._pending
                self._pending, self._busy = None, True
            try:
                started = time.thread_time()
                self.last = take_snapshot(self.client, self.run_id, frozen, stream_id, keep_latest=self.keep_latest)
                self.last_cost_s = copy_cost_s + time.thread_time() - started
                self.taken += 1
            except Exception as exc:  # noqa: BLE001 - a lost snapshot costs a longer replay, never the run
                self.failed += 1
                self._log.warning("snapshot failed", error=f"{type(exc).__name__}: {exc}", at=stream_id)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until nothing is pending or in flight (True), or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> bool:
        """Write what is pending, then stop the thread; False when that took longer than `timeout_s`."""
        done = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.0, timeout_s))
        return done and not self._thread.is_alive()
