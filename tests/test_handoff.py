"""The colocated handoff starts only when the trainer will train: groups it would drop for lag do not count.

Found by CI (tests/test_causation.py, colocated with fail-rank=1@prepare, about 1 run in 5): v1 aborted, v2 was
published, and two groups generated at v0 were still queued. They made a batch, so the coordinator paused admission
for a handoff and every engine slept; the trainer then dropped both for lag (2 > max_lag 1) and had nothing to train
on, and nothing could be generated while the engines slept: the run stalled until its deadline.
"""

from __future__ import annotations

from logbuilder import LogBuilder

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason
from rolledger.workflows.handoff import decide_handoff
from rolledger.workflows.reducer import fold
from rolledger.workflows.state import RunState, group_lag
from rolledger.workflows.trainer import TrainPlan, plan_step


def folded(b: LogBuilder) -> RunState:
    state = RunState()
    for e in b.build():
        fold(state, e)
    return state


def colocated_with_two_stale_groups() -> LogBuilder:
    """Two groups generated at v0, then v1 aborted and v2 published while they waited: lag 2 > max_lag 1."""
    b = LogBuilder(mode="colocated", ranks=2, steps=5, trainer={"groups_per_step": 2}).start_run()
    b.group(n=2).group(n=2)
    b.update(1, fail_rank=1)
    b.update(2)
    return b


def test_groups_the_trainer_would_drop_for_lag_start_no_handoff() -> None:
    state = folded(colocated_with_two_stale_groups())
    assert state.policy_version == 2
    assert [group_lag(state, g) for g in state.ready_groups()] == [2, 2]
    assert decide_handoff(state) == []  # before the fix: AdmissionPaused(handoff), then every engine slept for nothing


def test_fresh_groups_start_the_handoff_and_the_trainer_then_has_a_batch() -> None:
    b = colocated_with_two_stale_groups()
    b.group(n=2).group(n=2)  # generated at v2: lag 0
    state = folded(b)
    decided = decide_handoff(state)
    assert len(decided) == 1 and isinstance(decided[0], ev.AdmissionPaused)
    assert decided[0].reason == AdmissionReason.HANDOFF
    # once the engines sleep, the trainer drops the stale head of the queue and, in the same step, trains on the
    # fresh groups: a drop does not shrink the batch
    b.emit(decided[0], producer="coordinator")
    for rank in (0, 1):
        b.emit(ev.EngineSlept(rank=rank, level=1, bytes_freed=1, verified=True), producer=f"rank-{rank}")
    state = folded(b)
    plan = plan_step(state)
    assert isinstance(plan, TrainPlan)
    dropped = {d.group_id for d in plan.drops}
    assert len(dropped) == 2 and all(d.reason == "lag" for d in plan.drops)  # the two oldest: both stale
    assert plan.batch is not None and len(plan.batch.group_ids) == 2 and set(plan.batch.group_ids).isdisjoint(dropped)
    assert plan.batch.lags == (0, 0)
