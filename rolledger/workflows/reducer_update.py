"""The reducer's weight-update events: the transaction of one version, from UpdateStaged to PolicyPublished."""

from __future__ import annotations

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import EngineStatus, UpdateStatus, WakeTag
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.reducer_common import anomaly, find_update, moving_average
from rolledger.workflows.state import (
    UPDATE_TOMBSTONES_KEPT,
    UPDATES_KEPT,
    RetiredUpdate,
    RunState,
    UpdateState,
    keep_newest,
)

handlers: Handlers[RunState, None] = Handlers("reducer: weight update")

_HEALTH_PENDING = frozenset({UpdateStatus.COMMITTED, UpdateStatus.INVALIDATED})  # swapped in, health not yet passed


@handlers.on(ev.UpdateStaged)
def _update_staged(s: RunState, e: ev.Event, p: ev.UpdateStaged) -> None:
    if p.version in s.updates or p.version in s.retired_updates:
        anomaly(s, e, f"version {p.version} staged twice")
        return
    if p.version <= s.policy_version:
        anomaly(s, e, f"version {p.version} staged at or below the published v{s.policy_version}")
    s.updates[p.version] = UpdateState(
        p.version, p.base_version, p.manifest_digest, p.weights_digest, p.uri, p.bytes, e.event_id
    )
    s.updates[p.version].staged_at = e.wall_time


def _step_done(s: RunState, e: ev.Event, u: UpdateState) -> None:
    """An update closed: the trainer's step that staged it is over (its training, then the transaction)."""
    if u.staged_at:
        busy = s.trainer.last_train_s + max(e.wall_time - u.staged_at, 0.0)
        s.admission.step_busy_s = moving_average(s.admission.step_busy_s, busy)
    forget_progress(u)
    if u.status == UpdateStatus.PUBLISHED:
        s.updates_published += 1
    else:
        s.updates_aborted += 1


def retire_updates(s: RunState) -> None:
    """Closed update records that no decider reads any more leave `updates`, a tombstone (`RetiredUpdate`) in their
    place; run after every close. Kept, whatever their age: the newest UPDATES_KEPT closed ones; every one at or above
    the published version (the run of aborts since it, which the coordinator counts, and the next version's number);
    each rank's committed version (the source and cause of its reload or rejoin); and the newest closed update each
    rank took part in (what resumes it). So every decider decides as it would with every record kept
    (tests/test_reducer_bounded.py), and the state holds O(ranks + UPDATES_KEPT) closed records however long the run.
    A late event for a retired version is judged by its tombstone (workflows/reducer_common.find_update)."""
    closed = sorted(v for v, u in s.updates.items() if not u.open)
    if len(closed) <= UPDATES_KEPT:
        return
    needed = {r.committed_version for r in s.ranks.values()}
    seen: set[int] = set()  # ranks whose newest closed update is found (newest first: one pass, O(records x ranks))
    for v in reversed(closed):
        for rank in s.updates[v].ranks:
            if rank not in seen:
                seen.add(rank)
                needed.add(v)
    for v in closed[: len(closed) - UPDATES_KEPT]:
        if v >= s.policy_version or v in needed:
            continue
        u = s.updates.pop(v)
        keep_newest(s.retired_updates, v, RetiredUpdate(u.status, u.closing_event), UPDATE_TOMBSTONES_KEPT)


def forget_progress(u: UpdateState) -> None:
    """A closed update's per-rank progress (prepared, committed, invalidated, healthy, probe digests) leaves the
    state: only an open transaction's is ever read (the coordinator's and the ranks' deciders look at `open_update`;
    a late event for a closed one reads none of it), and with 16 ranks it was ~2 kB a version kept for the whole run.
    The record stays (status, digests, uri, ranks, failures, the events that opened and closed it); the audit and
    lineage fold the log themselves."""
    u.prepared, u.committed, u.invalidated, u.probe_digests, u.healthy = {}, {}, {}, {}, []


@handlers.on(ev.PrepareRequested)
def _prepare_requested(s: RunState, e: ev.Event, p: ev.PrepareRequested) -> None:
    u = find_update(s, e, p.version)
    if u is None:
        return
    if u.status != UpdateStatus.STAGED:
        anomaly(s, e, f"prepare of v{p.version} requested while {u.status}")
        return
    for name, sent, staged in (("uri", p.uri, u.uri), ("weights digest", p.weights_digest, u.weights_digest)):
        if sent and sent != staged:  # empty: a v1 command, which names only the staged record
            anomaly(s, e, f"prepare of v{p.version} names {name} {sent!r}, but v{p.version} was staged with {staged!r}")
    u.status, u.ranks, u.fence, u.deadline = UpdateStatus.PREPARING, list(p.ranks), p.fence, p.deadline
    u.prepare_event = e.event_id


@handlers.on(ev.RankPrepared)
def _rank_prepared(s: RunState, e: ev.Event, p: ev.RankPrepared) -> None:
    gone = s.retired_updates.get(p.version)
    if gone is not None:  # a late prepare of a retired version: legal after its abort (below), else an anomaly
        if gone.status != UpdateStatus.ABORTED:
            anomaly(s, e, f"rank {p.rank} prepared v{p.version} while the update is {gone.status}")
        return
    u = find_update(s, e, p.version)
    if u is None:
        return
    if p.manifest_digest != u.manifest_digest:
        anomaly(s, e, f"rank {p.rank} prepared v{p.version} with manifest {p.manifest_digest}, not {u.manifest_digest}")
        return
    if u.status == UpdateStatus.ABORTED:  # a rank finishing its prepare after the abort: legal, and changes nothing
        return
    if u.status != UpdateStatus.PREPARING:
        anomaly(s, e, f"rank {p.rank} prepared v{p.version} while the update is {u.status}")
        if not u.open:
            return  # a closed transaction keeps no progress (forget_progress)
    u.prepared[p.rank] = p.staged_digest


