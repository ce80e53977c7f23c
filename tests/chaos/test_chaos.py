"""The chaos suite's pytest entry, and the tests of its parts.

* `test_chaos_schedules` (marker `chaos`, out of the default run): ROLLEDGER_CHAOS_SCHEDULES schedules (default 20)
  from ROLLEDGER_CHAOS_SEED (default 0), with ROLLEDGER_CHAOS_FAULTS (default all); asserts 0 violations and 0 lost
  events and prints the summary line. `test_fault_free_schedules_finish` (also `chaos`): the control, no faults.
* The rest run in the main suite (fast, no processes but one small one): the checks catch what they claim to catch on
  the committed clean run log, schedules replay exactly from their seed or their printed JSON, and the ack hook
  records exactly the appends the server acknowledged.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
import redis

from rolledger.events.codec import decode
from rolledger.schemas import events as ev
from rolledger.schemas.statuses import RunStatus
from rolledger.workflows.reducer import replay

from .checks import Ack, Ending, judge, parse_ack_log, served_versions
from .harness import HOOK_DIR, config_toml
from .run_chaos import fired_kind, run_many
from .schedule import FAULT_KINDS, NET_KINDS, Fault, Schedule, draw, parse_kinds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import history  # tests/fixtures: the committed run logs


def clean_log() -> list[ev.Event]:
    _, entries = history.load_entries("clean")
    return [decode(data) for _, data in entries]


def renamed(e: ev.Event, suffix: str) -> ev.Event:
    return msgspec.structs.replace(e, event_id=e.event_id[:-4] + suffix)


# ---------------------------------------------------------------- the checks
def test_the_clean_run_passes_every_check() -> None:
    events = clean_log()
    acks = [Ack(e.event_id, "-", e.type, "p") for e in events]
    verdict = judge(events, acks)
    assert verdict.ok, verdict.violations
    assert verdict.ending is Ending.FINISHED


def test_an_acknowledged_id_missing_from_the_log_is_lost() -> None:
    events = clean_log()
    gone = events[len(events) // 2]
    acks = [Ack(e.event_id, "-", e.type, "rank0.1") for e in events]
    verdict = judge([e for e in events if e is not gone], acks)
    assert [a.event_id for a in verdict.lost] == [gone.event_id]


def test_a_run_without_runfinished_is_a_violation() -> None:
    events = [e for e in clean_log() if not isinstance(e.payload, ev.RunFinished)]
    verdict = judge(events, [])
    assert verdict.ending is Ending.NOT_ENDED
    assert any("neither finished nor failed closed" in v for v in verdict.violations)


def test_a_failure_must_name_its_reason() -> None:
    events = clean_log()
    i = next(i for i, e in enumerate(events) if isinstance(e.payload, ev.RunFinished))
    failed = msgspec.structs.replace(events[i], payload=ev.RunFinished(status=RunStatus.FAILED, reason=""))
    verdict = judge([*events[:i], failed, *events[i + 1 :]], [])
    assert verdict.ending is Ending.FAILED_CLOSED
    assert any("names no reason" in v for v in verdict.violations)
    named = msgspec.structs.replace(failed, payload=ev.RunFinished(status=RunStatus.FAILED, reason="no rank left"))
    assert not any("names no reason" in v for v in judge([*events[:i], named, *events[i + 1 :]], []).violations)


def test_a_run_that_ends_only_at_its_run_deadline_stalled() -> None:
    events = clean_log()
    started = next(e for e in events if isinstance(e.payload, ev.RunStarted))
    i = next(i for i, e in enumerate(events) if isinstance(e.payload, ev.RunFinished))
    assert isinstance(started.payload, ev.RunStarted)
    limit = started.payload.config.run_deadline_s
    late = msgspec.structs.replace(
        events[i],
        payload=ev.RunFinished(status=RunStatus.ABORTED, reason="run deadline passed"),
        wall_time=started.wall_time + limit + 1,
    )
    log = [*events[:i], late]
    assert any("stalled until its deadline" in v for v in judge(log, []).violations)
    assert not any("stalled" in v for v in judge(log, [], deadline_is_violation=False).violations)
    early = msgspec.structs.replace(late, wall_time=started.wall_time + 5)
    assert not any("stalled" in v for v in judge([*events[:i], early], []).violations)


def test_a_trajectory_trained_twice_and_a_duplicated_event_are_violations() -> None:
    events = clean_log()
    i = next(i for i, e in enumerate(events) if isinstance(e.payload, ev.BatchConsumed))
    again = renamed(events[i], "ZZZZ")
    verdict = judge([*events[: i + 1], again, *events[i + 1 :]], [])
    assert any("trained 2 times" in v for v in verdict.violations)
    verdict = judge([*events[: i + 1], events[i], *events[i + 1 :]], [])
    assert any(f"event {events[i].event_id} is in the log 2 times" in v for v in verdict.violations)


def test_an_impossible_transition_in_the_log_is_a_violation() -> None:
    events = clean_log()
    i = next(i for i, e in enumerate(events) if isinstance(e.payload, ev.SampleFinished))
    late = renamed(events[i], "XXXX")  # a second result for a finished sample: a late one after a reclaim
    verdict = judge([*events[:-1], late, events[-1]], [])
    # by the log's end its group was consumed and left the live state (issue 12): the reducer names it retired
    group = events[i].payload.trajectory.group_id  # type: ignore[attr-defined]
    assert any(
        "reducer anomaly" in v and "(SampleFinished)" in v and f"group {group} already consumed and retired" in v
        for v in verdict.violations
    ), verdict.violations


def test_a_rank_that_announces_an_old_version_is_not_serving_the_published_one() -> None:
    events = clean_log()
    assert served_versions(events) == []
    i = next(i for i, e in enumerate(events) if isinstance(e.payload, ev.RunFinished))
    joined = next(e for e in events if isinstance(e.payload, ev.RankJoined))
    assert isinstance(joined.payload, ev.RankJoined)
    stale = renamed(joined, "YYYY")  # the rank came back on v0 after the last publication
    problems = served_versions([*events[:i], stale, *events[i:]])
    assert any(f"rank {joined.payload.rank}" in p and "v0" in p for p in problems), problems


def test_a_rank_that_rejoined_during_the_last_update_waits_for_its_reload_and_serves_nothing_stale() -> None:
    """Seed 1002 (dist, inject,net): a rank quarantined by one update rejoins on the version published then while
    the next update runs without it, and the run ends before the coordinator's Reload lands. The rank decider holds
    its generation until then, so it is not serving old weights; a sample it starts on them after the publication
    is."""
    events = clean_log()
    published = [i for i, e in enumerate(events) if isinstance(e.payload, ev.PolicyPublished)]
    assert len(published) >= 2
    before = events[published[-2]].payload
    assert isinstance(before, ev.PolicyPublished)
    joined = next(e for e in events if isinstance(e.payload, ev.RankJoined))
    assert isinstance(joined.payload, ev.RankJoined)
    rank = joined.payload.rank
    back = msgspec.structs.replace(
        renamed(joined, "YYYY"),
        payload=msgspec.structs.replace(
            joined.payload, policy_version=before.version, weights_digest=before.weights_digest
        ),
    )
    j = published[-1]
    log = [*events[:j], back, *events[j:]]
    assert replay(log).ranks[rank].committed_version == before.version  # behind the published version at the end
    assert served_versions(log) == []
    started = next(e for e in events if isinstance(e.payload, ev.SampleStarted) and e.payload.rank == rank)
    stale = msgspec.structs.replace(
        renamed(started, "WWWW"), payload=msgspec.structs.replace(started.payload, policy_version=before.version)
    )
    end = next(i for i, e in enumerate(log) if isinstance(e.payload, ev.RunFinished))
    problems = served_versions([*log[:end], stale, *log[end:]])
    assert any(f"rank {rank} ends on v{before.version}" in p for p in problems), problems


def test_a_process_without_the_hook_or_one_that_hangs_fails_the_schedule() -> None:
    events = clean_log()
    verdict = judge(events, [], hooks_missing=["rank1.2"], hung=["trainer.1"])
    assert any("rank1.2" in v for v in verdict.violations)
    assert any("trainer.1 did not exit" in v for v in verdict.violations)


def test_ack_log_lines_and_header() -> None:
    header, acks = parse_ack_log("# hook pid=1 wrapped=append\n01ABC 1-0 RankJoined append\n", "rank0.1")
    assert header and acks == [Ack("01ABC", "1-0", "RankJoined", "rank0.1")]
    assert parse_ack_log("01ABC 1-0 RankJoined append\n", "x")[0] is False


# ---------------------------------------------------------------- schedules
def test_a_schedule_is_a_function_of_its_seed_and_replays_from_its_json() -> None:
    for seed in range(50):
        s = draw(seed)
        assert s == draw(seed)
        assert Schedule.from_json(s.to_json()) == s
        process_faults = [st for st in s.faults if st.fault.kind != "net"]
        assert 1 <= len(process_faults) <= 3 and 2 <= s.steps <= 3 and 2 <= s.group_size <= 4
        assert len(s.faults) - len(process_faults) <= 2  # network faults beside them
        assert all(step.fault.proc in ("", *s.processes) for step in s.faults)
    assert {step.fault.kind for seed in range(200) for step in draw(seed).faults} == set(FAULT_KINDS)
    assert [draw(seed).rollout for seed in range(4)] == ["plain", "recycle"] * 2  # every batch holds both
    assert draw(7, rollouts=("plain",)).rollout == "plain"
    keep = config_toml(
        draw(7, rollouts=("interruptible",)), Path("/staging"), 60.0
    )  # by hand: --rollouts interruptible
    assert "interruptible = true" in keep and 'drain_mode = "keep"' in keep and "recycle_aborted = false" in keep
    many = config_toml(draw(7, rollouts=("many",)), Path("/staging"), 60.0)  # by hand: --rollouts many
    assert "rank_slots = 3" in many and "process = true" in many and "max_batch_groups = 2" in many
    assert "process = false" in keep and "rank_slots = 1" in keep
    assert draw(7, parse_kinds("none")).faults == ()
    assert {st.fault.kind for seed in range(30) for st in draw(seed, parse_kinds("stop")).faults} == {"stop"}
    with pytest.raises(ValueError, match="unknown kind"):
        parse_kinds("kill,nuke")


# the process faults of these seeds as drawn before network faults and the dist kills existed (pinned)
PINNED = [
    (
        '{"seed":0,"steps":3,"group_size":3,"groups_per_step":1,"coordinators":1,"faults":["after:UpdateCommitted#2 -> '
        'slow:rank1:7.8","at:3.3 -> freeze:rank0:8.3","at:1.9 -> redis-term:3"],"transport":"dist","rollout":"plain"}'
    ),
    (
        '{"seed":1,"steps":2,"group_size":4,"groups_per_step":1,"coordinators":1,"faults":["after:RankCommitted#4 -> '
        'redis-kill:1.4"],"transport":"directory","rollout":"recycle"}'
    ),
    (
        '{"seed":7,"steps":3,"group_size":2,"groups_per_step":2,"coordinators":2,"faults":["after:RankPrepared#1 -> '
        'freeze:rank0:8.7"],"transport":"dist","rollout":"recycle"}'
    ),
]


def _process_part(s: Schedule) -> Schedule:
    """`s` without what the separate generators add: network faults and the dist transport's process kills."""
    keep = [
        st for st in s.faults if st.fault.kind != "net" and not st.fault.spec.startswith(("kill-trainer", "kill-rank"))
    ]
    return dataclasses.replace(s, faults=tuple(keep))


