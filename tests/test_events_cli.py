"""`rolledger events RUN` over the committed `abort` fixture log (a fail-rank=1@transfer run) loaded into the test
redis; the incident fold over the same log; the summary's `incidents`; and the fault demo end to end (slow)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import redis

from rolledger.events.codec import decode
from rolledger.events.keys import dead_letter_key, log_key
from rolledger.events.store import PAYLOAD_FIELD, TYPE_FIELD
from rolledger.schemas import events as ev
from rolledger.workers.operator.cli import main
from rolledger.workflows.event_lines import EventFilter, iso_utc, lines, unknown_type_message
from rolledger.workflows.incidents import IncidentFold, incidents, render_incidents
from rolledger.workflows.reducer import fold
from rolledger.workflows.state import RunState
from rolledger.workflows.summary import summarize

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from history import load_entries  # tests/fixtures is not a package (as in test_replay_fixtures.py)

ABORT_ID = "01M8SKT0D669PTCK9G6DDXYW7P"  # the fixture's UpdateAborted (version 1, rank 1, transfer)
ABORT_SID = "1796155965864-0"


def _events(name: str = "abort") -> list[tuple[str, ev.Event]]:
    _, entries = load_entries(name)
    return [(sid, decode(raw)) for sid, raw in entries]


def _load(client: redis.Redis, run_id: str, upto: int | None = None) -> list[tuple[str, bytes]]:
    """XADD the fixture's entries (its own stream ids) into `run_id`'s log; the rest are returned."""
    _, entries = load_entries("abort")
    for sid, raw in entries[:upto]:
        client.xadd(log_key(run_id), {PAYLOAD_FIELD: raw, TYPE_FIELD: decode(raw).type}, id=sid)
    return entries[upto:] if upto is not None else []


def _run(capsys: pytest.CaptureFixture[str], redis_url: str, run_id: str, *flags: str) -> tuple[int, str, str]:
    code = main(["events", run_id, "--redis", redis_url, *flags])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- the command
def test_every_entry_is_one_line_and_the_abort_names_rank_phase_and_reason(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _load(redis_client, run_id)
    code, out, _ = _run(capsys, redis_url, run_id)
    assert code == 0
    assert len(out.splitlines()) == len(load_entries("abort")[1])
    (abort,) = [line for line in out.splitlines() if " UpdateAborted " in line]
    assert abort.startswith(iso_utc(1796155965.8627713))  # UTC wall time to the millisecond
    assert ABORT_SID in abort and "coordinator" in abort and " v1 " in abort
    assert "rank=1" in abort and "phase=transfer" in abort and "injected fail-rank=1@transfer" in abort


def test_type_filter_shows_only_that_type(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _load(redis_client, run_id)
    code, out, _ = _run(capsys, redis_url, run_id, "--type", "UpdateAborted")
    assert code == 0
    (line,) = out.splitlines()
    assert "UpdateAborted" in line and "rank=1" in line and "transfer interrupted" in line
    code, out, _ = _run(capsys, redis_url, run_id, "--type", "UpdateAborted", "--type", "RankPrepareFailed")
    assert [line.split()[2] for line in out.splitlines()] == ["RankPrepareFailed", "UpdateAborted"]


def test_json_lines_parse_and_carry_the_incident(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _load(redis_client, run_id)
    code, out, _ = _run(capsys, redis_url, run_id, "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == len(load_entries("abort")[1])
    (abort,) = [r for r in rows if r["type"] == "UpdateAborted"]
    assert abort["event_id"] == ABORT_ID and abort["stream_id"] == ABORT_SID and abort["version"] == 1
    assert abort["incident"]["rank"] == 1 and abort["incident"]["phase"] == "transfer"
    finished = [r for r in rows if r["type"] == "TrainStepFinished"]
    assert [r["fields"]["step"] for r in finished] == [1, 2, 3]
    assert all("reward" in r["fields"] and "agreement" in r["fields"] for r in finished)


def test_a_misspelt_type_is_one_line_with_a_suggestion_and_exit_2(
    redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, redis_url, run_id, "--type", "UpdateAbortd")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "rolledger events: --type 'UpdateAbortd' is not an event type: did you mean UpdateAborted?"
    ]


def test_a_run_that_does_not_exist_is_one_line_and_exit_2(
    redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, redis_url, run_id)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and run_id in err


def test_rank_group_and_version_filters(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _load(redis_client, run_id)
    _, out, _ = _run(capsys, redis_url, run_id, "--rank", "1", "--version", "1")
    assert [line.split()[2] for line in out.splitlines()] == [
        "PrepareRequested",  # ranks (0, 1)
        "RankPrepareFailed",
        "UpdateAborted",
    ]
    _, out, _ = _run(capsys, redis_url, run_id, "--group", "g000003")
    types = [line.split()[2] for line in out.splitlines()]
    assert types.count("SampleStarted") == 4 and types.count("SampleFinished") == 4
    assert "GroupAdmitted" in types and "GroupCompleted" in types and "BatchConsumed" in types
    assert all("g000003" in line for line in out.splitlines())


def test_since_and_until_take_stream_ids_event_ids_and_iso_times(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _load(redis_client, run_id)
    _, by_event, _ = _run(capsys, redis_url, run_id, "--since", ABORT_ID, "--until", ABORT_ID)
    _, by_stream, _ = _run(capsys, redis_url, run_id, "--since", ABORT_SID, "--until", ABORT_SID)
    assert by_event == by_stream and len(by_event.splitlines()) == 1 and "UpdateAborted" in by_event
    _, by_time, _ = _run(capsys, redis_url, run_id, "--since", "2026-12-01T20:12:46.043Z", "--until", "1796155966043")
    assert [line.split()[2] for line in by_time.splitlines()] == ["RankCommitted", "CacheInvalidated", "HealthPassed"]
    code, _, err = _run(capsys, redis_url, run_id, "--since", "yesterday")
    assert code == 2 and "--since 'yesterday'" in err
    code, _, err = _run(capsys, redis_url, run_id, "--until", "01M8SKT0D669PTCK9G6DDXYW7Z")
    assert code == 2 and "no event with that id" in err


def test_event_id_bounds_are_exact_inside_an_entry_of_several_events(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An entry holds one append's events, all at its stream id: --since/--until EVENT_ID still start and stop at
    that event, while a stream-id bound takes the whole entry."""
    from rolledger.events.store import EventLog

    batch = [e for _, e in _events()[:4]]
    sid = EventLog(redis_client, run_id).append_many([msgspec.structs.replace(e, run_id=run_id) for e in batch])[0]
    ids = [e.event_id for e in batch]
    _, inner, _ = _run(capsys, redis_url, run_id, "--since", ids[1], "--until", ids[2])
    assert [line.split()[2] for line in inner.splitlines()] == [batch[1].type, batch[2].type]
    _, whole, _ = _run(capsys, redis_url, run_id, "--since", sid, "--until", sid)
    assert [line.split()[2] for line in whole.splitlines()] == [e.type for e in batch]


