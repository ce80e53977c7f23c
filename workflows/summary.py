"""The run summary (`runs/<run-id>/summary.json`), computed from the rebuilt state and the log: pure."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from schemas import events as ev
from workflows.state import RunState

EDGE_STEPS = 3  # reward_first / reward_last average this many steps


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
    logprob_agreement: float  # median over steps of the median |trainer - engine| logprob gap
    wall_s: float
    groups_admitted: int
    trajectories_dropped: int
    anomalies: int
    state_digest: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(state: RunState, events: Iterable[ev.Event]) -> Summary:
    gen_ms_by_rank: dict[int, float] = {}
    seen_groups: set[str] = set()
    trajectories = 0
    for e in events:
        p = e.payload
        if isinstance(p, ev.SampleFinished):
            trajectories += 1
            if p.trajectory.group_id not in seen_groups:  # one generate call per group: count its time once
                seen_groups.add(p.trajectory.group_id)
                gen_ms_by_rank[p.trajectory.rank] = gen_ms_by_rank.get(p.trajectory.rank, 0.0) + p.gen_ms
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
        wall_s=wall,
        groups_admitted=state.admission.admitted,
        trajectories_dropped=state.trainer.dropped_trajectories,
        anomalies=len(state.anomalies),
        state_digest=state.digest(),
    )
