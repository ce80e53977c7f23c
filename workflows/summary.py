"""The run summary (`runs/<run-id>/summary.json`), computed from the rebuilt state and the log: pure.

Two folds of the log, each a workflows.dispatch registry: the queue of completed-but-untrained groups over time
(Little's law, `queue_dynamics`), and the finished samples with their generation time per rank (`summarize`)."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import RunStatus, UpdateStatus
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.incidents import Incident, incidents
from rolledger.workflows.state import RunState

EDGE_STEPS = 5  # reward_first / reward_last average this many steps


@dataclass(frozen=True)
class Summary:
    run_id: str
    status: RunStatus
    steps: int
    policy_version: int
    events: int
    trajectories: int
    reward_first: float
    reward_last: float
    max_lag: int
    max_queued_bytes: int
    updates_committed: int
    updates_aborted: int
    handoff_tax: float  # fraction of wall time the engines were not generating (mean over ranks)
    logprob_agreement: float  # median over steps of the median |trainer - engine| logprob gap (on-policy tokens)
    agreement_steps: int  # steps whose batch had on-policy tokens to measure it on
    wall_s: float
    groups_admitted: int
    trajectories_dropped: int
    anomalies: int
    state_digest: str
    littles_law: dict[str, float]
    # aborts, quarantines, halts, refusals, lost workers, dead letters: each {event_id, type, version, rank, ranks,
    # phase, tensor, reason} (workflows/incidents.py), in log order, dead letters last
    incidents: list[dict[str, object]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class _Queue:
    """queue_dynamics' fold: the queue of completed-but-untrained groups over time."""

    last_t: float
    completed_at: dict[str, float] = field(default_factory=dict)
    waits: list[float] = field(default_factory=list)
    queue: int = 0
    area: float = 0.0  # integral of the queue length over time
    max_queue: int = 0
    consumed: int = 0
    completed_total: int = 0
    publishes: list[float] = field(default_factory=list)

    def step(self, t: float, delta: int) -> None:
        self.area += self.queue * (t - self.last_t)
        self.last_t, self.queue = t, self.queue + delta
        self.max_queue = max(self.max_queue, self.queue)

    def left(self, group_id: str, t: float) -> None:
        """A completed group left the queue (consumed, dropped or cancelled)."""
        if group_id in self.completed_at:
            self.waits.append(t - self.completed_at.pop(group_id))
            self.step(t, -1)


_QUEUE: Handlers[_Queue, None] = Handlers("summary: queue dynamics")


@_QUEUE.on(ev.GroupCompleted)
def _q_completed(q: _Queue, e: ev.Event, p: ev.GroupCompleted) -> None:
    q.completed_total += 1
    q.completed_at[p.group_id] = e.wall_time
    q.step(e.wall_time, +1)


@_QUEUE.on(ev.BatchConsumed)
def _q_consumed(q: _Queue, e: ev.Event, p: ev.BatchConsumed) -> None:
    for gid in p.group_ids:
        if gid in q.completed_at:
            q.consumed += 1
            q.left(gid, e.wall_time)


def _q_withdrawn(q: _Queue, e: ev.Event, p: ev.TrajectoryDropped | ev.GroupCancelled) -> None:
    q.left(p.group_id, e.wall_time)


_QUEUE.on(ev.TrajectoryDropped)(_q_withdrawn)
_QUEUE.on(ev.GroupCancelled)(_q_withdrawn)


@_QUEUE.on(ev.PolicyPublished)
def _q_published(q: _Queue, e: ev.Event, p: ev.PolicyPublished) -> None:
    q.publishes.append(e.wall_time)


