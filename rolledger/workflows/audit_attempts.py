"""Weight-update attempts, as the audit and lineage see them: every event of one try at publishing a version.

A version may be tried more than once (staged again after an abort); `UpdateTracker` routes each weight-update event
to the attempt it belongs to (`route`, which may open one), files it there (`record`), or both (`apply`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rolledger.schemas.events import (
    CacheInvalidated,
    Event,
    HealthFailed,
    HealthPassed,
    PolicyPublished,
    PrepareRequested,
    RankCommitted,
    RankPrepared,
    RankPrepareFailed,
    UpdateAborted,
    UpdateCommitted,
    UpdateStaged,
)
from rolledger.workflows.dispatch import Handlers


@dataclass
class UpdateAttempt:
    """One try at publishing `version`: from UpdateStaged (or its first event) to commit/abort, then publication."""

    version: int
    staged: Event | None = None
    requested: Event | None = None
    prepared: dict[int, Event] = field(default_factory=dict)
    prepare_failed: dict[int, Event] = field(default_factory=dict)
    committed: Event | None = None
    aborted: Event | None = None
    rank_committed: dict[int, Event] = field(default_factory=dict)
    invalidated: dict[int, list[Event]] = field(default_factory=dict)
    health_passed: dict[int, Event] = field(default_factory=dict)
    health_failed: dict[int, Event] = field(default_factory=dict)
    published: Event | None = None

    @property
    def resolved(self) -> bool:
        return self.committed is not None or self.aborted is not None


class UpdateTracker:
    """Routes weight-update events to their attempt. `route` finds (or opens) the attempt without recording, so a
    checker can look at the state before the event; `record` then files the event; `apply` does both."""

    def __init__(self) -> None:
        self.attempts: dict[int, list[UpdateAttempt]] = {}

    def current(self, version: int) -> UpdateAttempt | None:
        tries = self.attempts.get(version)
        return tries[-1] if tries else None

    def new(self, version: int) -> UpdateAttempt:
        """Open a new attempt at `version`."""
        a = UpdateAttempt(version)
        self.attempts.setdefault(version, []).append(a)
        return a

    def pending(self) -> UpdateAttempt | None:
        """The newest attempt not yet committed or aborted."""
        best: UpdateAttempt | None = None
        for tries in self.attempts.values():
            a = tries[-1]
            if not a.resolved and (best is None or a.version > best.version):
                best = a
        return best

    def route(self, event: Event) -> UpdateAttempt | None:
        """The attempt `event` belongs to (opening one if it starts a new try), or None when it belongs to none."""
        return _ROUTE.apply(self, event)

    @staticmethod
    def record(attempt: UpdateAttempt, event: Event) -> None:
        """File `event` in `attempt`."""
        _RECORD.apply(attempt, event)

    def apply(self, event: Event) -> UpdateAttempt | None:
        a = self.route(event)
        if a is not None:
            self.record(a, event)
        return a


# ---------------------------------------------------------------- routing: which attempt an event belongs to
_ROUTE: Handlers[UpdateTracker, UpdateAttempt | None] = Handlers("update attempts: route")


@_ROUTE.on(UpdateStaged)
def _route_staged(t: UpdateTracker, e: Event, p: UpdateStaged) -> UpdateAttempt | None:
    return t.new(p.version)


def _route_rank_answer(t: UpdateTracker, e: Event, p: RankPrepared | RankPrepareFailed) -> UpdateAttempt | None:
    # a rank answering after its attempt was aborted (it was still reading when another rank failed) belongs to that
    # attempt: a version number is not retried, so it cannot open a new one
    cur = t.current(p.version)
    if cur is not None and cur.aborted is not None and cur.published is None:
        return cur
    return _route_live(t, e, p)


def _route_live(
    t: UpdateTracker, e: Event, p: PrepareRequested | RankPrepared | RankPrepareFailed
) -> UpdateAttempt | None:
    # a failure reported after the commit (phase="commit") belongs to the committed attempt
    cur = t.current(p.version)
    live = cur is not None and cur.aborted is None and cur.published is None
    return cur if live and cur is not None else t.new(p.version)


@_ROUTE.on(UpdateCommitted)
def _route_committed(t: UpdateTracker, e: Event, p: UpdateCommitted) -> UpdateAttempt | None:
    cur = t.current(p.version)
    live = cur is not None and cur.aborted is None and cur.published is None and cur.committed is None
    return cur if live and cur is not None else t.new(p.version)


@_ROUTE.on(UpdateAborted)
def _route_aborted(t: UpdateTracker, e: Event, p: UpdateAborted) -> UpdateAttempt | None:
    cur = t.current(p.version)
    return cur if cur is not None and cur.aborted is None else t.new(p.version)


def _route_after_commit(
    t: UpdateTracker, e: Event, p: RankCommitted | HealthPassed | HealthFailed | PolicyPublished
) -> UpdateAttempt | None:
    return t.current(p.version) or t.new(p.version)


# registered one class at a time: each registration checks the handler accepts that class
_ROUTE.on(PrepareRequested)(_route_live)
_ROUTE.on(RankPrepared)(_route_rank_answer)
_ROUTE.on(RankPrepareFailed)(_route_rank_answer)
_ROUTE.on(RankCommitted)(_route_after_commit)
_ROUTE.on(HealthPassed)(_route_after_commit)
_ROUTE.on(HealthFailed)(_route_after_commit)
_ROUTE.on(PolicyPublished)(_route_after_commit)


@_ROUTE.on(CacheInvalidated)
def _route_invalidated(t: UpdateTracker, e: Event, p: CacheInvalidated) -> UpdateAttempt | None:
    cur = t.current(p.version)
    return cur if cur is not None and cur.committed is not None and cur.published is None else None


# ---------------------------------------------------------------- recording: filing an event in its attempt
_RECORD: Handlers[UpdateAttempt, None] = Handlers("update attempts: record")


@_RECORD.on(UpdateStaged)
def _staged(a: UpdateAttempt, e: Event, p: UpdateStaged) -> None:
    a.staged = e


@_RECORD.on(PrepareRequested)
def _requested(a: UpdateAttempt, e: Event, p: PrepareRequested) -> None:
    a.requested = e


@_RECORD.on(RankPrepared)
def _prepared(a: UpdateAttempt, e: Event, p: RankPrepared) -> None:
    a.prepared[p.rank] = e


@_RECORD.on(RankPrepareFailed)
def _prepare_failed(a: UpdateAttempt, e: Event, p: RankPrepareFailed) -> None:
    a.prepare_failed[p.rank] = e


@_RECORD.on(UpdateCommitted)
def _committed(a: UpdateAttempt, e: Event, p: UpdateCommitted) -> None:
    a.committed = a.committed or e


@_RECORD.on(UpdateAborted)
def _aborted(a: UpdateAttempt, e: Event, p: UpdateAborted) -> None:
    a.aborted = a.aborted or e


@_RECORD.on(RankCommitted)
def _rank_committed(a: UpdateAttempt, e: Event, p: RankCommitted) -> None:
    a.rank_committed[p.rank] = e


@_RECORD.on(CacheInvalidated)
def _invalidated(a: UpdateAttempt, e: Event, p: CacheInvalidated) -> None:
    a.invalidated.setdefault(p.rank, []).append(e)


@_RECORD.on(HealthPassed)
def _health_passed(a: UpdateAttempt, e: Event, p: HealthPassed) -> None:
    a.health_passed[p.rank] = e
    a.health_failed.pop(p.rank, None)


@_RECORD.on(HealthFailed)
def _health_failed(a: UpdateAttempt, e: Event, p: HealthFailed) -> None:
    a.health_failed[p.rank] = e
    a.health_passed.pop(p.rank, None)


@_RECORD.on(PolicyPublished)
def _published(a: UpdateAttempt, e: Event, p: PolicyPublished) -> None:
    a.published = a.published or e
