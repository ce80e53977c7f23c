"""The reducer: `fold(state, event) -> state`, the only code that turns events into state.

Pure in the sense that matters for replay: it reads nothing but its two arguments (no I/O, no clock, no randomness),
so replaying one log always gives one state. For speed it updates the state object it is handed and returns it: the
caller gives the old state up (use `evolve` to keep it). An impossible transition (a sample finishing in an unknown
group, a commit without every rank prepared, a duplicate event id) is recorded in `state.anomalies`, never raised:
audit reports anomalies, and a live run keeps going on the part of the log that makes sense.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import EngineStatus, GroupStatus, RunStatus, SampleStatus, UpdateStatus
from rolledger.workflows.state import Anomaly, GroupState, RankState, RunState, SampleState, UpdateState

_RECENT_IDS = 1024

Handler = Callable[[RunState, ev.Event], None]
_HANDLERS: dict[str, Handler] = {}


def _on(cls: type[ev.Payload]) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        _HANDLERS[cls.model_fields["type"].default] = fn
        return fn

    return register


def _anomaly(state: RunState, event: ev.Event, message: str) -> None:
    state.anomalies.append(Anomaly(event.event_id, event.type, message))


def fold(state: RunState, event: ev.Event) -> RunState:
    """Apply one event. A duplicate event id (within the recent window) is recorded and not applied twice."""
    if event.event_id in state.recent_ids:
        _anomaly(state, event, "duplicate event id; not applied again")
        return state
    state.recent_ids[event.event_id] = None
    if len(state.recent_ids) > _RECENT_IDS:
        del state.recent_ids[next(iter(state.recent_ids))]
    if state.events_applied == 0:
        state.first_wall_time = event.wall_time
    state.last_wall_time = max(state.last_wall_time, event.wall_time)
    state.events_applied += 1
    state.last_event_id = event.event_id
    state.counts[event.type] = state.counts.get(event.type, 0) + 1
    _HANDLERS[event.type](state, event)
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


# ---------------------------------------------------------------- run
@_on(ev.RunStarted)
def _run_started(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.RunStarted)
    if s.status != "pending":
        _anomaly(s, e, f"RunStarted while the run is {s.status}")
        return
    s.run_id, s.config, s.status = e.run_id, p.config, RunStatus.RUNNING
    s.weights_digest = p.initial_weights_digest


@_on(ev.RunFinished)
def _run_finished(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.RunFinished)
    if s.status != "running":
        _anomaly(s, e, f"RunFinished while the run is {s.status}")
    s.status = RunStatus(p.status)


# ---------------------------------------------------------------- admission
@_on(ev.GroupAdmitted)
def _group_admitted(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.GroupAdmitted)
    if p.group_id in s.groups:
        _anomaly(s, e, f"group {p.group_id} admitted twice")
        return
    if s.admission.paused:
        _anomaly(s, e, f"group {p.group_id} admitted while admission is paused ({', '.join(s.admission.paused)})")
    s.groups[p.group_id] = GroupState(
        group_id=p.group_id,
        prompt_id=p.prompt_id,
        n=p.n,
        required=p.partial_policy.required(p.n),
        policy_kind=p.partial_policy.kind,
        admitted_event=e.event_id,
        admitted_version=e.policy_version,
        est_remaining_tokens=p.est_remaining_tokens,
        est_bytes=p.est_bytes,
        prompt_tokens=len(p.prompt_token_ids),
        deadline=p.deadline,
    )
    s.admission.admitted += 1
    s.admission.inflight += 1


@_on(ev.AdmissionPaused)
def _admission_paused(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.AdmissionPaused)
    if p.reason in s.admission.paused:
        _anomaly(s, e, f"admission already paused for {p.reason}")
        return
    s.admission.paused.append(p.reason)
    if p.reason == "update" and (u := s.open_update) is not None:
        u.paused_at = e.wall_time
    if p.reason == "handoff":
        s.admission.handoff_step = s.trainer.step


@_on(ev.AdmissionResumed)
def _admission_resumed(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.AdmissionResumed)
    if p.reason not in s.admission.paused:
        _anomaly(s, e, f"admission resumed for {p.reason} but it was not paused for it")
        return
    s.admission.paused.remove(p.reason)


# ---------------------------------------------------------------- rollout
def _group(s: RunState, e: ev.Event, group_id: str) -> GroupState | None:
    g = s.groups.get(group_id)
    if g is None:
        _anomaly(s, e, f"unknown group {group_id}")
    return g


@_on(ev.SampleStarted)
def _sample_started(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.SampleStarted)
    g = _group(s, e, p.group_id)
    if g is None:
        return
    # A group the coordinator closed while a worker was starting it is a race, not an error: the worker sees the
    # closure and ends the sample with SampleCancelled, which invariant 7 checks.
    if p.index in g.samples:
        _anomaly(s, e, f"sample {p.sample_id} started twice")
        return
    if g.status == "admitted":
        g.status = GroupStatus.GENERATING
        rank = s.ranks.get(p.rank)
        if rank is not None:
            rank.groups_generated += 1
    g.samples[p.index] = SampleState(
        p.sample_id, p.index, SampleStatus.STARTED, p.rank, p.policy_version, p.weights_digest
    )


def _sample(
    s: RunState, e: ev.Event, group_id: str, index: int, sample_id: str
) -> tuple[GroupState, SampleState] | None:
    g = _group(s, e, group_id)
    if g is None:
        return None
    smp = g.samples.get(index)
    if smp is None:
        _anomaly(s, e, f"sample {sample_id} has no SampleStarted")
        smp = g.samples[index] = SampleState(sample_id, index, SampleStatus.STARTED, -1, e.policy_version)
    elif smp.status != "started":
        _anomaly(s, e, f"sample {sample_id} already {smp.status}")
        return None
    return g, smp


@_on(ev.SampleFinished)
def _sample_finished(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.SampleFinished)
    t = p.trajectory
    found = _sample(s, e, t.group_id, t.index, t.trajectory_id)
    if found is None:
        return
    g, smp = found
    smp.status, smp.tokens = SampleStatus.FINISHED, len(t.token_ids)
    if t.policy_version != smp.policy_version and smp.rank >= 0 and not t.spans:  # spans: interruptible, stamped
        _anomaly(s, e, f"sample {t.trajectory_id} started on v{smp.policy_version}, finished on v{t.policy_version}")
    smp.policy_version, smp.weights_digest = t.policy_version, t.weights_digest
    for v in t.versions:
        if v not in g.versions:
            g.versions.append(v)
            g.versions.sort()


@_on(ev.SampleFailed)
def _sample_failed(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.SampleFailed)
    found = _sample(s, e, p.group_id, p.index, p.sample_id)
    if found is not None:
        found[1].status = SampleStatus.FAILED


@_on(ev.SampleCancelled)
def _sample_cancelled(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.SampleCancelled)
    g = _group(s, e, p.group_id)
    if g is None:
        return
    smp = g.samples.get(p.index)
    if smp is None:  # cancelled before it started: a legal end for a never-started sample
        g.samples[p.index] = SampleState(p.sample_id, p.index, SampleStatus.CANCELLED, -1, e.policy_version)
    elif smp.status != "started":
        _anomaly(s, e, f"sample {p.sample_id} already {smp.status}")
    else:
        smp.status = SampleStatus.CANCELLED


def _maybe_scored(g: GroupState) -> None:
    if g.status in ("complete", "partial") and all(
        g.samples[int(sid.rsplit("/", 1)[1])].reward is not None for sid in g.accepted
    ):
        g.status = GroupStatus.SCORED


@_on(ev.GroupCompleted)
def _group_completed(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.GroupCompleted)
    g = _group(s, e, p.group_id)
    if g is None:
        return
    if g.status not in ("admitted", "generating"):
        _anomaly(s, e, f"group {p.group_id} completed while {g.status}")
        return
    for sid in p.accepted:
        smp = g.samples.get(int(sid.rsplit("/", 1)[1]))
        if smp is None or smp.status != "finished":
            _anomaly(s, e, f"group {p.group_id} accepts {sid}, which did not finish")
    if len(p.accepted) < g.required:
        _anomaly(s, e, f"group {p.group_id} completed with {len(p.accepted)} < {g.required} required samples")
    g.status, g.accepted, g.bytes = GroupStatus(p.status), list(p.accepted), p.bytes
    s.admission.inflight -= 1
    s.admission.queued_bytes += p.bytes
    s.admission.max_queued_bytes = max(s.admission.max_queued_bytes, s.admission.queued_bytes)
    _maybe_scored(g)


@_on(ev.GroupCancelled)
def _group_cancelled(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.GroupCancelled)
    g = _group(s, e, p.group_id)
    if g is None:
        return
    if g.status in ("admitted", "generating"):
        s.admission.inflight -= 1
    elif g.status in ("complete", "partial", "scored"):
        s.admission.queued_bytes -= g.bytes
    else:
        _anomaly(s, e, f"group {p.group_id} cancelled while {g.status}")
        return
    g.status = GroupStatus.CANCELLED


# ---------------------------------------------------------------- reward
@_on(ev.SampleScored)
def _sample_scored(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.SampleScored)
    g = _group(s, e, p.group_id)
    if g is None:
        return
    smp = g.samples.get(int(p.sample_id.rsplit("/", 1)[1]))
    if smp is None or smp.status != "finished":
        _anomaly(s, e, f"score for {p.sample_id}, which did not finish")
        return
    if smp.reward is not None:
        _anomaly(s, e, f"{p.sample_id} scored twice")
        return
    smp.reward, smp.correct = p.reward, p.correct
    g.scored += 1
    _maybe_scored(g)


# ---------------------------------------------------------------- trainer
@_on(ev.BatchConsumed)
def _batch_consumed(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.BatchConsumed)
    for gid, lag in zip(p.group_ids, p.lags, strict=False):
        g = _group(s, e, gid)
        if g is None:
            continue
        if g.status != "scored":
            _anomaly(s, e, f"group {gid} consumed while {g.status}")
            if g.status == "consumed":
                continue
        if g.status in ("complete", "partial", "scored"):
            s.admission.queued_bytes -= g.bytes
        g.status, g.consumed_step = GroupStatus.CONSUMED, p.step
        s.trainer.lag_histogram[lag] = s.trainer.lag_histogram.get(lag, 0) + 1
        s.trainer.max_lag = max(s.trainer.max_lag, lag)
        s.trainer.consumed_groups += 1
    s.trainer.consumed_trajectories += len(p.trajectory_ids)


@_on(ev.TrajectoryDropped)
def _trajectory_dropped(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.TrajectoryDropped)
    g = _group(s, e, p.group_id)
    if g is None:
        return
    if g.status in ("complete", "partial", "scored"):
        s.admission.queued_bytes -= g.bytes
    elif g.status in ("admitted", "generating"):
        s.admission.inflight -= 1
    else:
        _anomaly(s, e, f"group {p.group_id} dropped while {g.status}")
        return
    g.status = GroupStatus.DROPPED
    s.trainer.dropped_trajectories += len(p.trajectory_ids)


@_on(ev.TrainStepFinished)
def _train_step(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.TrainStepFinished)
    s.trainer.step = p.step
    s.trainer.rewards.append(p.reward_mean)
    if p.agreement_tokens:
        s.trainer.logprob_gaps.append(p.logprob_gap_median)


# ---------------------------------------------------------------- weight update
def _update(s: RunState, e: ev.Event, version: int) -> UpdateState | None:
    u = s.updates.get(version)
    if u is None:
        _anomaly(s, e, f"unknown update version {version}")
    return u


@_on(ev.UpdateStaged)
def _update_staged(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.UpdateStaged)
    if p.version in s.updates:
        _anomaly(s, e, f"version {p.version} staged twice")
        return
    if p.version <= s.policy_version:
        _anomaly(s, e, f"version {p.version} staged at or below the published v{s.policy_version}")
    s.updates[p.version] = UpdateState(
        p.version, p.base_version, p.manifest_digest, p.weights_digest, p.uri, p.bytes, e.event_id
    )


@_on(ev.PrepareRequested)
def _prepare_requested(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.PrepareRequested)
    u = _update(s, e, p.version)
    if u is None:
        return
    if u.status != "staged":
        _anomaly(s, e, f"prepare of v{p.version} requested while {u.status}")
        return
    for name, sent, staged in (("uri", p.uri, u.uri), ("weights digest", p.weights_digest, u.weights_digest)):
        if sent and sent != staged:  # empty: a v1 command, which names only the staged record
            _anomaly(
                s, e, f"prepare of v{p.version} names {name} {sent!r}, but v{p.version} was staged with {staged!r}"
            )
    u.status, u.ranks, u.fence, u.deadline = UpdateStatus.PREPARING, list(p.ranks), p.fence, p.deadline


@_on(ev.RankPrepared)
def _rank_prepared(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.RankPrepared)
    u = _update(s, e, p.version)
    if u is None:
        return
    if p.manifest_digest != u.manifest_digest:
        _anomaly(
            s, e, f"rank {p.rank} prepared v{p.version} with manifest {p.manifest_digest}, not {u.manifest_digest}"
        )
        return
    if u.status == "aborted":  # a rank finishing its prepare after the abort: legal, and changes nothing
        return
    if u.status != "preparing":
        _anomaly(s, e, f"rank {p.rank} prepared v{p.version} while the update is {u.status}")
    u.prepared[p.rank] = p.staged_digest


@_on(ev.RankPrepareFailed)
def _rank_prepare_failed(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.RankPrepareFailed)
    u = _update(s, e, p.version)
    if u is not None:
        u.failed[p.rank] = f"{p.phase}: {p.reason}"


@_on(ev.UpdateCommitted)
def _update_committed(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.UpdateCommitted)
    u = _update(s, e, p.version)
    if u is None:
        return
    if u.status != "preparing":
        _anomaly(s, e, f"v{p.version} committed while {u.status}")
        return
    if p.weights_digest and p.weights_digest != u.weights_digest:
        _anomaly(s, e, f"v{p.version} committed to weights {p.weights_digest!r}, but staged {u.weights_digest!r}")
    missing = [r for r in p.ranks if r not in u.prepared]
    if missing or not p.ranks:
        _anomaly(s, e, f"v{p.version} committed without RankPrepared from ranks {missing}")
    u.status, u.decided_event, u.committed_at = UpdateStatus.COMMITTED, e.event_id, e.wall_time


@_on(ev.UpdateAborted)
def _update_aborted(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.UpdateAborted)
    u = _update(s, e, p.version)
    if u is None:
        return
    if u.status not in ("staged", "preparing"):
        _anomaly(s, e, f"v{p.version} aborted while {u.status}")
        return
    u.status, u.abort_reason, u.decided_event = UpdateStatus.ABORTED, p.reason, e.event_id
    for r in u.ranks:
        if (rank := s.ranks.get(r)) is not None and rank.status == "asleep":
            rank.wake_on_abort = True


@_on(ev.RankCommitted)
def _rank_committed(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.RankCommitted)
    u = _update(s, e, p.version)
    if u is None:
        return
    if u.status in ("staged", "preparing", "aborted"):
        _anomaly(s, e, f"rank {p.rank} swapped in v{p.version}, which is {u.status}")
        return
    u.committed[p.rank] = p.weights_digest
    rank = s.ranks.get(p.rank)
    if rank is None:
        _anomaly(s, e, f"unknown rank {p.rank}")
        return
    if rank.status == "asleep" and "weights" not in rank.woke:
        _anomaly(s, e, f"rank {p.rank} swapped weights while asleep")
    rank.committed_version, rank.weights_digest = p.version, p.weights_digest


@_on(ev.CacheInvalidated)
def _cache_invalidated(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.CacheInvalidated)
    rank = s.ranks.get(p.rank)
    if rank is None:
        _anomaly(s, e, f"unknown rank {p.rank}")
        return
    if p.kind == "graph":
        rank.graph_generation = p.generation
    else:
        rank.cache_generation = p.generation
    u = s.updates.get(p.version)
    if u is not None and p.kind != "graph":
        u.invalidated[p.rank] = p.generation
        if u.status == "committed" and all(r in u.invalidated for r in u.ranks):
            u.status = UpdateStatus.INVALIDATED


@_on(ev.HealthPassed)
def _health_passed(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.HealthPassed)
    u = s.updates.get(p.version)
    if u is None:  # a probe outside an update (a rank joining): nothing to track
        return
    if p.rank not in u.healthy:
        u.healthy.append(p.rank)
    u.probe_digests[p.rank] = p.probe_digest
    if u.status in ("committed", "invalidated") and all(r in u.healthy for r in u.ranks):
        u.status = UpdateStatus.HEALTHY


@_on(ev.HealthFailed)
def _health_failed(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.HealthFailed)
    u = s.updates.get(p.version)
    if u is not None:
        u.failed[p.rank] = f"health: {p.reason}"


@_on(ev.PolicyPublished)
def _policy_published(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.PolicyPublished)
    u = _update(s, e, p.version)
    if u is None:
        return
    if u.status in ("staged", "preparing", "aborted", "published"):
        _anomaly(s, e, f"v{p.version} published while {u.status}")
        return
    for r in p.ranks:
        if u.committed.get(r) != p.weights_digest:
            _anomaly(s, e, f"v{p.version} published but rank {r} holds {u.committed.get(r)!r}")
    u.status = UpdateStatus.PUBLISHED
    s.policy_version, s.weights_digest = p.version, p.weights_digest


# ---------------------------------------------------------------- engine
def _rank(s: RunState, e: ev.Event, rank: int) -> RankState | None:
    r = s.ranks.get(rank)
    if r is None:
        _anomaly(s, e, f"unknown rank {rank}")
    return r


@_on(ev.EngineSlept)
def _engine_slept(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.EngineSlept)
    r = _rank(s, e, p.rank)
    if r is None:
        return
    if r.status == "asleep":
        _anomaly(s, e, f"rank {p.rank} slept twice")
    r.status, r.sleep_level, r.woke = EngineStatus.ASLEEP, p.level, []
    r.slept_in_handoff, r.wake_on_abort = s.admission.handoff_step if "handoff" in s.admission.paused else -1, False


@_on(ev.EngineWoke)
def _engine_woke(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.EngineWoke)
    r = _rank(s, e, p.rank)
    if r is None:
        return
    if r.status != "asleep":
        _anomaly(s, e, f"rank {p.rank} woke while {r.status}")
        return
    for tag in p.tags:
        if tag == "kv_cache" and "weights" not in r.woke and "weights" not in p.tags:
            _anomaly(s, e, f"rank {p.rank} woke kv_cache before weights")
        if tag not in r.woke:
            r.woke.append(tag)
    if "weights" in r.woke and "kv_cache" in r.woke:
        r.status, r.sleep_level, r.woke, r.wake_on_abort = EngineStatus.PAUSED, 0, [], False


@_on(ev.EnginePaused)
def _engine_paused(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.EnginePaused)
    r = _rank(s, e, p.rank)
    if r is None:
        return
    if r.status == "awake":
        r.status = EngineStatus.PAUSED
    if (u := s.open_update) is not None and p.rank in u.ranks:
        r.drained_for = u.version


@_on(ev.EngineResumed)
def _engine_resumed(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.EngineResumed)
    r = _rank(s, e, p.rank)
    if r is None:
        return
    if r.status == "asleep":
        _anomaly(s, e, f"rank {p.rank} resumed while asleep")
        return
    if r.status == "paused":
        r.status = EngineStatus.AWAKE


@_on(ev.RankJoined)
def _rank_joined(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.RankJoined)
    r = s.ranks.get(p.rank)
    if r is None:
        r = s.ranks[p.rank] = RankState(p.rank, p.engine)
    elif r.status != "quarantined":
        _anomaly(s, e, f"rank {p.rank} joined twice")
    r.status, r.engine, r.sleep_level, r.woke = EngineStatus.AWAKE, p.engine, 0, []
    r.committed_version, r.weights_digest = p.policy_version, p.weights_digest
    r.sleep_levels, r.logprob_mode = list(p.sleep_levels), p.logprob_mode


@_on(ev.RankQuarantined)
def _rank_quarantined(s: RunState, e: ev.Event) -> None:
    p = e.payload
    assert isinstance(p, ev.RankQuarantined)
    r = _rank(s, e, p.rank)
    if r is not None:
        r.status = EngineStatus.QUARANTINED
    u = s.updates.get(p.version)
    if u is not None and p.rank not in u.quarantined:
        u.quarantined.append(p.rank)


@_on(ev.CommandRefused)
def _command_refused(s: RunState, e: ev.Event) -> None:
    """Refusals change no state; they are counted in `counts` and explained by audit."""


_missing = set(ev.PAYLOAD_TYPES) - set(_HANDLERS)
if _missing:  # pragma: no cover - caught at import by every test
    raise ImportError(f"reducer has no handler for {sorted(_missing)}")
