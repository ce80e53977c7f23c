"""Replay, pure: rebuild a run's state from its log (or a snapshot plus the tail after it), and check that the
reducer is deterministic.

Everything here works on values handed in: log entries as (stream id, event) pairs (an `events.store.StoredEvent`
is one) and snapshots as anything shaped like `SnapshotLike` (an `events.snapshots.Snapshot` is one). Reading them
from Redis is the caller's job (`rolledger.events.store`, `rolledger.events.snapshots`).

`replay = snapshot + tail`. `check_replay` folds the log twice, once more from the latest snapshot plus its tail,
and, at every snapshot's position, compares the digest recorded then with the digest of the full replay up to there:
a mismatch means the reducer changed its decisions for old history (nondeterminism) or the log or snapshot was
corrupted: Temporal's replay check. The three folds run in one pass over the entries, so a log is read once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from rolledger.schemas import events as ev
from rolledger.workflows.reducer import fold
from rolledger.workflows.state import RunState

Entry = tuple[str, ev.Event]  # (stream id, event): one event of the log and the id of its entry (which may hold more)


class SnapshotLike(Protocol):
    """A stored snapshot: the state after folding the log up to `stream_id` (event `event_id`), and its digest."""

    @property
    def stream_id(self) -> str: ...

    @property
    def event_id(self) -> str: ...

    @property
    def digest(self) -> str: ...

    def state_dict(self) -> dict[str, Any]: ...


def restore(snapshot: SnapshotLike) -> RunState:
    """The reducer state a snapshot holds."""
    return RunState.from_dict(snapshot.state_dict())


def position(stream_id: str) -> tuple[int, int]:
    """A Redis stream id `ms-seq` as a sortable pair."""
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def entries_until(entries: Iterable[Entry], until: str | None = None) -> Iterator[Entry]:
    """The entries, stopping after the event whose event id is `until`, or after the last event of the stream entry
    whose id is `until` (an entry may hold several events, all with its id)."""
    in_last = False
    for stream_id, event in entries:
        if in_last and stream_id != until:
            return
        yield stream_id, event
        if until is not None and until == event.event_id:
            return
        in_last = in_last or until == stream_id


def rebuild(
    entries: Iterable[Entry], until: str | None = None, from_snapshot: SnapshotLike | None = None
) -> tuple[RunState, str]:
    """State (and the stream id of the last event folded) from the start, or from a snapshot plus its tail.

    With a snapshot, entries at or before its position are skipped, so `entries` may be the whole log or the tail.
    """
    state = restore(from_snapshot) if from_snapshot else RunState()
    last = from_snapshot.stream_id if from_snapshot else ""
    after = position(last) if from_snapshot else None
    for stream_id, event in entries_until(entries, until):
        if after is not None and position(stream_id) <= after:
            continue
        state = fold(state, event)
        last = stream_id
    return state, last


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


def check_replay(entries: Iterable[Entry], snapshots: Iterable[SnapshotLike], until: str | None = None) -> ReplayReport:
    """Fold the log (up to `until`) twice, check every snapshot taken at one of its entries, and fold the tail after
    the latest snapshot at or before the last entry onto that snapshot: see the module docstring."""
    pending = sorted(snapshots, key=lambda s: position(s.stream_id))
    at_entry = {s.stream_id: s for s in pending}
    state, again = RunState(), RunState()
    tail: RunState | None = None
    checks: list[tuple[str, str, str]] = []
    last = ""
    # entry by entry: a snapshot is taken after a whole entry (its events share the entry's stream id)
    for stream_id, in_entry in itertools.groupby(entries_until(entries, until), key=lambda entry: entry[0]):
        here = position(stream_id)
        tail = _latest_before(pending, here, tail, inclusive=False)  # snapshots taken before this entry
        last_event = ""
        for _, event in in_entry:
            state, again = fold(state, event), fold(again, event)
            if tail is not None:
                tail = fold(tail, event)
            last_event = event.event_id
        last = stream_id
        snap = at_entry.get(stream_id)
        if snap is not None and not (until == last_event and snap.event_id != last_event):  # not cut short by until
            checks.append((snap.event_id, snap.digest, state.digest()))
        tail = _latest_before(pending, here, tail, inclusive=True)  # and those taken right after it
    return ReplayReport(state, state.digest(), again.digest(), last, checks, tail.digest() if tail else None)


def _latest_before(
    pending: list[SnapshotLike], here: tuple[int, int], tail: RunState | None, *, inclusive: bool
) -> RunState | None:
    """Pop the pending (sorted) snapshots before `here` (or at it, when inclusive); the tail restarts from the newest
    of them, or stays as it is when none was popped."""
    newest: SnapshotLike | None = None
    while pending and (position(pending[0].stream_id) <= here if inclusive else position(pending[0].stream_id) < here):
        newest = pending.pop(0)
    return restore(newest) if newest is not None else tail