def queue_dynamics(events: list[ev.Event]) -> dict[str, float]:
    """Little's law on the queue of completed-but-untrained groups, measured from the log.

    arrival_rate = groups completed per second; mean_wait_s = completion -> consumption (or drop/cancel);
    littles_L = arrival_rate x mean_wait_s, against measured_queue (time-averaged) and max_queue. The update view:
    surplus_rate (completion rate - consumption rate while groups waited) x update_period_s predicts how far the queue
    grows between two trainer steps; admission's caps bound it.
    """
    if not events:
        return {}
    t0, t1 = events[0].wall_time, events[-1].wall_time
    span = max(t1 - t0, 1e-9)
    q = _Queue(last_t=t0)
    for e in events:
        _QUEUE.apply(q, e)
    q.step(t1, 0)
    arrival = q.completed_total / span
    mean_wait = statistics.fmean(q.waits) if q.waits else 0.0
    publishes = q.publishes
    period = statistics.fmean(b - a for a, b in itertools.pairwise(publishes)) if len(publishes) > 1 else span
    drain = q.consumed / span
    surplus = arrival - drain
    return {
        "arrival_rate_groups_s": arrival,
        "drain_rate_groups_s": drain,
        "mean_wait_s": mean_wait,
        "littles_L_groups": arrival * mean_wait,
        "measured_queue_groups": q.area / span,
        "max_queue_groups": float(q.max_queue),
        "update_period_s": period,
        "surplus_rate_groups_s": surplus,
        "surplus_x_period_groups": max(surplus, 0.0) * period,
    }


@dataclass
class _Generation:
    """summarize's fold over the log: finished samples, and each group's generate-call duration per rank."""

    trajectories: int = 0
    group_ms: dict[tuple[int, str], float] = field(default_factory=dict)  # (rank, group) -> its generate call


_GENERATION: Handlers[_Generation, None] = Handlers("summary: generation")


@_GENERATION.on(ev.SampleFinished)
def _sample_finished(g: _Generation, e: ev.Event, p: ev.SampleFinished) -> None:
    g.trajectories += 1
    key = (p.trajectory.rank, p.trajectory.group_id)
    # one generate call per group; samples stream out as they end, so the call lasted as long as the last one
    g.group_ms[key] = max(g.group_ms.get(key, 0.0), p.gen_ms)


def summarize(state: RunState, events: Iterable[ev.Event], dead_letters: Iterable[Incident] = ()) -> Summary:
    """`dead_letters`: the run's dead-letter entries as incidents (they are not in the log; the caller reads them)."""
    events = list(events)
    gen = _Generation()
    for e in events:
        _GENERATION.apply(gen, e)
    gen_ms_by_rank: dict[int, float] = {}
    for (rank, _), ms in gen.group_ms.items():
        gen_ms_by_rank[rank] = gen_ms_by_rank.get(rank, 0.0) + ms
    wall = max(state.last_wall_time - state.first_wall_time, 1e-9)
    ranks = state.ranks or {}
    busy = [min(gen_ms_by_rank.get(r, 0.0) / 1e3 / wall, 1.0) for r in ranks] or [0.0]
    rewards = state.trainer.rewards
    return Summary(
        run_id=state.run_id,
        status=state.status,
        steps=state.trainer.step,
        policy_version=state.policy_version,
        events=state.events_applied,
        trajectories=gen.trajectories,
        reward_first=statistics.fmean(rewards[:EDGE_STEPS]) if rewards else 0.0,
        reward_last=statistics.fmean(rewards[-EDGE_STEPS:]) if rewards else 0.0,
        max_lag=state.trainer.max_lag,
        max_queued_bytes=state.admission.max_queued_bytes,
        updates_committed=sum(1 for u in state.updates.values() if u.status.is_decided_commit),
        updates_aborted=sum(1 for u in state.updates.values() if u.status == UpdateStatus.ABORTED),
        handoff_tax=1.0 - statistics.fmean(busy),
        logprob_agreement=statistics.median(state.trainer.logprob_gaps) if state.trainer.logprob_gaps else 0.0,
        agreement_steps=len(state.trainer.logprob_gaps),
        wall_s=wall,
        groups_admitted=state.admission.admitted,
        trajectories_dropped=state.trainer.dropped_trajectories,
        anomalies=len(state.anomalies),
        state_digest=state.digest(),
        littles_law=queue_dynamics(events),
        incidents=[i.to_dict() for i in [*incidents(events), *dead_letters]],
    )
