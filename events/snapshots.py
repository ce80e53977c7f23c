"""The snapshot store: reducer snapshots of a run on their own Redis stream (`keys.snapshots_key`).

A snapshot is the reducer state as of one log entry: the stream id and event id of the last event folded, the state's
digest, and the state itself (msgpack of its `to_dict()`). This module only writes and reads them; what a snapshot is
*for* (replay = snapshot + tail, the determinism check) is pure and lives in `rolledger.workflows.replay`, which
takes any object shaped like `Snapshot`. It never imports the reducer: the state is anything with `last_event_id`,
`digest()` and `to_dict()` (`SnapshotSource`).

Retention: a snapshot holds the whole state, which grows with the run, so keeping every one is quadratic in the log.
`take_snapshot` keeps the first one and the newest `KEEP_LATEST` (the trim runs in the same Lua call as the XADD);
storage is then bounded by a few states, and the replay check still compares every kept snapshot with the log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import redis

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
