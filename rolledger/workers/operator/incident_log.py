"""The incidents of a live run on the console: each abort, quarantine, halt, refusal, lost worker and dead letter is
one structlog warning as the driver reads it from the log (the records come from workflows/incidents.py, the same
fold the summary's `incidents` list uses).

Read-only: the log's events are those the driver's follower already read; dead letters are looked up with XLEN and,
when the count grew, XRANGE over the dead-letter stream from the last one seen.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
import structlog

from rolledger.events.keys import dead_letter_key
from rolledger.events.store import as_str
from rolledger.schemas import events as ev
from rolledger.workflows.incidents import Incident, IncidentFold, dead_letter_incident

log = structlog.get_logger("incident")


class IncidentLog:
    """Feed it the events the driver follows (in log order) and poll it for dead letters; it logs each incident once."""

    def __init__(self, client: redis.Redis | None, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.fold = IncidentFold()
        self._dead_seen = "0-0"
        self._dead_count = 0

    def events(self, events: Iterable[ev.Event]) -> None:
        for e in events:
            incident = self.fold.see(e)
            if incident is not None:
                emit(incident)

    def poll_dead_letters(self) -> None:
        if self.client is None:
            return
        key = dead_letter_key(self.run_id)
        count = int(self.client.xlen(key))
        if count <= self._dead_count:
            return
        entries: Any = self.client.xrange(key, "(" + self._dead_seen, "+")
        for dl_id, fields in entries or []:
            self._dead_seen = as_str(dl_id)
            self._dead_count += 1
            source = as_str(fields.get(b"source", b"")) or None
            incident = dead_letter_incident(self._dead_seen, source, as_str(fields.get(b"reason", b"")))
            emit(incident)


def emit(incident: Incident) -> None:
    """One warning line: the headline, then version, rank(s), phase, tensor and reason."""
    log.warning(incident.headline, **incident.fields())
