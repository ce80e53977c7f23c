"""Colocated mode: engines sleep while the trainer trains, wake in a checked order, never take weights asleep;
disaggregated mode: the lag cap at consumption; the delayed trainer stays within the caps."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from test_run_loop import execute, of, small

from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.schemas.statuses import WakeTag
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer
from rolledger.workers.roles.rank import RankWorker
from rolledger.workflows.admission import throttle_bound
from rolledger.workflows.audit import audit
from rolledger.workflows.rank import Commit
from rolledger.workflows.reducer import replay

pytestmark = pytest.mark.slow


def per_rank(events: list[ev.Event], rank: int) -> list[ev.Event]:
    return [e for e in events if getattr(e.payload, "rank", None) == rank]


@pytest.mark.parametrize("level", [1, 2])
def test_colocated_handoffs_sleep_train_wake_in_order(redis_url: str, run_id: str, tmp_path: Path, level: int) -> None:
    events, summary = execute(redis_url, run_id, tmp_path, small(mode="colocated", sleep_level=level))
    assert summary.status == "completed" and audit(events).ok
    slept = of(events, ev.EngineSlept)
    assert len(slept) == 3 * 2  # every step, both ranks
    assert all(s.verified and s.bytes_freed > 0 and s.level == level for s in slept)
    for rank in (0, 1):
        seq = [
            (e.type, getattr(e.payload, "tags", None))
            for e in per_rank(events, rank)
            if e.type in ("EngineSlept", "EngineWoke", "RankCommitted", "HealthPassed", "EngineResumed")
        ]
        expected = [
            ("EngineSlept", None),
            ("EngineWoke", ("weights",)),
            ("RankCommitted", None),
            ("EngineWoke", ("kv_cache",)),
            ("HealthPassed", None),
            ("EngineResumed", None),
        ] * 3
        assert seq == expected
    woke = [w for w in of(events, ev.EngineWoke) if w.tags == ("weights",)]
    assert all(w.bytes_restored > 0 for w in woke)  # the weights' memory comes back (level 2: reallocated, refilled)
    # the trainer's phase falls while both engines sleep
    index = {e.event_id: i for i, e in enumerate(events)}
    for step in of(events, ev.TrainStepFinished):
        e = next(x for x in events if isinstance(x.payload, ev.TrainStepFinished) and x.payload.step == step.step)
        before = [x for x in events[: index[e.event_id]] if x.type in ("EngineSlept", "EngineWoke")]
        asleep = {x.payload.rank for x in before[-2:] if isinstance(x.payload, ev.EngineSlept)}
        assert asleep == {0, 1}
    assert summary.handoff_tax is not None and 0 < summary.handoff_tax < 1


def test_an_update_sent_to_a_sleeping_rank_is_refused_with_an_event(redis_url: str, run_id: str) -> None:
    torch.manual_seed(0)
    tok = build_tokenizer()
    engine = TorchEngine(build_model(RunConfig().model, len(tok), 0), tok, rank=0)
    client = redis.Redis.from_url(redis_url)
    worker = RankWorker(client, run_id, 0, engine)
    engine.sleep(1)
    commit = Commit(version=1, uri="", manifest_digest="m", weights_digest="w", cause="01CMDUPDATECOMMITTED000001")
    worker.execute(commit)  # the weights are asleep: the engine refuses, the rank says so in the log
    logged = [s.event for s in EventLog(client, run_id).read()]
    assert {e.causation_id for e in logged} == {commit.cause}  # both answer the commit command
    got = [e.payload for e in logged]
    assert isinstance(got[0], ev.CommandRefused) and "asleep" in got[0].reason and got[0].rank == 0
    assert isinstance(got[1], ev.HealthFailed)
    assert engine.asleep_level == 1  # nothing changed
    client.close()


def test_reducer_flags_kv_before_weights_and_weights_swapped_while_asleep() -> None:
    from logbuilder import LogBuilder

    b = LogBuilder().start_run()
    b.emit(ev.EngineSlept(rank=0, level=1, bytes_freed=10, verified=True))
    b.emit(ev.EngineWoke(rank=0, tags=(WakeTag.KV_CACHE,)))
    state = replay(b.build())
    assert any("kv_cache before weights" in a.message for a in state.anomalies)


def test_delayed_trainer_keeps_queue_and_lag_within_their_caps(redis_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = small(admission={"max_queued_bytes": 6000, "max_lag": 1, "max_inflight_groups": 4})
    events, summary = execute(redis_url, run_id, tmp_path, cfg, "delay-trainer=1.5")
    assert summary.status == "completed" and audit(events).ok
    assert summary.max_queued_bytes <= 6000 and summary.max_lag <= 1
    admitted = of(events, ev.GroupAdmitted)
    assert all(a.queued_bytes <= a.byte_cap == 6000 for a in admitted)
    pauses = {p.reason for p in of(events, ev.AdmissionPaused)}
    assert pauses & {"bytes", "rate", "lag"}  # the slow trainer made admission stop, not the queue grow
    check = summary.queue_check
    assert check["throttle_cap_groups"] == throttle_bound(cfg)
    assert check["measured_max_queue_groups"] is not None and check["throttle_cap_groups"] is not None
    assert check["measured_max_queue_groups"] <= check["throttle_cap_groups"]


def test_lag_cap_is_enforced_again_at_consumption(redis_url: str, run_id: str, tmp_path: Path) -> None:
    """A group that waited past the cap (admitted under a looser cap, consumed under max_lag 0) is dropped, counted."""
    cfg = small(
        admission={"max_lag": 0, "throttle_to_drain_rate": False, "max_inflight_groups": 8},
        trainer={"warm_start_steps": 10, "groups_per_step": 1},
    )
    events, summary = execute(redis_url, run_id, tmp_path, cfg)
    assert audit(events).ok
    consumed = of(events, ev.BatchConsumed)
    assert all(lag == 0 for b in consumed for lag in b.lags)
    dropped = of(events, ev.TrajectoryDropped)
    assert summary.trajectories_dropped == sum(len(d.trajectory_ids) for d in dropped)