def test_network_faults_and_dist_kills_leave_every_seeds_process_faults_as_they_were() -> None:
    transports = ("directory", "dist")
    for pinned in PINNED:
        old = Schedule.from_json(pinned)
        assert _process_part(draw(old.seed, transports=transports)) == old
        assert (
            draw(old.seed, tuple(k for k in FAULT_KINDS if k != "net"), transports=transports).faults[: len(old.faults)]
            == old.faults
        )
    no_net = tuple(k for k in FAULT_KINDS if k != "net")
    for seed in range(300):
        assert _process_part(draw(seed)) == draw(seed, no_net)  # directory: nothing else moves
        assert _process_part(draw(seed, transports=transports)) == _process_part(
            draw(seed, no_net, transports=transports)
        )
    dist = [draw(seed, transports=("dist",)) for seed in range(60)]
    specs = {st.fault.spec.split("=")[0] for s in dist for st in s.faults if st.fault.kind == "inject"}
    assert {"kill-trainer@copy", "kill-rank"} <= specs
    directory = [draw(seed) for seed in range(300)]
    assert not any(st.fault.spec.startswith("kill-") for s in directory for st in s.faults)  # dist schedules only
    net = [st.fault for seed in range(100) for st in draw(seed, parse_kinds("net")).faults]
    assert {f.spec for f in net} == set(NET_KINDS) and all(f.kind == "net" for f in net)
    assert all(
        f.seconds <= 5.0 for f in net if f.spec in ("stall", "partition")
    )  # inside the recovery deadlines (schedule.py's docstring)
    assert all(1 <= len(draw(seed, parse_kinds("net")).faults) <= 3 for seed in range(100))
    f = Fault.parse("net:rank0:partition:2.5")
    assert f == Fault("net", proc="rank0", spec="partition", seconds=2.5) and f.render() == "net:rank0:partition:2.5"
    with pytest.raises(ValueError):
        Fault.parse("net:rank0:flood:2")