def test_an_undecodable_entry_is_shown_not_skipped_and_nothing_is_written(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _load(redis_client, run_id)
    redis_client.xadd(
        log_key(run_id), {PAYLOAD_FIELD: b"\xc1garbage", TYPE_FIELD: b"UpdateAborted"}, id="1796155966051-0"
    )
    before = sorted(redis_client.keys(f"*{run_id}*"))
    _, out, _ = _run(capsys, redis_url, run_id, "--type", "UpdateAborted")
    assert len(out.splitlines()) == 2 and "UNDECODABLE" in out.splitlines()[1] and "1796155966051-0" in out
    _, out, _ = _run(capsys, redis_url, run_id, "--type", "RunFinished", "--json")
    assert [json.loads(line)["type"] for line in out.splitlines()] == ["RunFinished"]  # claims another type: hidden
    assert sorted(redis_client.keys(f"*{run_id}*")) == before  # no dead letter, nothing else
    assert redis_client.xlen(dead_letter_key(run_id)) == 0


def test_follow_prints_what_is_appended_until_run_finished(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rest = _load(redis_client, run_id, upto=100)
    result: dict[str, int] = {}
    follower = threading.Thread(
        target=lambda: result.update(
            code=main(
                [
                    "events",
                    run_id,
                    "--redis",
                    redis_url,
                    "--follow",
                    "--type",
                    "RunFinished",
                    "--type",
                    "PolicyPublished",
                ]
            )
        ),
        daemon=True,
    )
    follower.start()
    for sid, raw in rest:  # appended while it follows (before or after its first read: either way it must see them)
        redis_client.xadd(log_key(run_id), {PAYLOAD_FIELD: raw, TYPE_FIELD: decode(raw).type}, id=sid)
    follower.join(timeout=60)
    assert not follower.is_alive() and result["code"] == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in out] == ["PolicyPublished", "PolicyPublished", "RunFinished"]


def test_follow_stops_when_nothing_new_arrives(
    redis_client: redis.Redis, redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _load(redis_client, run_id, upto=20)
    code, out, err = _run(capsys, redis_url, run_id, "--follow", "--idle-timeout", "0.3")
    assert code == 0 and len(out.splitlines()) == 20 and "stopped following" in err


# ---------------------------------------------------------------- the pure parts
def test_unknown_type_hints() -> None:
    assert unknown_type_message("UpdateAborted") is None
    assert "did you mean RankQuarantined?" in (unknown_type_message("RankQuarantine") or "")
    assert "did you mean UpdateAborted?" in (unknown_type_message("updateaborted") or "")
    assert "the types are" in (unknown_type_message("Zzz") or "")


def test_iso_utc() -> None:
    assert iso_utc(0.0) == "1970-01-01T00:00:00.000Z"
    assert iso_utc(951_782_400.5) == "2000-02-29T00:00:00.500Z"  # a leap day
    assert iso_utc(1796155965.8627713) == "2026-12-01T20:12:45.863Z"


def test_the_incidents_of_the_abort_fixture() -> None:
    found = incidents([e for _, e in _events()])
    assert [(i.event_id, i.type, i.version, i.rank, i.phase) for i in found] == [
        (ABORT_ID, "UpdateAborted", 1, 1, "transfer")
    ]
    assert "injected fail-rank=1@transfer" in found[0].reason
    assert render_incidents([found[0].to_dict()])[1].strip().startswith("update aborted v1: rank=1 phase=transfer")
    assert incidents([e for _, e in _events("clean")]) == []


def test_an_abort_without_its_prepare_failure_still_is_an_incident_without_a_phase() -> None:
    f = IncidentFold()
    abort = next(e for _, e in _events() if e.type == "UpdateAborted")
    got = f.see(abort)
    assert got is not None and got.rank == 1 and got.phase is None


def test_filters_are_pure_over_the_events() -> None:
    got = lines(_events(), EventFilter(types=frozenset({"UpdateAborted"})))
    assert [(line.stream_id, line.fields.get("phase")) for line in got] == [(ABORT_SID, "transfer")]


def test_the_summary_lists_the_incident() -> None:
    events = [e for _, e in _events()]
    state = RunState()
    for e in events:
        fold(state, e)
    summary = summarize(state, events)
    (incident,) = summary.incidents
    assert incident["event_id"] == ABORT_ID and incident["type"] == "UpdateAborted"
    assert incident["version"] == 1 and incident["rank"] == 1 and "transfer interrupted" in str(incident["reason"])
    assert json.loads(json.dumps(summary.to_dict()))["incidents"][0]["phase"] == "transfer"


# ---------------------------------------------------------------- end to end
@pytest.mark.slow
def test_the_fault_demo_logs_the_abort_as_it_happens(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    code = main(
        [
            "run",
            "--ranks",
            "4",
            "--inject",
            "fail-rank=3@transfer",
            "--steps",
            "2",
            "--runs-dir",
            str(runs),
            "--run-id",
            "demo",
        ]
    )
    _, err = capfd.readouterr()
    assert code == 0
    logged = [json.loads(line) for line in err.splitlines() if line.startswith("{")]  # JSON logs: not a terminal
    aborted = [r for r in logged if r.get("event") == "update aborted"]
    assert len(aborted) == 1, err
    (line,) = aborted
    assert line["level"] == "warning" and line["version"] >= 1 and line["rank"] == 3 and line["phase"] == "transfer"
    assert "fail-rank=3@transfer" in line["reason"]
    assert any(r.get("event") == "rank quarantined" and r.get("rank") == 3 for r in logged)
    assert "update aborted v" in err  # the end-of-run list
    summary = json.loads((runs / "demo" / "summary.json").read_text())
    assert [(i["type"], i["rank"], i["phase"]) for i in summary["incidents"]][:1] == [("UpdateAborted", 3, "transfer")]


def test_a_finished_runs_recorded_server_is_not_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`events`/`audit` on a finished run: its `redis_url` names a socket that went with its server; the probe says
    "not live" at once (the outage retry would have waited ROLLEDGER_REDIS_DEADLINE_S on it), so the AOF is read."""
    from rolledger.events.open_run import _live_url

    monkeypatch.setenv("ROLLEDGER_REDIS_DEADLINE_S", "3600")  # were the probe to retry, this test would hang
    (tmp_path / "redis_url").write_text(f"unix://{tmp_path / 'redis.sock'}\n")
    assert _live_url(tmp_path) is None