@handlers.on(ev.RankPrepareFailed)
def _rank_prepare_failed(s: RunState, e: ev.Event, p: ev.RankPrepareFailed) -> None:
    if p.version in s.retired_updates:
        return  # a late failure of a retired version: its record, where it would be noted, left the state
    u = find_update(s, e, p.version)
    if u is not None:
        u.failed[p.rank] = f"{p.phase}: {p.reason}"


@handlers.on(ev.UpdateCommitted)
def _update_committed(s: RunState, e: ev.Event, p: ev.UpdateCommitted) -> None:
    u = find_update(s, e, p.version)
    if u is None:
        return
    if u.status != UpdateStatus.PREPARING:
        anomaly(s, e, f"v{p.version} committed while {u.status}")
        return
    if p.weights_digest and p.weights_digest != u.weights_digest:
        anomaly(s, e, f"v{p.version} committed to weights {p.weights_digest!r}, but staged {u.weights_digest!r}")
    missing = [r for r in p.ranks if r not in u.prepared]
    if missing or not p.ranks:
        anomaly(s, e, f"v{p.version} committed without RankPrepared from ranks {missing}")
    u.status, u.decided_event, u.committed_at = UpdateStatus.COMMITTED, e.event_id, e.wall_time


@handlers.on(ev.UpdateAborted)
def _update_aborted(s: RunState, e: ev.Event, p: ev.UpdateAborted) -> None:
    u = find_update(s, e, p.version)
    if u is None:
        return
    if not u.status.is_undecided:
        anomaly(s, e, f"v{p.version} aborted while {u.status}")
        return
    u.status, u.abort_reason, u.decided_event = UpdateStatus.ABORTED, p.reason, e.event_id
    _step_done(s, e, u)
    for r in u.ranks:
        if (rank := s.ranks.get(r)) is not None and rank.status is EngineStatus.ASLEEP:
            rank.wake_on_abort, rank.abort_event = True, e.event_id
    retire_updates(s)


@handlers.on(ev.RankCommitted)
def _rank_committed(s: RunState, e: ev.Event, p: ev.RankCommitted) -> None:
    u = find_update(s, e, p.version)  # a retired version is an anomaly: no rank swaps in weights that old
    if u is None:
        return
    if not u.status.is_decided_commit:
        anomaly(s, e, f"rank {p.rank} swapped in v{p.version}, which is {u.status}")
        return
    if u.open:  # a closed transaction keeps no progress (forget_progress)
        u.committed[p.rank] = p.weights_digest
    rank = s.ranks.get(p.rank)
    if rank is None:
        anomaly(s, e, f"unknown rank {p.rank}")
        return
    if rank.status == EngineStatus.ASLEEP and WakeTag.WEIGHTS not in rank.woke:
        anomaly(s, e, f"rank {p.rank} swapped weights while asleep")
    rank.committed_version, rank.weights_digest = p.version, p.weights_digest


@handlers.on(ev.CacheInvalidated)
def _cache_invalidated(s: RunState, e: ev.Event, p: ev.CacheInvalidated) -> None:
    rank = s.ranks.get(p.rank)
    if rank is None:
        anomaly(s, e, f"unknown rank {p.rank}")
        return
    if p.kind.is_graph:
        rank.graph_generation = p.generation
    else:
        rank.cache_generation = p.generation
    u = s.updates.get(p.version)
    if u is not None and u.open and not p.kind.is_graph:  # (a closed transaction keeps no progress)
        u.invalidated[p.rank] = p.generation
        if u.status == UpdateStatus.COMMITTED and all(r in u.invalidated for r in u.ranks):
            u.status = UpdateStatus.INVALIDATED


@handlers.on(ev.HealthPassed)
def _health_passed(s: RunState, e: ev.Event, p: ev.HealthPassed) -> None:
    u = s.updates.get(p.version)
    if u is None or not u.open:  # a probe outside an update (a rank joining), or a late one: nothing to track
        return
    if p.rank not in u.healthy:
        u.healthy.append(p.rank)
    u.probe_digests[p.rank] = p.probe_digest
    if u.status in _HEALTH_PENDING and all(r in u.healthy for r in u.ranks):
        u.status = UpdateStatus.HEALTHY


@handlers.on(ev.HealthFailed)
def _health_failed(s: RunState, e: ev.Event, p: ev.HealthFailed) -> None:
    u = s.updates.get(p.version)
    if u is not None:
        u.failed[p.rank] = f"health: {p.reason}"


@handlers.on(ev.PolicyPublished)
def _policy_published(s: RunState, e: ev.Event, p: ev.PolicyPublished) -> None:
    u = find_update(s, e, p.version)
    if u is None:
        return
    if not u.status.is_swappable:
        anomaly(s, e, f"v{p.version} published while {u.status}")
        return
    for r in p.ranks:
        if u.committed.get(r) != p.weights_digest:
            anomaly(s, e, f"v{p.version} published but rank {r} holds {u.committed.get(r)!r}")
    u.status, u.published_event = UpdateStatus.PUBLISHED, e.event_id
    _step_done(s, e, u)
    s.policy_version, s.weights_digest = p.version, p.weights_digest
    retire_updates(s)
