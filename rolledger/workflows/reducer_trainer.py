"""The reducer's trainer events: BatchConsumed, TrajectoryDropped, TrainStepFinished, TrainStepRefused (a fact the
coordinator decides the run's end on).

Every fold here is idempotent by its own key, not only by event id (the reducer's id window is bounded): a group is
consumed or dropped once, and a step is applied only as the next one (`trainer.step + 1`); anything else is an
anomaly and changes no counter."""

from __future__ import annotations

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import GroupStatus
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.reducer_common import anomaly, find_group
from rolledger.workflows.state import RunState, retire_if_done

handlers: Handlers[RunState, None] = Handlers("reducer: trainer")


@handlers.on(ev.BatchConsumed)
def _batch_consumed(s: RunState, e: ev.Event, p: ev.BatchConsumed) -> None:
    newly: set[str] = set()
    for gid, lag in zip(p.group_ids, p.lags, strict=False):
        g = find_group(s, e, gid)
        if g is None:
            continue
        if g.status != GroupStatus.SCORED:
            anomaly(s, e, f"group {gid} consumed while {g.status}")
            if g.status == GroupStatus.CONSUMED:
                continue
        newly.add(gid)
        if g.status.is_queued:
            s.admission.queued_bytes -= g.bytes
        g.status, g.consumed_step = GroupStatus.CONSUMED, p.step
        s.trainer.lag_histogram[lag] = s.trainer.lag_histogram.get(lag, 0) + 1
        s.trainer.max_lag = max(s.trainer.max_lag, lag)
        s.trainer.consumed_groups += 1
        retire_if_done(s, g)
    if newly == set(p.group_ids):
        s.trainer.consumed_trajectories += len(p.trajectory_ids)
    else:  # some groups were consumed before: count only the trajectories of the others
        s.trainer.consumed_trajectories += sum(1 for t in p.trajectory_ids if t.rsplit("/", 1)[0] in newly)


@handlers.on(ev.TrajectoryDropped)
def _trajectory_dropped(s: RunState, e: ev.Event, p: ev.TrajectoryDropped) -> None:
    g = find_group(s, e, p.group_id)
    if g is None:
        return
    if g.status.is_queued:
        s.admission.queued_bytes -= g.bytes
    elif g.status.is_open:
        s.admission.inflight -= 1
    else:
        anomaly(s, e, f"group {p.group_id} dropped while {g.status}")
        return
    g.status = GroupStatus.DROPPED
    s.admission.gone_before_training += 1
    s.trainer.dropped_trajectories += len(p.trajectory_ids)
    retire_if_done(s, g)


@handlers.on(ev.TrainStepFinished)
def _train_step(s: RunState, e: ev.Event, p: ev.TrainStepFinished) -> None:
    if p.step != s.trainer.step + 1:  # a duplicate (older than the id window) or a step out of order
        anomaly(s, e, f"step {p.step} finished while the trainer is at step {s.trainer.step}; not applied")
        return
    s.trainer.step = p.step
    s.trainer.last_train_s = p.train_ms / 1e3
    s.trainer.rewards.append(p.reward_mean)
    if p.agreement_tokens:
        s.trainer.logprob_gaps.append(p.logprob_gap_median)


@handlers.on(ev.TrainStepRefused)
def _train_step_refused(s: RunState, e: ev.Event, p: ev.TrainStepRefused) -> None:
    if s.trainer.refused:
        anomaly(s, e, f"step {p.step} refused after the trainer already refused one")
        return
    if p.step != s.trainer.step + 1:
        anomaly(s, e, f"step {p.step} refused while the trainer is at step {s.trainer.step}")
    s.trainer.refused = p.reason
