"""Replay and snapshots: rebuild a run's state from its log, and check that the reducer is deterministic.

A snapshot is (state, digest, stream id and event id of the last event folded) in the run's snapshots stream.
`replay = snapshot + tail`. `verify` replays the whole log twice, once more from the latest snapshot plus its tail,
and, at every snapshot's position, compares the digest recorded then with the digest of the full replay up to there: a mismatch means the reducer changed its
decisions for old history (nondeterminism) or the log or snapshot was corrupted — Temporal's replay check.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import msgpack
import redis

from rolledger.events.keys import snapshots_key
from rolledger.events.store import EventLog, StoredEvent
from rolledger.workflows.reducer import fold
from rolledger.workflows.state import RunState


@dataclass(frozen=True)
class Snapshot:
    stream_id: str  # of the last event folded into the state
    event_id: str
    digest: str
    state: bytes  # msgpack of RunState.to_dict()

    def load(self) -> RunState:
        return RunState.from_dict(msgpack.unpackb(self.state, raw=False, strict_map_key=False))


def take_snapshot(client: redis.Redis, run_id: str, state: RunState, stream_id: str) -> Snapshot:
    snap = Snapshot(stream_id, state.last_event_id, state.digest(), msgpack.packb(state.to_dict()))
    client.xadd(
        snapshots_key(run_id),
        {b"at": snap.stream_id, b"event": snap.event_id, b"digest": snap.digest, b"state": snap.state},
    )
    return snap


def snapshots(client: redis.Redis, run_id: str) -> list[Snapshot]:
    out = []
    for _, f in client.xrange(snapshots_key(run_id)) or []:
        fields: dict[bytes, bytes] = dict(f or {})  # type: ignore[arg-type]
        out.append(
            Snapshot(fields[b"at"].decode(), fields[b"event"].decode(), fields[b"digest"].decode(), fields[b"state"])
        )
    return out


def events_until(log: EventLog, until: str | None = None, start: str = "-") -> Iterator[StoredEvent]:
    """The log from `start`, stopping after the event whose event id or stream id is `until`."""
    for stored in log.read(start):
        yield stored
        if until is not None and until in (stored.stream_id, stored.event.event_id):
            return


def rebuild(log: EventLog, until: str | None = None, from_snapshot: Snapshot | None = None) -> tuple[RunState, str]:
    """State (and the stream id of the last event folded) from the start, or from a snapshot plus its tail."""
    state = from_snapshot.load() if from_snapshot else RunState()
    last = from_snapshot.stream_id if from_snapshot else ""
    start = "(" + from_snapshot.stream_id if from_snapshot else "-"
    for stored in events_until(log, until, start):
        fold(state, stored.event)
        last = stored.stream_id
    return state, last


def _position(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def latest_snapshot(client: redis.Redis, run_id: str, at_or_before: str | None = None) -> Snapshot | None:
    """The newest stored snapshot (at or before a stream id), to start a replay from: snapshot + tail."""
    found = snapshots(client, run_id)
    if at_or_before is not None:
        limit = _position(at_or_before)
        found = [s for s in found if _position(s.stream_id) <= limit]
    return found[-1] if found else None


@dataclass
class ReplayReport:
    state: RunState
    digest: str
    digest_again: str
    last_stream_id: str
    snapshot_checks: list[tuple[str, str, str]] = field(default_factory=list)  # (event id, recorded, replayed)
    tail_digest: str | None = None  # latest snapshot + the tail after it (None when there is no snapshot)

    @property
    def ok(self) -> bool:
        return (
            self.digest == self.digest_again
            and all(rec == rep for _, rec, rep in self.snapshot_checks)
            and self.tail_digest in (None, self.digest)
        )


def verify(client: redis.Redis, run_id: str, until: str | None = None) -> ReplayReport:
    log = EventLog(client, run_id)
    snaps = {s.stream_id: s for s in snapshots(client, run_id)}
    state = RunState()
    checks: list[tuple[str, str, str]] = []
    last = ""
    for stored in events_until(log, until):
        fold(state, stored.event)
        last = stored.stream_id
        snap = snaps.get(stored.stream_id)
        if snap is not None:
            checks.append((snap.event_id, snap.digest, state.digest()))
    again, _ = rebuild(log, until)
    snap = latest_snapshot(client, run_id, at_or_before=last) if last else None
    tail = rebuild(log, until, from_snapshot=snap)[0].digest() if snap is not None else None
    return ReplayReport(state, state.digest(), again.digest(), last, checks, tail)