def test_run_chaos_counts_the_faults_fired_by_kind() -> None:
    fired = [
        "t+1.0s kill:rank0:1.2",
        "t+2.0s net:rank1:partition:3",
        "t+2.5s net:driver:reset:0",
        "inject kill-rank=1@receive",
    ]
    fired += ["inject kill-trainer@copy", "inject fail-rank=0@prepare", "t+3.1s freeze:rank0:7 (seen stopped)"]
    assert [fired_kind(f) for f in fired] == [
        "kill", "net:partition", "net:reset", "inject:kill-rank", "inject:kill-trainer", "inject:fail-rank", "freeze"
    ]  # fmt: skip


# ---------------------------------------------------------------- the ack hook, in a real process
_PRODUCER = """
from rolledger.events.connection import connect
from rolledger.events.envelope import make_event
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
import sys
log = EventLog(connect(sys.argv[1]), sys.argv[2])
def e(w):
    return make_event(ev.WorkerLost(worker=w), run_id=sys.argv[2], producer="t", policy_version=0)
log.append(e("a"))
log.append_many([e("b"), e("c")])
first = e("d")
log.append_idempotent(first)
log.append_idempotent(first)
assert log.append_once([e("won")], ["k1"]) is not None
assert log.append_once([e("lost")], ["k1"]) is None
"""


