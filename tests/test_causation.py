"""Causation ids on a rank's control events, in a real short run (redis-server, the torch engine, every worker).

The rank decides level-triggered from the folded state, and each action carries the id of the command event it
answers (recorded by the reducer); the rank appends its events with that causation id. Checked on the whole log: every
control event a rank appends names, as its causation id, an earlier event of the command type it answers, and for
versioned events a command about the same version.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_run_loop import execute, small

from rolledger.schemas import events as ev
from rolledger.workflows.lineage import lineage

pytestmark = pytest.mark.slow

# a rank's control event -> the command types it may answer
ANSWERS: dict[type, set[str]] = {
    ev.RankJoined: {"RunStarted", "RankQuarantined"},
    ev.RankPrepared: {"PrepareRequested"},
    ev.RankPrepareFailed: {"PrepareRequested"},
    ev.EnginePaused: {"AdmissionPaused"},
    ev.RankCommitted: {"UpdateCommitted"},
    ev.CacheInvalidated: {"UpdateCommitted"},
    ev.HealthPassed: {"UpdateCommitted"},
    ev.HealthFailed: {"UpdateCommitted"},
    ev.CommandRefused: {"UpdateCommitted"},
    ev.EngineSlept: {"AdmissionPaused"},
    ev.EngineWoke: {"PrepareRequested", "UpdateCommitted", "UpdateAborted"},
    ev.EngineResumed: {"PolicyPublished", "UpdateAborted", "RunStarted"},
}


def check_causes(events: list[ev.Event]) -> dict[str, int]:
    """Assert every rank control event answers an earlier command of the right type (and version); count them."""
    seen: dict[str, ev.Event] = {}
    checked: dict[str, int] = {}
    for e in events:
        allowed = ANSWERS.get(type(e.payload))
        if allowed is not None and e.producer.startswith("rank-"):
            cause = seen.get(e.causation_id or "")
            assert cause is not None, f"{e.type} {e.event_id} names no earlier event ({e.causation_id!r})"
            assert cause.type in allowed, f"{e.type} {e.event_id} answers a {cause.type}, not one of {allowed}"
            version, asked = getattr(e.payload, "version", None), getattr(cause.payload, "version", None)
            if version is not None and asked is not None:
                assert version == asked, (e, cause)  # it answers the command about its own version
            if isinstance(e.payload, ev.RankJoined) and isinstance(cause.payload, ev.RankQuarantined):
                assert cause.payload.rank == e.payload.rank, (e, cause)  # its own quarantine
            checked[e.type] = checked.get(e.type, 0) + 1
        seen[e.event_id] = e
    return checked


@pytest.mark.parametrize(
    ("mode", "injections"),
    [("disaggregated", ()), ("disaggregated", ("fail-rank=1@commit",)), ("colocated", ("fail-rank=1@prepare",))],
)
def test_every_rank_control_event_names_the_command_it_answers(
    redis_url: str, run_id: str, tmp_path: Path, mode: str, injections: tuple[str, ...]
) -> None:
    events, summary = execute(redis_url, run_id, tmp_path, small(mode=mode), *injections)
    assert summary.status == "completed"  # type: ignore[attr-defined]
    checked = check_causes(events)
    expected = {"RankJoined", "RankPrepared", "EnginePaused", "RankCommitted", "CacheInvalidated", "HealthPassed"}
    if mode == "colocated":
        expected = (expected - {"EnginePaused"}) | {"EngineSlept", "EngineWoke", "EngineResumed", "RankPrepareFailed"}
    if injections == ("fail-rank=1@commit",):
        expected |= {"HealthFailed"}
    assert expected <= set(checked), checked
    if not injections:  # the lineage of a trajectory on updated weights shows the command its rank's swap answered
        t = next(
            p.trajectory
            for p in (e.payload for e in events)
            if isinstance(p, ev.SampleFinished) and p.trajectory.policy_version
        )
        lin = lineage(events, t.trajectory_id)
        committed = next(
            e for e in events if isinstance(e.payload, ev.UpdateCommitted) and e.payload.version == t.policy_version
        )
        assert (lin.rank.rank_weights_cause_type, lin.rank.rank_weights_cause_id) == (
            "UpdateCommitted",
            committed.event_id,
        )
        assert f"answering UpdateCommitted {committed.event_id}" in lin.render()
    if injections == ("fail-rank=1@commit",):  # the rejoin answers the quarantine
        assert any(
            isinstance(e.payload, ev.RankJoined)
            and e.causation_id
            and _type_of(events, e.causation_id) == "RankQuarantined"
            for e in events
        )


def _type_of(events: list[ev.Event], event_id: str) -> str:
    return next(e.type for e in events if e.event_id == event_id)
