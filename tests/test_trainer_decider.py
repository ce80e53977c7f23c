"""Properties of the trainer's decider (workflows/trainer.py) and of the coordinator's run-end decisions
(workflows/coordinator.py), over random logs and without Redis; plus the single-writer append on a real redis-server.

Hypothesis draws a run (disaggregated or colocated, the lag cap, groups per step) and a sequence of moves on a
LogBuilder log: groups finish, the trainer takes the step its decider plans (the plan's own events folded in), a
staged update is published or aborted, a colocated handoff sleeps or wakes the engines. At every move, and at every
prefix a restarted trainer could start from, the plan is checked against the properties below. The Redis tests:
`EventLog.append_once` lets one writer claim a step; a driver ends a run whose coordinator is lost under the
coordinator lease; a trainer started as a fresh process takes its weights from the log.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder, default_config
from pydantic import ValidationError

from rolledger.events.envelope import make_event
from rolledger.events.lease import LeaderLease
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason, WakeTag
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state
from rolledger.workers.roles.coordinator import finish_as_coordinator
from rolledger.workers.roles.trainer import TrainerWorker
from rolledger.workers.weights.staging_store import DirectoryStagingStore
from rolledger.workers.weights.tensors import state_digest
from rolledger.workflows.admission import AdmissionInputs
from rolledger.workflows.coordinator import decide, decide_terminal
from rolledger.workflows.handoff import engines_asleep
from rolledger.workflows.reducer import replay
from rolledger.workflows.state import RunState, group_lag, group_version
from rolledger.workflows.trainer import (
    TrainPlan,
    Wait,
    WaitReason,
    may_record,
    next_version,
    overlaps_update,
    plan_step,
    refusal,
)

MOVES = st.sampled_from(["group"] * 3 + ["train"] * 3 + ["publish"] * 2 + ["abort", "sleep", "wake"])


def plan_events(b: LogBuilder, plan: TrainPlan) -> None:
    """What the trainer worker appends for a plan it carries out (train: drops, batch, step, staged version)."""
    for d in plan.drops:
        b.emit(d, producer="trainer")
    if plan.batch is None:
        return
    b.emit(plan.batch, producer="trainer")
    b.emit(
        ev.TrainStepFinished(
            step=plan.step,
            loss=0.1,
            reward_mean=1.0,
            logprob_gap_median=0.0,
            logprob_gap_p99=0.0,
            max_seq_ratio=1.0,
            clipped_frac=0.0,
        ),
        producer="trainer",
    )
    b.stage(plan.version)


def open_version(state: RunState) -> int | None:
    u = state.open_update
    return u.version if u is not None else None


def check_plan(state: RunState, plan: TrainPlan | Wait) -> None:
    cfg = state.config
    assert cfg is not None
    assert plan == plan_step(copy.deepcopy(state)), "the same state gives the same plan"
    if state.open_update is not None and not overlaps_update(state):
        assert plan == Wait(WaitReason.UPDATE_OPEN) or (isinstance(plan, Wait) and plan.reason.is_final)
    if cfg.mode == "colocated" and not engines_asleep(state):
        assert isinstance(plan, Wait)
    if not isinstance(plan, TrainPlan):
        return
    assert plan.step == state.trainer.step + 1
    assert plan.version > max([*state.updates, state.policy_version]), "a new number, never an aborted one again"
    assert plan.base_version == state.policy_version
    # beside an open update (overlap_update) lags count against the open version: what may be published first
    ahead = state.open_update.version - state.policy_version if state.open_update is not None else 0
    # every ready group over the cap is dropped; the batch is the oldest tokens first (then admission order) among
    # the rest, full (groups_per_step) or absent
    ready = sorted(state.ready_groups(), key=lambda g: (group_version(g), g.group_id))
    over = [g.group_id for g in ready if group_lag(state, g) + ahead > cfg.admission.max_lag]
    fresh = [g.group_id for g in ready if g.group_id not in over]
    assert sorted(d.group_id for d in plan.drops) == sorted(over)
    consumed = list(plan.batch.group_ids) if plan.batch is not None else []
    per_step = cfg.trainer.groups_per_step
    assert consumed == (fresh[:per_step] if len(fresh) >= per_step else [])
    for d in plan.drops:  # drops exactly the selected groups over the cap, with their lag
        assert d.lag == group_lag(state, state.groups[d.group_id]) + ahead > cfg.admission.max_lag
    if plan.batch is not None:
        for gid, lag in zip(plan.batch.group_ids, plan.batch.lags, strict=True):
            assert lag == group_lag(state, state.groups[gid]) + ahead <= cfg.admission.max_lag
        assert len(plan.rewards) == len(plan.batch.trajectory_ids)
        assert set(plan.on_policy) <= set(plan.batch.trajectory_ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    colocated=st.booleans(),
    overlap=st.booleans(),
    max_lag=st.integers(0, 2),
    per_step=st.integers(1, 3),
    moves=st.lists(MOVES, min_size=15, max_size=60),
)
def test_the_trainer_plans_only_what_its_state_allows_and_never_twice(
    colocated: bool, overlap: bool, max_lag: int, per_step: int, moves: list[str]
) -> None:
    """With `trainer.overlap_update` (disaggregated only) a step is planned beside the open update of the last one
    and recorded once that update closes (`may_record`); its recorded lags are then never below the true ones."""
    overlap = overlap and not colocated
    b = LogBuilder(
        mode="colocated" if colocated else "disaggregated",
        steps=8,
        admission={"max_lag": max_lag, "max_queued_bytes": 10**9},
        trainer={"groups_per_step": per_step, "overlap_update": overlap},
    )
    b.start_run()
    staged: list[int] = []
    steps_taken: list[int] = []
    pending: TrainPlan | None = None  # planned and trained beside an open update, not yet recorded
    overlapped = 0
    for move in moves:
        state = replay(b.build())
        if pending is not None and may_record(state):
            if pending.batch is not None:
                staged.append(pending.version)
                steps_taken.append(pending.step)
            state, pending = record(b, pending), None
        plan = plan_step(state)
        check_plan(state, plan)
        v = open_version(state)
        if move == "group" and not state.admission.paused:
            b.group()
        elif move == "train" and isinstance(plan, TrainPlan) and pending is None:
            if not may_record(state):
                assert overlap and overlaps_update(state)
                pending, overlapped = plan, overlapped + 1
                continue
            plan_events(b, plan)
            after = replay(b.build())
            assert after.anomalies == [], after.anomalies
            nxt = plan_step(after)
            if plan.batch is not None:
                staged.append(plan.version)
                steps_taken.append(plan.step)
                assert not isinstance(nxt, TrainPlan) or (nxt.step, nxt.version) != (plan.step, plan.version)
            else:  # only drops: the same step, other groups
                assert not isinstance(nxt, TrainPlan) or not {d.group_id for d in plan.drops} & set(
                    (nxt.batch.group_ids if nxt.batch else ()) + tuple(d.group_id for d in nxt.drops)
                )
        elif move in ("publish", "abort") and v is not None and not state.admission.paused:
            b.request_prepare(v)
            for r in b.ranks:
                (b.prepare_fail if move == "abort" else b.prepare)(v, r)
            b.pause(AdmissionReason.UPDATE)
            if move == "abort":
                b.abort(v)
            else:
                b.commit(v)
                for r in b.ranks:
                    b.commit_rank(v, r)
                b.publish(v)
            b.resume(AdmissionReason.UPDATE)
        elif move == "sleep" and colocated and v is None and not state.admission.paused:
            b.pause(AdmissionReason.HANDOFF)
            for r in b.ranks:
                b.emit(ev.EngineSlept(rank=r, level=1, bytes_freed=1, verified=True), producer=f"rank-{r}")
        elif move == "wake" and colocated and "handoff" in state.admission.paused:
            for r in b.ranks:
                b.emit(ev.EngineWoke(rank=r, tags=(WakeTag.WEIGHTS, WakeTag.KV_CACHE)), producer=f"rank-{r}")
                b.emit(ev.EngineResumed(rank=r), producer=f"rank-{r}")
            b.resume(AdmissionReason.HANDOFF)
    event(
        f"steps taken: {min(len(steps_taken), 3)}+, aborted: {any(u.status == 'aborted' for u in replay(b.build()).updates.values())}"
    )
    event(f"steps planned beside an open update: {min(overlapped, 2)}+")
    events = b.build()
    final = replay(events)
    assert final.anomalies == [], final.anomalies
    assert steps_taken == list(range(1, len(steps_taken) + 1)), "steps follow one another, none redone"
    assert len(staged) == len(set(staged)) and staged == sorted(staged), "every version staged once, increasing"
    # a trainer restarted at any point plans from the prefix it folds: never a step or version already in the log
    for cut in range(len(events) + 1):
        prefix = replay(events[:cut])
        plan = plan_step(prefix)
        if isinstance(plan, TrainPlan) and plan.batch is not None:
            assert plan.step == prefix.trainer.step + 1 and plan.version not in prefix.updates


def record(b: LogBuilder, plan: TrainPlan) -> RunState:
    """Record a step planned beside an update that has now closed: its lags never understate the true ones (the
    update may have published since the plan), and the step and version are still the next ones."""
    state = replay(b.build())
    assert plan.batch is not None or plan.drops
    for gid, lag in zip(plan.batch.group_ids if plan.batch else (), plan.batch.lags if plan.batch else (), strict=True):
        g = state.groups[gid]
        assert state.config is not None and group_lag(state, g) <= lag <= state.config.admission.max_lag
    assert plan.step == state.trainer.step + 1 and plan.version == next_version(state)
    plan_events(b, plan)
    after = replay(b.build())
    assert after.anomalies == [], after.anomalies
    return after


def step_one_staged_and_a_new_group(*, max_lag: int, overlap: bool) -> LogBuilder:
    """One group per step: step 1 trained on a group of v0 and staged v1 (its update open), then one more group."""
    b = LogBuilder(steps=4, admission={"max_lag": max_lag}, trainer={"groups_per_step": 1, "overlap_update": overlap})
    b.start_run().group()
    first = plan_step(replay(b.build()))
    assert isinstance(first, TrainPlan)
    plan_events(b, first)
    return b.group()


def test_with_overlap_the_next_step_is_planned_beside_the_open_update_and_recorded_after_it_closes() -> None:
    """Step 1 staged v1 and its update is open. Without overlap_update the trainer waits (UPDATE_OPEN); with it, step
    2 is planned now, over a group generated on v0 whose lag counts against v1 (1, within the cap of 1), and may be
    recorded only once v1 closes. A group whose lag against v1 would pass the cap is dropped, though v0 is still
    published."""
    for overlap in (False, True):
        b = step_one_staged_and_a_new_group(max_lag=1, overlap=overlap)
        state = replay(b.build())
        assert state.open_update is not None and state.open_update.version == 1 and state.policy_version == 0
        plan = plan_step(state)
        if not overlap:
            assert plan == Wait(WaitReason.UPDATE_OPEN)
            continue
        assert isinstance(plan, TrainPlan) and plan.batch is not None
        assert (plan.step, plan.version, plan.base_version, plan.weights_version) == (2, 2, 0, 1)
        assert plan.batch.lags == (1,) and plan.on_policy == ()  # nothing was generated on v1, the trainer's weights
        assert not may_record(state)
        b.request_prepare(1).prepare(1, 0).pause(AdmissionReason.UPDATE).commit(1).commit_rank(1, 0).publish(1)
        b.resume(AdmissionReason.UPDATE)
        after = replay(b.build())
        assert may_record(after) and after.policy_version == 1
        fresh = plan_step(after)  # planned now, the same groups have the same lags: v1's were counted already
        assert isinstance(fresh, TrainPlan) and fresh.batch is not None and fresh.batch.lags == plan.batch.lags
        plan_events(b, plan)
        assert replay(b.build()).anomalies == []
    dropped = plan_step(replay(step_one_staged_and_a_new_group(max_lag=0, overlap=True).build()))
    assert isinstance(dropped, TrainPlan) and dropped.batch is None
    assert [(d.lag, d.reason) for d in dropped.drops] == [(1, "lag")]


def test_overlap_update_is_refused_for_a_colocated_run() -> None:
    with pytest.raises(ValidationError, match="trainer.overlap_update needs mode = 'disaggregated'"):
        default_config(mode="colocated", trainer={"overlap_update": True})


def test_a_second_staging_of_a_version_is_an_anomaly() -> None:
    b = LogBuilder().start_run().group()
    b.stage(1)
    b.stage(1)
    assert any("staged twice" in a.message for a in replay(b.build()).anomalies)


# ---------------------------------------------------------------- the agreement gate and the run's end
def ready_run(**config: Any) -> LogBuilder:
    b = LogBuilder(trainer={"groups_per_step": 1}, **config).start_run()
    return b.group()


@settings(max_examples=40, deadline=None)
@given(gap=st.floats(0.0, 10.0), max_gap=st.floats(0.01, 5.0), tokens=st.integers(1, 500))
def test_a_refused_step_always_ends_the_run_failed_with_its_reason(gap: float, max_gap: float, tokens: int) -> None:
    b = ready_run()
    state = replay(b.build())
    plan = plan_step(state)
    assert isinstance(plan, TrainPlan)
    refused = refusal(plan, gap, gap, tokens, max_gap)
    assert (refused is None) == (gap <= max_gap)
    if refused is None:
        return
    assert f"v{plan.weights_version}" in refused.reason and "did not arrive" in refused.reason
    b.emit(refused, producer="trainer")
    state = replay(b.build())
    assert state.anomalies == []
    assert plan_step(state) == Wait(WaitReason.REFUSED)
    out = decide(state, state.last_wall_time, 1, AdmissionInputs(now=state.last_wall_time, prompts=[]))
    assert [type(p) for p in out] == [ev.AdmissionPaused, ev.RunFinished]
    halt, end = out
    assert isinstance(halt, ev.AdmissionPaused) and halt.reason == "manual" and halt.detail == refused.reason
    assert isinstance(end, ev.RunFinished) and end.status == "failed" and end.reason == refused.reason
    for p in out:
        b.emit(p, producer="coordinator")
    assert decide_terminal(replay(b.build()), state.last_wall_time) == []  # decided once: the run is over


def test_a_lost_worker_fails_the_run_and_the_deadline_aborts_it() -> None:
    b = ready_run(run_deadline_s=100.0)
    state = replay(b.build())
    assert decide_terminal(state, state.first_wall_time + 99) == []
    late = decide_terminal(state, state.first_wall_time + 101)
    assert len(late) == 1 and isinstance(late[0], ev.RunFinished) and late[0].status == "aborted"
    b.emit(ev.WorkerLost(worker="reward", kind="reward", error="RuntimeError('boom')"), producer="run")
    lost = decide_terminal(replay(b.build()), state.first_wall_time + 1)
    assert len(lost) == 1 and isinstance(lost[0], ev.RunFinished) and lost[0].status == "failed"
    assert "worker reward crashed" in lost[0].reason and "boom" in lost[0].reason


def test_run_finished_is_constructed_only_by_the_coordinators_decider() -> None:
    root = Path(__file__).resolve().parents[1]
    makers = [
        p.relative_to(root).as_posix()
        for folder in ("workflows", "workers", "events", "schemas")
        for p in (root / folder).rglob("*.py")
        if re.search(r"\bRunFinished\(", p.read_text())
    ]
    assert sorted(makers) == ["schemas/events.py", "workflows/coordinator.py"]


# ---------------------------------------------------------------- the single-writer append (real redis-server)
def test_append_once_lets_one_writer_claim_a_step(redis_client: redis.Redis, run_id: str) -> None:
    log = EventLog(redis_client, run_id)

    def batch(producer: str) -> list[ev.Event]:
        return [
            make_event(
                ev.CommandRefused(command="x", reason=producer), run_id=run_id, producer=producer, policy_version=0
            )
        ]

    first = log.append_once(batch("a"), ["step:1", "UpdateStaged:v1"])
    assert first is not None and len(first) == 1
    assert log.append_once(batch("b"), ["step:2", "UpdateStaged:v1"]) is None  # one key taken: nothing written
    assert log.append_once(batch("c"), ["step:2", "UpdateStaged:v2"]) is not None
    assert [s.event.producer for s in log.read()] == ["a", "c"]


def test_a_driver_ends_a_run_whose_coordinator_is_lost_under_the_coordinator_lease(
    redis_client: redis.Redis, run_id: str
) -> None:
    """The coordinator died holding its lease and nothing restarts it: the driver records WorkerLost, waits out the
    lease, and appends the coordinator decider's RunFinished with a larger fencing token, conditionally."""
    log = EventLog(redis_client, run_id)
    for e in LogBuilder(run_id=run_id).start_run().build():
        log.append(e)
    dead = LeaderLease(redis_client, run_id, "coordinator", "coordinator", ttl_ms=300)
    token = dead.acquire()
    assert token is not None
    log.append(
        make_event(
            ev.WorkerLost(worker="coordinator", kind="coordinator", error="boom"),
            run_id=run_id,
            producer="run",
            policy_version=0,
        )
    )
    assert finish_as_coordinator(redis_client, run_id, "run", ttl_ms=300, timeout_s=10)
    events = [s.event for s in log.read()]
    end = events[-1]
    assert isinstance(end.payload, ev.RunFinished) and end.payload.status == "failed" and end.producer == "run"
    assert "worker coordinator crashed: boom" in end.payload.reason
    assert LeaderLease(redis_client, run_id, "coordinator", "x", ttl_ms=300).current_token() == token + 1
    assert replay(events).anomalies == []


