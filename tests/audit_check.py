"""`audited_clean(stored)`, `audited_log(redis_url, run_id)`: the audit of a run's log passes, and when it does not, the assertion shows the report and
the log as `rolledger events` prints it (multi-process tests fail on races that a rerun rarely repeats: the log is
the only evidence there will be)."""

from __future__ import annotations

from collections.abc import Iterable

import redis

from rolledger.events.store import EventLog, StoredEvent
from rolledger.schemas import events as ev
from rolledger.workflows.audit import audit
from rolledger.workflows.audit_report import AuditReport
from rolledger.workflows.event_lines import lines

_MAX_LINES = 600


def audited_clean(entries: Iterable[StoredEvent]) -> list[ev.Event]:
    """The events of `entries`, after asserting that their audit is OK (the report and the log lines when not)."""
    return _audited(entries)[0]


def audited_log(redis_url: str, run_id: str) -> tuple[list[ev.Event], AuditReport]:
    """A run's log read from its Redis, asserted OK as by `audited_clean`, and its audit report."""
    client = redis.Redis.from_url(redis_url)
    try:
        return _audited(EventLog(client, run_id).read())
    finally:
        client.close()


def _audited(entries: Iterable[StoredEvent]) -> tuple[list[ev.Event], AuditReport]:
    stored = list(entries)
    events = [s.event for s in stored]
    report: AuditReport = audit(events)
    if not report.ok:
        shown = lines((s.stream_id, s.event) for s in stored)
        text = "\n".join(line.render() for line in shown[-_MAX_LINES:])
        raise AssertionError(
            f"{report.render()}\n--- the log ({len(shown)} events, last {_MAX_LINES} shown) ---\n{text}"
        )
    return events, report
