"""The format of a run log's entries and the records a reader gets back (events/store.py reads and writes them):
an entry's fields (`e` one event's codec bytes, `b` several, `t` their types), the payloads of an entry and the key
naming one event in it, the stored event and the dead letter, and the exceptions the log raises (a malformed entry, a
lost conditional append, entries lost behind a writer's view, a closed run).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

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


class LogLostEntries(Exception):
    """`append_if` found the log ending before the entry the caller expected it to end at: an entry it had read is
    gone, and the log's end can only move forward (nothing deletes the last entry: the archiver keeps a live window).
    The log lost entries, as an uncoordinated failover to a replica that lagged loses them. Not a conflict to retry:
    a writer whose view of the log is ahead of the log would re-decide on the same view and be refused forever."""

    def __init__(self, run_id: str, expected: str, actual: str) -> None:
        super().__init__(
            f"run {run_id}: the log ends at {actual}, before entry {expected} that was read from it: "
            "the log lost entries (an uncoordinated Redis failover to a replica that lagged?)"
        )
        self.run_id = run_id
        self.expected = expected
        self.actual = actual


def stream_id_key(stream_id: str) -> tuple[int, int]:
    """A stream id as the (milliseconds, sequence) it sorts by."""
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


class RunClosed(Exception):
    """An append after the run's RunFinished: refused, nothing of the batch was written."""

    def __init__(self, run_id: str, finished_at: str) -> None:
        super().__init__(f"run {run_id} finished at {finished_at}: appends after RunFinished are refused")
        self.run_id = run_id
        self.finished_at = finished_at


def as_str(value: Any) -> str:
    """Redis replies are bytes (decode_responses=False); ids and names as str."""
    return value.decode() if isinstance(value, bytes) else str(value)