def test_a_trainer_started_as_a_fresh_process_takes_its_weights_from_the_log(
    redis_client: redis.Redis, run_id: str, tmp_path: Path
) -> None:
    """Its model comes up at v0; the log says v1 was staged: before planning, the worker loads v1's staged weights."""
    cfg = default_config()
    tok = build_tokenizer()
    model = build_model(cfg.model, len(tok), 0)
    trained = build_model(cfg.model, len(tok), 1)  # other weights: what the dead trainer staged as v1
    store = DirectoryStagingStore(tmp_path / "staging")
    staged = store.stage(1, 0, policy_state(trained))
    log = EventLog(redis_client, run_id)
    b = LogBuilder(cfg, run_id=run_id).start_run()
    b.emit(
        ev.UpdateStaged(
            version=1,
            base_version=0,
            manifest_digest=staged.manifest_digest,
            weights_digest=staged.manifest.weights_digest,
            uri=staged.uri,
            bytes=staged.bytes,
            tensors=len(staged.manifest.tensors),
        ),
        producer="trainer",
    )
    for e in b.build():
        log.append(e)
    worker = TrainerWorker(redis_client, run_id, "trainer#2", model, store)
    assert state_digest(policy_state(model)) != staged.manifest.weights_digest
    worker.follower.catch_up()
    worker._restore_weights()
    assert state_digest(policy_state(model)) == staged.manifest.weights_digest
