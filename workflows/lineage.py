"""`rolledger lineage`: the provenance chain of one trajectory, as a pure function over the event log.

trajectory -> its sample (SampleStarted/SampleFinished) and group (GroupAdmitted, GroupCompleted) -> the sampling
settings -> the policy version of every span -> for each version, where the weights came from: version 0 is the
initial weights (RunStarted), any other the update attempt that published it (UpdateStaged manifest digest and uri,
the ranks that prepared that manifest, UpdateCommitted, PolicyPublished) plus the aborted attempts at the same
version -> the rank that generated it (its committed weights digest, the CacheInvalidated events that made its cache
and graph generations, its health check) -> the reward (SampleScored) -> the trainer step that consumed it
(BatchConsumed, its lag, TrainStepFinished) or the drop that refused it.

No Redis, no I/O. `Lineage.to_json()` for machines, `Lineage.render()` for people (a tree).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

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
from rolledger.workflows.audit_attempts import UpdateTracker


@dataclass(frozen=True)
class SampleLink:
    sample_id: str
    started_event_id: str | None
    finished_event_id: str
    rank: int
    policy_version: int
    weights_digest: str
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    gen_ms: float


@dataclass(frozen=True)
class GroupLink:
    group_id: str
    prompt_id: str
    admitted_event_id: str | None
    n: int | None
    partial_policy: dict[str, Any] | None
    queued_bytes_at_admission: int | None
    outcome: str  # complete | partial | cancelled | open
    outcome_event_id: str | None
    accepted: bool  # this trajectory is among the group's accepted samples


@dataclass(frozen=True)
class PreparedRank:
    rank: int
    event_id: str
    manifest_digest: str
    staged_digest: str


@dataclass(frozen=True)
class AbortedAttempt:
    version: int
    event_id: str
    reason: str
    failed_ranks: tuple[int, ...]
    manifest_digest: str | None


@dataclass(frozen=True)
class PolicyLink:
    """Where the weights of one policy version came from."""

    version: int
    source: str  # "initial" | "update" | "unknown"
    weights_digest: str | None
    run_started_event_id: str | None = None  # version 0
    staged_event_id: str | None = None
    base_version: int | None = None
    manifest_digest: str | None = None
    uri: str | None = None
    bytes: int | None = None
    prepared: tuple[PreparedRank, ...] = ()
    committed_event_id: str | None = None
    committed_ranks: tuple[int, ...] = ()
    fence: int | None = None
    published_event_id: str | None = None
    published_ranks: tuple[int, ...] = ()
    aborted_attempts: tuple[AbortedAttempt, ...] = ()


@dataclass(frozen=True)
class RankLink:
    """The rank that generated the trajectory, as the log knew it when the sample started."""

    rank: int
    engine: str
    weights_digest: str
    rank_weights_event_id: str | None  # the RankCommitted / RankJoined that put these weights on the rank
    rank_weights_digest: str | None
    cache_generation: int
    cache_event_id: str | None  # the CacheInvalidated that created this generation
    graph_generation: int
    graph_event_id: str | None
    health_event_id: str | None


@dataclass(frozen=True)
class RewardLink:
    event_id: str
    reward: float
    correct: bool


@dataclass(frozen=True)
class ConsumptionLink:
    event_id: str
    step: int
    lag: int | None
    recorded_version: int | None
    train_step_event_id: str | None
    loss: float | None


@dataclass(frozen=True)
class DropLink:
    event_id: str
    reason: str
    lag: int


@dataclass(frozen=True)
class Lineage:
    trajectory_id: str
    run_id: str
    sample: SampleLink
    group: GroupLink
    sampling: dict[str, Any]
    sampling_matches_group: bool | None
    versions: tuple[int, ...]  # every version that produced a token, oldest first
    spans: tuple[dict[str, Any], ...]
    policies: tuple[PolicyLink, ...]  # one per version in `versions`
    rank: RankLink
    reward: RewardLink | None
    consumed: ConsumptionLink | None
    dropped: DropLink | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def render(self) -> str:
        """A tree, one fact per line, each with the event id that proves it."""
        s, g, r = self.sample, self.group, self.rank
        out = [f"trajectory {self.trajectory_id} (run {self.run_id})"]

        def node(depth: int, text: str) -> None:
            out.append("  " * depth + "- " + text)

        node(
            0,
            f"sample {s.sample_id}: started {s.started_event_id or '?'}, finished {s.finished_event_id} "
            f"({s.finish_reason}, {s.prompt_tokens} prompt + {s.generated_tokens} generated tokens, {s.gen_ms:.1f} ms)",
        )
        node(
            0,
            f"group {g.group_id} (prompt {g.prompt_id}): admitted {g.admitted_event_id or '?'} n={g.n} "
            f"queued_bytes={g.queued_bytes_at_admission}; {g.outcome} {g.outcome_event_id or ''}".rstrip()
            + ("" if g.accepted else " - NOT accepted"),
        )
        if g.partial_policy is not None:
            node(1, f"partial policy {g.partial_policy}")
        note = "" if self.sampling_matches_group in (None, True) else " (DIFFERS from the group's)"
        node(0, "sampling " + ", ".join(f"{k}={v}" for k, v in self.sampling.items()) + note)
        node(0, f"policy version{'s' if len(self.versions) > 1 else ''} {', '.join(f'v{v}' for v in self.versions)}")
        for sp in self.spans:
            node(1, f"tokens [{sp['start']},{sp['end']}) by v{sp['policy_version']} ({sp['weights_digest']})")
        for p in self.policies:
            if p.source == "initial":
                node(1, f"v{p.version}: initial weights {p.weights_digest} (RunStarted {p.run_started_event_id})")
            elif p.source == "unknown":
                node(1, f"v{p.version}: no update in the log published this version")
            else:
                node(1, f"v{p.version}: weights {p.weights_digest}")
                node(
                    2,
                    f"staged {p.staged_event_id or '?'}: manifest {p.manifest_digest} at {p.uri} "
                    f"({p.bytes} bytes, base v{p.base_version})",
                )
                for pr in p.prepared:
                    node(
                        2,
                        f"rank {pr.rank} prepared {pr.event_id} (manifest {pr.manifest_digest}, staged {pr.staged_digest})",
                    )
                node(2, f"committed {p.committed_event_id or '?'} on ranks {list(p.committed_ranks)} (fence {p.fence})")
                node(2, f"published {p.published_event_id or '?'} on ranks {list(p.published_ranks)}")
            for a in p.aborted_attempts:
                node(
                    2,
                    f"before it: update to v{a.version} aborted {a.event_id}: {a.reason} "
                    f"(failed ranks {list(a.failed_ranks)})",
                )
        node(0, f"rank {r.rank} ({r.engine}): weights {r.weights_digest}")
        node(1, f"rank weights from {r.rank_weights_event_id or '?'} ({r.rank_weights_digest})")
        node(1, f"cache generation {r.cache_generation} from {r.cache_event_id or 'start'}")
        node(1, f"graph generation {r.graph_generation} from {r.graph_event_id or 'start'}")
        node(1, f"health {r.health_event_id or '?'}")
        if self.reward is not None:
            node(0, f"reward {self.reward.reward} (correct={self.reward.correct}) {self.reward.event_id}")
        else:
            node(0, "reward: not scored")
        if self.consumed is not None:
            c = self.consumed
            loss = f", loss {c.loss:.4f} {c.train_step_event_id}" if c.loss is not None else ""
            node(0, f"consumed at trainer step {c.step} with lag {c.lag} {c.event_id}{loss}")
        elif self.dropped is not None:
            node(0, f"dropped ({self.dropped.reason}, lag {self.dropped.lag}) {self.dropped.event_id}")
        else:
            node(0, "not consumed (yet)")
        return "\n".join(out)


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
            "initial",
            rs.initial_weights_digest if isinstance(rs, RunStarted) else None,
            run_started_event_id=run_started.event_id if run_started is not None else None,
            aborted_attempts=aborted,
        )
    published = [a for a in attempts if a.published is not None and a.aborted is None]
    chosen = published[-1] if published else next((a for a in reversed(attempts) if a.committed is not None), None)
    if chosen is None:
        return PolicyLink(version, "unknown", None, aborted_attempts=aborted)
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
        source="update",
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

    run_started: Event | None = None
    start: Event | None = None
    admitted: Event | None = None
    outcome: Event | None = None
    reward: Event | None = None
    consumed: Event | None = None
    dropped: Event | None = None
    train_step: Event | None = None
    tracker = UpdateTracker()
    rank_weights: Event | None = None  # newest RankCommitted/RankJoined of t.rank before the sample started
    cache_event: Event | None = None
    graph_event: Event | None = None
    health: Event | None = None
    cut = finished_at  # rank facts are those known when the sample was generated

    for i, e in enumerate(log):
        p = e.payload
        tracker.apply(e)
        if isinstance(p, RunStarted) and run_started is None:
            run_started = e
        elif isinstance(p, SampleStarted) and p.sample_id == trajectory_id and i < finished_at:
            start, cut = e, i
        elif isinstance(p, GroupAdmitted) and p.group_id == gid and admitted is None:
            admitted = e
        elif isinstance(p, (GroupCompleted, GroupCancelled)) and p.group_id == gid:
            outcome = e
        elif isinstance(p, SampleScored) and p.sample_id == trajectory_id and reward is None:
            reward = e
        elif isinstance(p, BatchConsumed) and trajectory_id in p.trajectory_ids and consumed is None:
            consumed = e
        elif isinstance(p, TrainStepFinished) and consumed is not None and train_step is None:
            assert isinstance(consumed.payload, BatchConsumed)
            if p.step == consumed.payload.step:
                train_step = e
        elif isinstance(p, TrajectoryDropped) and trajectory_id in p.trajectory_ids and dropped is None:
            dropped = e

    for e in log[: cut + 1]:  # the rank's state when generation began
        p = e.payload
        if isinstance(p, (RankCommitted, RankJoined)) and p.rank == t.rank:
            rank_weights = e
            if isinstance(p, RankJoined):
                cache_event = graph_event = None
        elif isinstance(p, CacheInvalidated) and p.rank == t.rank:
            if p.kind in ("prefix", "kv") and p.generation == t.cache_generation:
                cache_event = e
            elif p.kind == "graph" and p.generation == t.graph_generation:
                graph_event = e
        elif isinstance(p, HealthPassed) and p.rank == t.rank and p.version == t.policy_version:
            health = e

    versions = tuple(sorted(t.versions | {t.policy_version}))
    policies = tuple(_policy_link(v, tracker, run_started) for v in versions)

    adm = admitted.payload if admitted is not None else None
    out_p = outcome.payload if outcome is not None else None
    outcome_name: str
    if isinstance(out_p, GroupCompleted):
        outcome_name, accepted = out_p.status, trajectory_id in out_p.accepted
    elif isinstance(out_p, GroupCancelled):
        outcome_name, accepted = "cancelled", False
    else:
        outcome_name, accepted = "open", False
    rw = rank_weights.payload if rank_weights is not None else None
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
        spans=tuple(s.model_dump(mode="json") for s in t.spans),
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
        )
        if consumed is not None and isinstance(cp, BatchConsumed)
        else None,
        dropped=DropLink(dropped.event_id, dp.reason, dp.lag)
        if dropped is not None and isinstance(dp, TrajectoryDropped)
        else None,
    )
