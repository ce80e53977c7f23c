"""The reducer: `fold(state, event) -> state`, the only code that turns events into state.

Pure in the sense that matters for replay: it reads nothing but its two arguments (no I/O, no clock, no randomness),
so replaying one log always gives one state. For speed it updates the state object it is handed and returns it: the
caller gives the old state up (use `evolve` to keep it). An impossible transition (a sample finishing in an unknown
group, a commit without every rank prepared, a duplicate event id) is recorded in `state.anomalies`, never raised:
audit reports anomalies, and a live run keeps going on the part of the log that makes sense.

`fold` (the envelope bookkeeping: duplicates, events after the end, counts, wall times) is here; the handlers of each event family are in
their own module (reducer_run, reducer_rollout, reducer_trainer, reducer_update, reducer_engine), registered with
workflows.dispatch and merged into one table here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

from rolledger.schemas import events as ev
from rolledger.workflows import reducer_engine, reducer_rollout, reducer_run, reducer_trainer, reducer_update
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.reducer_common import anomaly
from rolledger.workflows.state import RunState

_RECENT_IDS = 1024

HANDLERS: Handlers[RunState, None] = Handlers.merge(
    "reducer",
    reducer_run.handlers,
    reducer_rollout.handlers,
    reducer_trainer.handlers,
    reducer_update.handlers,
    reducer_engine.handlers,
)
HANDLERS.require_all()  # caught at import by every test
_TABLE = HANDLERS.table  # fold looks its handler up here directly: one dict lookup per event


def fold(state: RunState, event: ev.Event) -> RunState:
    """Apply one event. A duplicate event id (within the recent window) is recorded and not applied twice; an older
    duplicate reaches its handler, whose fold is idempotent by its own key (a step, a group, a sample, a version).
    An event after RunFinished is recorded as an anomaly (and applied: the log says it happened)."""
    if event.event_id in state.recent_ids:
        anomaly(state, event, "duplicate event id; not applied again")
        return state
    if state.status.is_terminal and type(event.payload) is not ev.RunFinished:
        anomaly(state, event, f"{event.type} after RunFinished ({state.status})")
    state.recent_ids[event.event_id] = None
    if len(state.recent_ids) > _RECENT_IDS:
        state.recent_ids.popitem(last=False)
    if state.events_applied == 0:
        state.first_wall_time = event.wall_time
    state.last_wall_time = max(state.last_wall_time, event.wall_time)
    state.events_applied += 1
    state.last_event_id = event.event_id
    p = event.payload
    state.counts[p.type] = state.counts.get(p.type, 0) + 1
    _TABLE[type(p)](state, event, p)
    return state


def evolve(state: RunState, event: ev.Event) -> RunState:
    """fold on a copy: the given state is left as it was."""
    return fold(copy.deepcopy(state), event)


def replay(events: Iterable[ev.Event], state: RunState | None = None) -> RunState:
    """Fold a sequence of events, from `state` (a snapshot) or from the empty state."""
    s = state if state is not None else RunState()
    for e in events:
        s = fold(s, e)
    return s
