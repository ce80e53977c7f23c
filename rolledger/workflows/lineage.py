"""`rolledger lineage`: the provenance chain of one trajectory, as a pure function over the event log.

trajectory -> its sample (SampleStarted/SampleFinished) and group (GroupAdmitted, GroupCompleted) -> the sampling
settings -> the policy version of every span -> for each version, where the weights came from: version 0 is the
initial weights (RunStarted), any other the update attempt that published it (UpdateStaged manifest digest and uri,
the ranks that prepared that manifest, UpdateCommitted, PolicyPublished) plus the aborted attempts at the same
version -> the rank that generated it (its committed weights digest and the command that swap answered (its causation
id), the CacheInvalidated events that made its cache and graph generations, its health check) -> the reward (SampleScored) -> the trainer step that consumed it
(BatchConsumed, its lag, TrainStepFinished) or the drop that refused it.

No Redis, no I/O. Two folds of the log (workflows.dispatch registries): the whole log for the trajectory's facts, and
the log up to its start for its rank's. The result's model and rendering are in lineage_model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from rolledger.schemas.events import (
    BatchConsumed,
    CacheInvalidated,
    Event,
    GroupAdmitted,
    GroupCancelled,
    GroupCompleted,
    HealthPassed,
    PolicyPublished,
    RankCommitted,
    RankJoined,
    RankPrepared,
    RunStarted,
    SampleFinished,
    SampleScored,
    SampleStarted,
    TrainStepFinished,
    TrajectoryDropped,
    UpdateAborted,
    UpdateCommitted,
    UpdateStaged,
)
from rolledger.schemas.trajectory import Trajectory
from rolledger.workflows.audit_attempts import UpdateTracker
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.lineage_model import (
    AbortedAttempt,
    ConsumptionLink,
    DropLink,
    GroupFate,
    GroupLink,
    Lineage,
    PolicyLink,
    PolicySource,
    PreparedRank,
    RankLink,
    RewardLink,
    SampleLink,
)


def _policy_link(version: int, tracker: UpdateTracker, run_started: Event | None) -> PolicyLink:
    """Where `version` came from; `aborted_attempts` are the aborted updates since the previous published version
    (earlier tries at this version, or versions that never made it in between)."""
    attempts = tracker.attempts.get(version, [])
    previous = max(
        (v for v, tries in tracker.attempts.items() if v < version and any(a.published for a in tries)), default=0
    )
    between = [a for v in sorted(tracker.attempts) if previous < v <= version for a in tracker.attempts[v]]
    aborted = tuple(
        AbortedAttempt(
            version=a.version,
            event_id=a.aborted.event_id,
            reason=a.aborted.payload.reason,
            failed_ranks=a.aborted.payload.failed_ranks,
            manifest_digest=a.staged.payload.manifest_digest
            if a.staged is not None and isinstance(a.staged.payload, UpdateStaged)
            else None,
        )
        for a in between
        if a.aborted is not None and isinstance(a.aborted.payload, UpdateAborted)
    )
    if version == 0:
        rs = run_started.payload if run_started is not None else None
        return PolicyLink(
            0,
            PolicySource.INITIAL,
            rs.initial_weights_digest if isinstance(rs, RunStarted) else None,
            run_started_event_id=run_started.event_id if run_started is not None else None,
            aborted_attempts=aborted,
        )
    published = [a for a in attempts if a.published is not None and a.aborted is None]
    chosen = published[-1] if published else next((a for a in reversed(attempts) if a.committed is not None), None)
    if chosen is None:
        return PolicyLink(version, PolicySource.UNKNOWN, None, aborted_attempts=aborted)
    st = chosen.staged.payload if chosen.staged is not None else None
    cm = chosen.committed.payload if chosen.committed is not None else None
    pb = chosen.published.payload if chosen.published is not None else None
    manifest = st.manifest_digest if isinstance(st, UpdateStaged) else None
    if isinstance(cm, UpdateCommitted):
        manifest = cm.manifest_digest
    weights = st.weights_digest if isinstance(st, UpdateStaged) else None
    if isinstance(pb, PolicyPublished):
        weights = pb.weights_digest
    prepared = tuple(
        PreparedRank(r, e.event_id, e.payload.manifest_digest, e.payload.staged_digest)
        for r, e in sorted(chosen.prepared.items())
        if isinstance(e.payload, RankPrepared)
    )
    return PolicyLink(
        version=version,
        source=PolicySource.UPDATE,
        weights_digest=weights,
        staged_event_id=chosen.staged.event_id if chosen.staged is not None else None,
        base_version=st.base_version if isinstance(st, UpdateStaged) else None,
        manifest_digest=manifest,
        uri=st.uri if isinstance(st, UpdateStaged) else None,
        bytes=st.bytes if isinstance(st, UpdateStaged) else None,
        prepared=prepared,
        committed_event_id=chosen.committed.event_id if chosen.committed is not None else None,
        committed_ranks=cm.ranks if isinstance(cm, UpdateCommitted) else (),
        fence=cm.fence if isinstance(cm, UpdateCommitted) else None,
        published_event_id=chosen.published.event_id if chosen.published is not None else None,
        published_ranks=pb.ranks if isinstance(pb, PolicyPublished) else (),
        aborted_attempts=aborted,
    )


# ---------------------------------------------------------------- the fold over the whole log
@dataclass
class _Scan:
    """What the log says about one trajectory: its start, group, reward, consumption or drop."""

    trajectory_id: str
    group_id: str
    finished_at: int  # position of its SampleFinished
    i: int = 0  # position of the event being folded
    cut: int = 0  # position of its SampleStarted (or SampleFinished): rank facts are those known then
    run_started: Event | None = None
    start: Event | None = None
    admitted: Event | None = None
    outcome: Event | None = None
    reward: Event | None = None
    consumed: Event | None = None
    dropped: Event | None = None
    train_step: Event | None = None


_SCAN: Handlers[_Scan, None] = Handlers("lineage")


@_SCAN.on(RunStarted)
def _run_started(s: _Scan, e: Event, p: RunStarted) -> None:
    if s.run_started is None:
        s.run_started = e


@_SCAN.on(SampleStarted)
def _sample_started(s: _Scan, e: Event, p: SampleStarted) -> None:
    if p.sample_id == s.trajectory_id and s.i < s.finished_at:
        s.start, s.cut = e, s.i


@_SCAN.on(GroupAdmitted)
def _group_admitted(s: _Scan, e: Event, p: GroupAdmitted) -> None:
    if p.group_id == s.group_id and s.admitted is None:
        s.admitted = e


def _group_outcome(s: _Scan, e: Event, p: GroupCompleted | GroupCancelled) -> None:
    if p.group_id == s.group_id:
        s.outcome = e


_SCAN.on(GroupCompleted)(_group_outcome)
_SCAN.on(GroupCancelled)(_group_outcome)


@_SCAN.on(SampleScored)
def _sample_scored(s: _Scan, e: Event, p: SampleScored) -> None:
    if p.sample_id == s.trajectory_id and s.reward is None:
        s.reward = e


@_SCAN.on(BatchConsumed)
def _batch_consumed(s: _Scan, e: Event, p: BatchConsumed) -> None:
    if s.trajectory_id in p.trajectory_ids and s.consumed is None:
        s.consumed = e


@_SCAN.on(TrainStepFinished)
def _train_step(s: _Scan, e: Event, p: TrainStepFinished) -> None:
    if s.consumed is not None and s.train_step is None:
        assert isinstance(s.consumed.payload, BatchConsumed)
        if p.step == s.consumed.payload.step:
            s.train_step = e


@_SCAN.on(TrajectoryDropped)
def _dropped(s: _Scan, e: Event, p: TrajectoryDropped) -> None:
    if s.trajectory_id in p.trajectory_ids and s.dropped is None:
        s.dropped = e


# ---------------------------------------------------------------- the fold up to the sample's start: its rank
@dataclass
class _RankFacts:
    """The generating rank as the log knew it when the sample started."""

    rank: int
    policy_version: int
    cache_generation: int
    graph_generation: int
    weights: Event | None = None  # newest RankCommitted/RankJoined of the rank
    cache: Event | None = None  # the CacheInvalidated that made its cache generation
    graph: Event | None = None
    health: Event | None = None


_RANK_FACTS: Handlers[_RankFacts, None] = Handlers("lineage: rank")


def _rank_weights(r: _RankFacts, e: Event, p: RankCommitted | RankJoined) -> None:
    if p.rank == r.rank:
        r.weights = e
        if isinstance(p, RankJoined):  # a rejoined rank starts its generations afresh
            r.cache = r.graph = None


_RANK_FACTS.on(RankCommitted)(_rank_weights)
_RANK_FACTS.on(RankJoined)(_rank_weights)


@_RANK_FACTS.on(CacheInvalidated)
def _cache_invalidated(r: _RankFacts, e: Event, p: CacheInvalidated) -> None:
    if p.rank != r.rank:
        return
    if p.kind.is_token_cache and p.generation == r.cache_generation:
        r.cache = e
    elif p.kind.is_graph and p.generation == r.graph_generation:
        r.graph = e


@_RANK_FACTS.on(HealthPassed)
def _health_passed(r: _RankFacts, e: Event, p: HealthPassed) -> None:
    if p.rank == r.rank and p.version == r.policy_version:
        r.health = e


def lineage(events: Iterable[Event], trajectory_id: str) -> Lineage:
    """The provenance chain of `trajectory_id`; KeyError when the log holds no SampleFinished for it."""
    log: list[Event] = []
    seen: set[str] = set()
    for e in events:  # duplicates (a retried append) count once
        if e.event_id not in seen:
            seen.add(e.event_id)
            log.append(e)

    finished_at = next(
        (
            i
            for i, e in enumerate(log)
            if isinstance(e.payload, SampleFinished) and e.payload.trajectory.trajectory_id == trajectory_id
        ),
        None,
    )
    if finished_at is None:
        started = any(isinstance(e.payload, SampleStarted) and e.payload.sample_id == trajectory_id for e in log)
        why = "it started but never finished" if started else "no such sample in the log"
        raise KeyError(f"trajectory {trajectory_id!r} is unknown: {why} ({len(log)} events searched)")
    fin = log[finished_at]
    assert isinstance(fin.payload, SampleFinished)
    t = fin.payload.trajectory
    gid = t.group_id

    scan = _Scan(trajectory_id, gid, finished_at, cut=finished_at)
    tracker = UpdateTracker()
    for i, e in enumerate(log):
        scan.i = i
        tracker.apply(e)
        _SCAN.apply(scan, e)
    facts = _RankFacts(t.rank, t.policy_version, t.cache_generation, t.graph_generation)
    for e in log[: scan.cut + 1]:  # the rank's state when generation began
        _RANK_FACTS.apply(facts, e)
    run_started, start, admitted, outcome = scan.run_started, scan.start, scan.admitted, scan.outcome
    reward, consumed, dropped, train_step = scan.reward, scan.consumed, scan.dropped, scan.train_step
    rank_weights, cache_event, graph_event, health = facts.weights, facts.cache, facts.graph, facts.health

    versions = tuple(sorted(t.versions | {t.policy_version}))
    policies = tuple(_policy_link(v, tracker, run_started) for v in versions)

    adm = admitted.payload if admitted is not None else None
    out_p = outcome.payload if outcome is not None else None
    if isinstance(out_p, GroupCompleted):
        outcome_name, accepted = GroupFate(out_p.status), trajectory_id in out_p.accepted
    elif isinstance(out_p, GroupCancelled):
        outcome_name, accepted = GroupFate.CANCELLED, False
    else:
        outcome_name, accepted = GroupFate.OPEN, False
    rw = rank_weights.payload if rank_weights is not None else None
    cause_id = rank_weights.causation_id if rank_weights is not None else None
    cause = next((e for e in log if e.event_id == cause_id), None) if cause_id else None
    cp = consumed.payload if consumed is not None else None
    lag = version = None
    if isinstance(cp, BatchConsumed) and gid in cp.group_ids:
        k = cp.group_ids.index(gid)
        lag = cp.lags[k] if k < len(cp.lags) else None
        version = cp.versions[k] if k < len(cp.versions) else None
    tsp = train_step.payload if train_step is not None else None
    dp = dropped.payload if dropped is not None else None
    rp = reward.payload if reward is not None else None
    sampling = t.sampling.model_dump(mode="json")
    return Lineage(
        trajectory_id=trajectory_id,
        run_id=fin.run_id,
        sample=SampleLink(
            sample_id=trajectory_id,
            started_event_id=start.event_id if start is not None else None,
            finished_event_id=fin.event_id,
            rank=t.rank,
            policy_version=t.policy_version,
            weights_digest=t.weights_digest,
            finish_reason=t.finish_reason,
            prompt_tokens=len(t.prompt_token_ids),
            generated_tokens=len(t.token_ids),
            gen_ms=fin.payload.gen_ms,
        ),
        group=GroupLink(
            group_id=gid,
            prompt_id=t.prompt_id,
            admitted_event_id=admitted.event_id if admitted is not None else None,
            n=adm.n if isinstance(adm, GroupAdmitted) else None,
            partial_policy=adm.partial_policy.model_dump(mode="json") if isinstance(adm, GroupAdmitted) else None,
            queued_bytes_at_admission=adm.queued_bytes if isinstance(adm, GroupAdmitted) else None,
            outcome=outcome_name,
            outcome_event_id=outcome.event_id if outcome is not None else None,
            accepted=accepted,
        ),
        sampling=sampling,
        sampling_matches_group=(adm.sampling == t.sampling) if isinstance(adm, GroupAdmitted) else None,
        versions=versions,
        spans=tuple(msgspec.structs.asdict(s) for s in t.spans),
        turns=tuple(
            {**msgspec.structs.asdict(turn), "versions": _turn_versions(t, turn.start, turn.end)} for turn in t.turns
        ),
        policies=policies,
        rank=RankLink(
            rank=t.rank,
            engine=t.engine,
            weights_digest=t.weights_digest,
            rank_weights_event_id=rank_weights.event_id if rank_weights is not None else None,
            rank_weights_digest=rw.weights_digest if isinstance(rw, (RankCommitted, RankJoined)) else None,
            cache_generation=t.cache_generation,
            cache_event_id=cache_event.event_id if cache_event is not None else None,
            graph_generation=t.graph_generation,
            graph_event_id=graph_event.event_id if graph_event is not None else None,
            health_event_id=health.event_id if health is not None else None,
            rank_weights_cause_id=cause.event_id if cause is not None else None,
            rank_weights_cause_type=cause.type if cause is not None else None,
        ),
        reward=RewardLink(reward.event_id, rp.reward, rp.correct)
        if reward is not None and isinstance(rp, SampleScored)
        else None,
        consumed=ConsumptionLink(
            event_id=consumed.event_id,
            step=cp.step,
            lag=lag,
            recorded_version=version,
            train_step_event_id=train_step.event_id if train_step is not None else None,
            loss=tsp.loss if isinstance(tsp, TrainStepFinished) else None,
            trainer=consumed.producer,
        )
        if consumed is not None and isinstance(cp, BatchConsumed)
        else None,
        dropped=DropLink(dropped.event_id, dp.reason, dp.lag)
        if dropped is not None and isinstance(dp, TrajectoryDropped)
        else None,
    )


def _turn_versions(t: Trajectory, start: int, end: int) -> list[int]:
    """The versions that produced tokens [start, end) of `t`: its spans' over that range, or its one version."""
    if not t.spans:
        return [t.policy_version]
    return sorted({s.policy_version for s in t.spans if s.start < max(end, start + 1) and s.end > start})
