"""The closed sets of statuses and reasons that events carry and the reducer's state holds.

Each is a `StrEnum`: a member equals its string value (so logs written before these existed read the same), and the
membership questions that code asks are named predicates here, never tuples repeated at the call sites.
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"  # kept for old logs: a run stopped from outside (deadline, cancel)

    @property
    def is_terminal(self) -> bool:
        return self in _RUN_TERMINAL


_RUN_TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.ABORTED})


class GroupStatus(StrEnum):
    ADMITTED = "admitted"
    GENERATING = "generating"
    COMPLETE = "complete"
    PARTIAL = "partial"
    CANCELLED = "cancelled"
    SCORED = "scored"
    CONSUMED = "consumed"
    DROPPED = "dropped"

    @property
    def is_open(self) -> bool:
        """Still generating or waiting to: samples may start, finish or be cancelled."""
        return self in _GROUP_OPEN

    @property
    def is_untrained(self) -> bool:
        """Admitted and neither consumed, dropped nor cancelled: it may still reach the trainer."""
        return self not in _GROUP_GONE

    @property
    def is_terminal(self) -> bool:
        """Nothing more can happen to it: consumed, dropped or cancelled."""
        return self in _GROUP_GONE


_GROUP_OPEN = frozenset({GroupStatus.ADMITTED, GroupStatus.GENERATING})
_GROUP_GONE = frozenset({GroupStatus.CONSUMED, GroupStatus.DROPPED, GroupStatus.CANCELLED})


class SampleStatus(StrEnum):
    STARTED = "started"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self is not SampleStatus.STARTED


class UpdateStatus(StrEnum):
    STAGED = "staged"
    PREPARING = "preparing"
    COMMITTED = "committed"
    ABORTED = "aborted"
    INVALIDATED = "invalidated"
    HEALTHY = "healthy"
    PUBLISHED = "published"

    @property
    def is_open(self) -> bool:
        """Neither aborted nor published: the transaction is still in flight."""
        return self not in _UPDATE_CLOSED

    @property
    def is_decided_commit(self) -> bool:
        """The commit is decided (it stands: a rank that missed it rolls forward to it)."""
        return self in _UPDATE_COMMITTED


_UPDATE_CLOSED = frozenset({UpdateStatus.ABORTED, UpdateStatus.PUBLISHED})
_UPDATE_COMMITTED = frozenset(
    {UpdateStatus.COMMITTED, UpdateStatus.INVALIDATED, UpdateStatus.HEALTHY, UpdateStatus.PUBLISHED}
)


class EngineStatus(StrEnum):
    AWAKE = "awake"
    PAUSED = "paused"
    ASLEEP = "asleep"
    QUARANTINED = "quarantined"

    @property
    def may_serve(self) -> bool:
        return self is EngineStatus.AWAKE
