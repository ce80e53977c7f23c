"""Acknowledged appends missing from the log, found from the writers' append marks: a pure function.

Every log writer (events/store.EventLog) numbers its appends and stamps the first event of each with an AppendMark
(schemas/events.py): its random origin, the append's number `n`, and `acked`, the highest of its own appends that
Redis had acknowledged when this one was encoded. Redis acknowledges an append only once it is in the log, and the
log never deletes an entry (the archiver moves entries to segments, which the audit reads too). So the append a mark
says was acknowledged must be in the log; where it is not, the log lost acknowledged events: the signature of an
uncoordinated failover (a replica promoted while it lagged the primary it replaced: asynchronous replication, reference
notes 1.9), or of a Redis restored from an older copy.

What this proves, and what it cannot:

- A loss is found when the writer appended again after it (its next mark names the lost append as acknowledged, or
  names a later one, and the lost ones lie between the two). The appends of a writer that wrote nothing after the
  loss (the last ones of a process that then exited) leave no trace in the log and are not found here.
- Numbers with no mark in the log are not all losses: an append refused (a conflict, a claimed key, the run's end)
  or never answered leaves its number unused. Only a number at or below an acknowledged one, with no mark, is named,
  as part of the range that ends at the acknowledged number; the range's lower numbers may be such unused ones.
- Logs written before issue 41 carry no marks: nothing is checked (`checked` is 0).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from rolledger.schemas.events import Event


@dataclass(frozen=True)
class LostAppends:
    """Appends `first`..`last` of the writer `origin` are not in the log, and `last` was acknowledged to it before its
    append `by` (the event `by_event`) was written."""

    origin: int
    producers: tuple[str, ...]  # the producers whose events the writer appended (one, for a role's own log)
    first: int
    last: int
    by: int
    by_event: str

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    def message(self) -> str:
        span = f"append {self.first}" if self.first == self.last else f"appends {self.first}-{self.last}"
        who = ("producers " if len(self.producers) > 1 else "producer ") + (", ".join(self.producers) or "?")
        return (
            f"log writer {self.origin:08x} ({who}): {span} missing, though its append {self.by} "
            f"(event {self.by_event}) says {self.last} was acknowledged: the log lost acknowledged events "
            "(an uncoordinated failover to a replica that lagged, or a Redis restored from an older copy)"
        )


@dataclass(frozen=True)
class MarkCheck:
    """The result: how many acknowledgements were checked, and each range of acknowledged appends the log lost."""

    checked: int
    lost: tuple[LostAppends, ...]


def lost_appends(events: Iterable[Event]) -> MarkCheck:
    """Every range of acknowledged appends missing from `events` (the whole log, any order; duplicates welcome).

    For each writer: the numbers its marks in the log hold; each mark's `acked` (if not 0) must be one of them. The
    missing ones are named by the stretch of absent numbers they fall in, from its start to the highest number
    acknowledged in it, with the first mark that claimed that number."""
    present: dict[int, set[int]] = {}
    producers: dict[int, dict[str, None]] = {}
    claims: list[tuple[int, int, int, str]] = []  # (origin, acked, n, event id), in log order
    for event in events:
        mark = event.append
        if mark is None:
            continue
        present.setdefault(mark.origin, set()).add(mark.n)
        producers.setdefault(mark.origin, {})[event.producer] = None
        if mark.acked:
            claims.append((mark.origin, mark.acked, mark.n, event.event_id))
    ordered = {origin: sorted(numbers) for origin, numbers in present.items()}
    worst: dict[tuple[int, int], tuple[int, int, str]] = {}  # (origin, stretch start) -> (acked, n, event id)
    for origin, acked, n, event_id in claims:
        if acked in present[origin]:
            continue
        numbers = ordered[origin]
        below = bisect.bisect_left(numbers, acked)  # how many of the writer's numbers in the log are below it
        first = numbers[below - 1] + 1 if below else 1
        key = (origin, first)
        if key not in worst or acked > worst[key][0]:
            worst[key] = (acked, n, event_id)
    lost = [
        LostAppends(origin, tuple(producers[origin]), first, acked, n, event_id)
        for (origin, first), (acked, n, event_id) in sorted(worst.items())
    ]
    return MarkCheck(checked=len(claims), lost=tuple(lost))
