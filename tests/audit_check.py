"""`audited_clean(stored)`: the audit of a run's log passes, and when it does not, the assertion shows the report and
the log as `rolledger events` prints it (multi-process tests fail on races that a rerun rarely repeats: the log is
the only evidence there will be)."""

from __future__ import annotations

from collections.abc import Iterable

from rolledger.events.store import StoredEvent
from rolledger.schemas import events as ev
from rolledger.workflows.audit import audit
from rolledger.workflows.audit_report import AuditReport
from rolledger.workflows.event_lines import lines

_MAX_LINES = 600


def audited_clean(entries: Iterable[StoredEvent]) -> list[ev.Event]:
    """The events of `entries`, after asserting that their audit is OK (the report and the log lines when not)."""
    stored = list(entries)
    events = [s.event for s in stored]
    report: AuditReport = audit(events)
    if not report.ok:
        shown = lines((s.stream_id, s.event) for s in stored)
        text = "\n".join(line.render() for line in shown[-_MAX_LINES:])
        raise AssertionError(
            f"{report.render()}\n--- the log ({len(shown)} events, last {_MAX_LINES} shown) ---\n{text}"
        )
    return events
