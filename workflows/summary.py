"""The run summary (`runs/<run-id>/summary.json`), computed from the rebuilt state and the log: pure."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from rolledger.schemas import events as ev
from rolledger.workflows.state import RunState

EDGE_STEPS = 5  # reward_first / reward_last average this many steps


@dataclass(frozen=True)
class Summary:
    run_id: str
    status: str
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

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


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
    completed_at: dict[str, float] = {}
    waits: list[float] = []
    queue, area, last_t, max_queue = 0, 0.0, t0, 0
    consumed = completed_total = 0
    publishes: list[float] = []

    def step_queue(t: float, delta: int) -> None:
        nonlocal queue, area, last_t, max_queue
        area += queue * (t - last_t)
        last_t, queue = t, queue + delta
        max_queue = max(max_queue, queue)

    for e in events:
        p = e.payload
        if isinstance(p, ev.GroupCompleted):
            completed_total += 1
            completed_at[p.group_id] = e.wall_time
            step_queue(e.wall_time, +1)
        elif isinstance(p, ev.BatchConsumed):
            for gid in p.group_ids:
                if gid in completed_at:
                    waits.append(e.wall_time - completed_at.pop(gid))
                    consumed += 1
                    step_queue(e.wall_time, -1)
        elif isinstance(p, (ev.TrajectoryDropped, ev.GroupCancelled)) and p.group_id in completed_at:
            waits.append(e.wall_time - completed_at.pop(p.group_id))
            step_queue(e.wall_time, -1)
        elif isinstance(p, ev.PolicyPublished):
            publishes.append(e.wall_time)
    step_queue(t1, 0)
    arrival = completed_total / span
    mean_wait = statistics.fmean(waits) if waits else 0.0
    period = statistics.fmean(b - a for a, b in itertools.pairwise(publishes)) if len(publishes) > 1 else span
    drain = consumed / span
    surplus = arrival - drain
    return {
        "arrival_rate_groups_s": arrival,
        "drain_rate_groups_s": drain,
        "mean_wait_s": mean_wait,
        "littles_L_groups": arrival * mean_wait,
        "measured_queue_groups": area / span,
        "max_queue_groups": float(max_queue),
        "update_period_s": period,
        "surplus_rate_groups_s": surplus,
        "surplus_x_period_groups": max(surplus, 0.0) * period,
    }


def summarize(state: RunState, events: Iterable[ev.Event]) -> Summary:
    group_ms: dict[tuple[int, str], float] = {}  # (rank, group) -> its generate call's duration
    trajectories = 0
    events = list(events)
    for e in events:
        p = e.payload
        if isinstance(p, ev.SampleFinished):
            trajectories += 1
            key = (p.trajectory.rank, p.trajectory.group_id)
            # one generate call per group; samples stream out as they end, so the call lasted as long as the last one
            group_ms[key] = max(group_ms.get(key, 0.0), p.gen_ms)
    gen_ms_by_rank: dict[int, float] = {}
    for (rank, _), ms in group_ms.items():
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
        trajectories=trajectories,
        reward_first=statistics.fmean(rewards[:EDGE_STEPS]) if rewards else 0.0,
        reward_last=statistics.fmean(rewards[-EDGE_STEPS:]) if rewards else 0.0,
        max_lag=state.trainer.max_lag,
        max_queued_bytes=state.admission.max_queued_bytes,
        updates_committed=sum(1 for u in state.updates.values() if u.status not in ("staged", "preparing", "aborted")),
        updates_aborted=sum(1 for u in state.updates.values() if u.status == "aborted"),
        handoff_tax=1.0 - statistics.fmean(busy),
        logprob_agreement=statistics.median(state.trainer.logprob_gaps) if state.trainer.logprob_gaps else 0.0,
        agreement_steps=len(state.trainer.logprob_gaps),
        wall_s=wall,
        groups_admitted=state.admission.admitted,
        trajectories_dropped=state.trainer.dropped_trajectories,
        anomalies=len(state.anomalies),
        state_digest=state.digest(),
        littles_law=queue_dynamics(events),
    )