def test_the_hook_records_every_acknowledged_append_and_nothing_else(redis_url: str, run_id: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ack = Path(tmp) / "acks.log"
        env = {**os.environ, "PYTHONPATH": str(HOOK_DIR), "ROLLEDGER_ACK_LOG": str(ack)}
        subprocess.run([sys.executable, "-c", _PRODUCER, redis_url, run_id], env=env, check=True, timeout=60)
        header, acks = parse_ack_log(ack.read_text(), "p")
    assert header
    client = redis.Redis.from_url(redis_url)
    from rolledger.events.store import EventLog

    in_log = [s.event for s in EventLog(client, run_id).read()]
    client.close()
    workers = [e.payload.worker for e in in_log if isinstance(e.payload, ev.WorkerLost)]
    assert workers == ["a", "b", "c", "d", "won"]
    assert sorted({a.event_id for a in acks}) == sorted(e.event_id for e in in_log)  # "d" acknowledged twice
    assert judge(in_log, acks).lost == []


# ---------------------------------------------------------------- the suite itself
def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


@pytest.mark.chaos
def test_fault_free_schedules_finish(tmp_path: Path) -> None:
    schedules = [draw(_env_int("ROLLEDGER_CHAOS_SEED", 0) + i, ()) for i in range(2)]
    totals, results = run_many(schedules, tmp_path, faults="none")
    print(totals.line())
    assert totals.finished == totals.schedules, [r.verdict.violations for r in results]
    assert totals.violations == 0 and totals.lost == 0


@pytest.mark.chaos
def test_chaos_schedules(tmp_path: Path) -> None:
    n = _env_int("ROLLEDGER_CHAOS_SCHEDULES", 20)
    seed = _env_int("ROLLEDGER_CHAOS_SEED", 0)
    faults = os.environ.get("ROLLEDGER_CHAOS_FAULTS", "all")
    schedules = [draw(seed + i, parse_kinds(faults)) for i in range(n)]
    lines: list[str] = []
    totals, _ = run_many(
        schedules, tmp_path, parallel=_env_int("ROLLEDGER_CHAOS_PARALLEL", 1), faults=faults, out=lines.append
    )
    print("\n".join(lines))
    assert totals.violations == 0 and totals.lost == 0, "\n".join(lines)
