"""The audit cannot be fooled: a run that does not exist is an error, audit and replay write nothing into the run's
Redis, undecodable entries and dead letters are findings (an undecodable decision a violation), duplicates are
found over the whole log and the reducer does not apply them again, an unfinished run is UNFINISHED, events after
RunFinished are violations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from logbuilder import LogBuilder

from rolledger.events.codec import encode, named_form
from rolledger.events.keys import log_key
from rolledger.events.store import PAYLOAD_FIELD, TYPE_FIELD, EventLog, as_str, dead_letter
from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason, RunStatus
from rolledger.workers.operator.cli import main
from rolledger.workflows.audit import audit
from rolledger.workflows.reducer import replay


def finished_log(run_id: str) -> LogBuilder:
    b = LogBuilder(run_id=run_id).start_run()
    b.group(rank=0)
    b.consume([b.last_group])
    return b.finish_run()


def keyspace(client: redis.Redis) -> dict[bytes, Any]:
    """Every key with its type and, for streams and hashes, its length: what a read-only command must not change."""
    out: dict[bytes, Any] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        size = client.xlen(key) if kind == b"stream" else client.hlen(key) if kind == b"hash" else None
        out[key] = (kind, size)
    return out


def future_schema(event: ev.Event) -> bytes:
    """`event` re-encoded as if a newer writer had written it (a schema version this code refuses)."""
    raw = named_form(encode(event))
    raw["v"] = 99
    return bytes(msgpack.packb(raw, use_bin_type=True))


def store(client: redis.Redis, run_id: str, events: list[ev.Event]) -> None:
    EventLog(client, run_id).append_many(events)


# ---------------------------------------------------------------- a run that does not exist
def test_audit_of_a_run_id_with_no_log_is_an_error(
    redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("audit", "replay", "status", "timeline", "lineage"):
        extra = {"timeline": ["--out", "t.html"], "lineage": ["g000001/0"]}.get(command, [])
        assert main([command, "typo-" + run_id, "--redis", redis_url, *extra]) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no such run" in err[0], err


def test_audit_of_a_missing_run_directory_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert main(["audit", "renamed", "--runs-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run directory" in err[0], err


# ---------------------------------------------------------------- read-only
def test_audit_and_replay_write_nothing_and_report_an_undecodable_decision(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    b = finished_log(run_id)
    events = b.build()
    store(redis_client, run_id, events[:-1])
    commit = ev.UpdateCommitted(version=7, ranks=(0,), manifest_digest="m", fence=1)
    bad = LogBuilder(run_id=run_id).emit(commit).last
    bad_id = redis_client.xadd(log_key(run_id), {PAYLOAD_FIELD: future_schema(bad), TYPE_FIELD: "UpdateCommitted"})
    garbage_id = redis_client.xadd(log_key(run_id), {PAYLOAD_FIELD: b"\xc1junk", TYPE_FIELD: "SampleScored"})
    store(redis_client, run_id, events[-1:])
    before = keyspace(redis_client)

    assert main(["audit", run_id, "--redis", redis_url]) == 1
    out = capsys.readouterr().out
    assert main(["replay", run_id, "--redis", redis_url, "--json"]) == 1
    replay_out = capsys.readouterr().out

    assert keyspace(redis_client) == before  # no dead-letter stream, no seen hash, nothing
    assert "VIOLATED" in out and f"log entry {as_str(bad_id)} is a decision (UpdateCommitted)" in out, out
    assert f"warning undecodable: log entry {as_str(garbage_id)} (SampleScored)" in out, out
    assert as_str(bad_id) in replay_out and as_str(garbage_id) in replay_out


def test_existing_dead_letters_are_findings(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store(redis_client, run_id, finished_log(run_id).build())
    dl = dead_letter(redis_client, run_id, stream_id="1-1", raw=b"x", reason="too many deliveries", consumer="rank-0")
    assert main(["audit", run_id, "--redis", redis_url]) == 0  # a dead letter is a finding, not a violation
    out = capsys.readouterr().out
    assert f"warning dead_letter: dead letter {dl} from rank-0 (source 1-1): too many deliveries" in out, out


# ---------------------------------------------------------------- duplicates over the whole log
def test_an_old_duplicate_train_step_is_not_applied_again_and_is_reported() -> None:
    b = LogBuilder().start_run()
    for _ in range(3):
        b.group(rank=0)
        b.consume([b.last_group])
    first_step = b.find_all("TrainStepFinished")[0]
    first_batch = b.find_all("BatchConsumed")[0]
    for i in range(1100):  # more events than the reducer's window of recent ids
        b.emit(
            ev.AdmissionPaused(reason=AdmissionReason.MANUAL, detail=str(i))
            if i % 2 == 0
            else ev.AdmissionResumed(reason=AdmissionReason.MANUAL)
        )
    events = [*b.build(), first_batch, first_step]
    state = replay(events)
    assert state.trainer.step == 3  # not back to 1
    assert state.trainer.consumed_groups == 3 and state.trainer.consumed_trajectories == 3 * 2  # group_size 2
    dup_anomalies = [a for a in state.anomalies if a.event_id in (first_step.event_id, first_batch.event_id)]
    assert len(dup_anomalies) == 2, state.anomalies
    report = audit(events)
    dups = [w for w in report.warnings if w.kind == "duplicate"]
    assert {w.event_ids[0] for w in dups} == {first_step.event_id, first_batch.event_id}


def test_a_step_out_of_order_is_an_anomaly_and_not_applied() -> None:
    b = LogBuilder().start_run()
    b.group(rank=0)
    b.consume([b.last_group], step=5)
    state = replay(b.build())
    assert state.trainer.step == 0
    assert any("step 5 finished while the trainer is at step 0" in a.message for a in state.anomalies)


# ---------------------------------------------------------------- unfinished runs, events after the end
def test_an_unfinished_run_is_reported_unfinished_and_exits_1(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store(redis_client, run_id, finished_log(run_id).build()[:-1])
    assert main(["audit", run_id, "--redis", redis_url]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("UNFINISHED") and "has no RunFinished" in out, out
    assert main(["audit", run_id, "--redis", redis_url, "--json"]) == 1
    assert '"verdict": "UNFINISHED"' in capsys.readouterr().out


def test_events_after_run_finished_are_violations_and_reducer_anomalies() -> None:
    b = finished_log("run-test")
    end = b.last
    b.emit(ev.EngineResumed(rank=0))
    b.emit(ev.EngineResumed(rank=1))
    b.emit(ev.RunFinished(status=RunStatus.FAILED, reason="second"))
    events = b.build()
    report = audit(events)
    (v,) = report.violations
    assert v.invariant == 0 and v.event_ids[:3] == (end.event_id, events[-3].event_id, events[-2].event_id)
    assert "3 events after RunFinished" in v.message
    state = replay(events)
    assert state.status == "completed"  # the second RunFinished does not rewrite the first
    after = {a.event_id for a in state.anomalies if "after the run" in a.message or "after RunFinished" in a.message}
    assert after == {e.event_id for e in events[-3:]}, state.anomalies
