"""Archive, then trim (events/archiver.py, events/archive.py) on a real redis-server: the archived + live log replays
and audits exactly as the untrimmed log did; a deleted or altered segment is reported by its ids (replay, audit,
lineage); trimming stays behind consumer groups and the latest snapshot; a crash between the steps of a pass loses and
duplicates nothing; a follower starting on a trimmed log starts from the snapshot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
import redis
from logbuilder import LogBuilder

from rolledger.events.archive import (
    ArchiveBroken,
    archive_dir,
    iter_run,
    position,
    read_manifest,
    scan_run,
    successor,
)
from rolledger.events.archiver import Archiver
from rolledger.events.entries import RunClosed
from rolledger.events.keys import dedupe_key, log_key
from rolledger.events.snapshots import latest_snapshot, take_snapshot
from rolledger.events.store import EventLog, as_str
from rolledger.schemas import events as ev
from rolledger.workers.operator.cli import main
from rolledger.workers.runtime.runtime import Follower
from rolledger.workflows.reducer import replay


def build_log(groups: int = 24) -> list[ev.Event]:
    b = LogBuilder(group_size=2).start_run()
    version = 0
    pending: list[str] = []
    for i in range(groups):
        b.group()
        pending.append(b.last_group)
        if i % 4 == 3:
            b.consume(pending)
            pending = []
            version += 1
            b.update(version)
    return b.finish_run().build()


def write_log(client: redis.Redis, run_id: str, events: list[ev.Event], snapshot_at: float = 0.75) -> list[str]:
    """Append the events one entry each (so that the tests count entries as events, and a snapshot may sit after any
    event: a snapshot's position is an entry); snapshot the state after the first `snapshot_at` of them (as the
    coordinator does). Returns the stream ids."""
    log = EventLog(client, run_id)
    ids = [log.append(e) for e in events]
    k = int(len(events) * snapshot_at)
    if k:
        take_snapshot(client, run_id, replay(events[:k]), ids[k - 1])
    return ids


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    try:
        return code, json.loads(out), err
    except json.JSONDecodeError:
        return code, out, err


@pytest.fixture
def runs(tmp_path: Path, run_id: str) -> Path:
    (tmp_path / run_id).mkdir()
    return tmp_path


def archiver(client: redis.Redis, runs: Path, run_id: str, **kw: int) -> Archiver:
    return Archiver(client, run_id, archive_dir(runs / run_id), **kw)


def test_archive_and_trim_keep_replay_and_audit_and_bound_the_live_stream(
    redis_client: redis.Redis, redis_url: str, run_id: str, runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = build_log()
    ids = write_log(redis_client, run_id, events)
    common = ("--redis", redis_url, "--runs-dir", str(runs))
    code, before, _ = cli(capsys, "replay", run_id, "--json", *common)
    assert code == 0
    acode, audit_before, _ = cli(capsys, "audit", run_id, "--json", *common)
    dedupe_before = int(redis_client.hlen(dedupe_key(run_id)))

    a = archiver(redis_client, runs, run_id, keep_live=20, archive_every=40)
    passes = [a.run_once() for _ in range(len(events) // 40 + 2)]
    segments = read_manifest(redis_client, run_id).segments
    assert len(segments) >= 2 and all(s.count >= 1 for s in segments)
    assert sum(s.count for s in segments) + redis_client.xlen(log_key(run_id)) == len(events)
    # trimmed up to the snapshot (at 3/4 of the log), never past it: what is left live starts right after it
    snap_at = ids[int(len(events) * 0.75) - 1]
    live: Any = redis_client.xrange(log_key(run_id), "-", "+", count=1)
    assert live[0][0].decode() == ids[ids.index(snap_at) + 1]
    assert passes[-1].trimmed_to == successor(snap_at)

    code, after, _ = cli(capsys, "replay", run_id, "--json", *common)
    assert code == 0 and after["archive_problems"] == []
    assert after["digest"] == before["digest"] and after["state"] == before["state"]
    assert after["snapshots"] == before["snapshots"] and after["snapshot_plus_tail"] == before["snapshot_plus_tail"]
    code, audit_after, _ = cli(capsys, "audit", run_id, "--json", *common)
    assert (code, audit_after) == (acode, audit_before)
    assert [s.stream_id for s in iter_run(redis_client, run_id)] == ids

    # the dedupe hash lost the fields of trimmed events; an append retried inside the live window is still idempotent
    first_live = position(live[0][0].decode())
    hash_now: Any = redis_client.hgetall(dedupe_key(run_id))
    left = {k: v.decode() for k, v in hash_now.items()}
    assert len(left) < dedupe_before and all(position(v) >= first_live for v in left.values())
    assert EventLog(redis_client, run_id).append_many([events[-2]]) == [ids[-2]]

    # a segment is plain msgpack: one [id, {field: value}] per entry
    seg = segments[0]
    with (archive_dir(runs / run_id) / f"{seg.name}.msgpack").open("rb") as f:
        items = list(msgpack.Unpacker(f, raw=False))
    assert items[0][0] == ids[0] and items[0][1]["t"] == "RunStarted" and len(items) == seg.count
    index = json.loads((archive_dir(runs / run_id) / f"{seg.name}.json").read_text())
    assert (index["first_id"], index["last_id"], index["count"], index["digest"]) == (
        seg.first_id,
        seg.last_id,
        seg.count,
        seg.digest,
    )


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_a_deleted_or_altered_segment_is_reported_with_its_ids(
    redis_client: redis.Redis,
    redis_url: str,
    run_id: str,
    runs: Path,
    capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    events = build_log()
    write_log(redis_client, run_id, events)
    a = archiver(redis_client, runs, run_id, keep_live=20, archive_every=40)
    for _ in range(4):
        a.run_once()
    segments = read_manifest(redis_client, run_id).segments
    victim = segments[1]
    path = archive_dir(runs / run_id) / f"{victim.name}.msgpack"
    if damage == "delete":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    common = ("--redis", redis_url, "--runs-dir", str(runs))

    code, out, _ = cli(capsys, "replay", run_id, "--json", *common)
    assert code == 1
    [problem] = out["archive_problems"]
    assert (problem["first_id"], problem["last_id"]) == (victim.first_id, victim.last_id)
    assert problem["reason"].startswith("missing" if damage == "delete" else "tampered")

    code, out, _ = cli(capsys, "audit", run_id, "--json", *common)
    assert code == 1 and out["verdict"] != "OK"
    assert any(victim.first_id in v["message"] and victim.last_id in v["message"] for v in out["violations"])
    code, text, _ = cli(capsys, "audit", run_id, *common)
    assert f"{victim.first_id}..{victim.last_id}" in text

    code, _, err = cli(capsys, "lineage", run_id, "g000024/0", "--json", *common)
    assert code == 1 and f"{victim.first_id}..{victim.last_id}" in err
    with pytest.raises(ArchiveBroken, match=victim.first_id):
        list(iter_run(redis_client, run_id))


def test_altering_the_sidecar_with_the_segment_is_still_caught(
    redis_client: redis.Redis, run_id: str, runs: Path
) -> None:
    """The manifest in Redis repeats each digest: rewriting a segment and its index file together is not enough."""
    events = build_log(8)
    write_log(redis_client, run_id, events)
    a = archiver(redis_client, runs, run_id, keep_live=5, archive_every=10)
    a.run_once()
    seg = read_manifest(redis_client, run_id).segments[0]
    d = archive_dir(runs / run_id)
    with (d / f"{seg.name}.msgpack").open("rb") as f:
        items = list(msgpack.Unpacker(f, raw=False))
    items = items[:-1]  # one event dropped, file and index rewritten consistently
    (d / f"{seg.name}.msgpack").write_bytes(b"".join(msgpack.packb(i, use_bin_type=True) for i in items))
    index = json.loads((d / f"{seg.name}.json").read_text())
    index["count"] = len(items)
    (d / f"{seg.name}.json").write_text(json.dumps(index))
    scan = scan_run(redis_client, run_id, d)
    assert [(p.first_id, p.last_id) for p in scan.problems] == [(seg.first_id, seg.last_id)]


def test_trimming_never_passes_a_groups_pending_or_undelivered_entries(
    redis_client: redis.Redis, run_id: str, runs: Path
) -> None:
    events = build_log(8)
    ids = write_log(redis_client, run_id, events, snapshot_at=1.0)  # the snapshot allows everything
    key = log_key(run_id)
    redis_client.xgroup_create(key, "slow", id="0")
    redis_client.xgroup_create(key, "behind", id=ids[40])  # delivered nothing after ids[40]
    got: Any = redis_client.xreadgroup("slow", "c1", {key: ">"}, count=30)
    delivered = [e[0].decode() for e in got[0][1]]
    redis_client.xack(key, "slow", *delivered[:10])  # ids[10..29] still pending

    a = archiver(redis_client, runs, run_id, keep_live=0, archive_every=1)
    result = a.run_once()
    # the archive stops below the pending ids[10]; the MINID is the id just after the last archived entry (ids[10]
    # itself when both sit in the same millisecond, an id between them otherwise)
    assert result.trimmed == 10
    assert result.trimmed_to == successor(ids[9])
    first: Any = redis_client.xrange(key, "-", "+", count=1)
    assert first[0][0].decode() == ids[10]
    assert redis_client.xpending(key, "slow")["min"].decode() == ids[10]

    redis_client.xack(key, "slow", *delivered[10:])  # slow is done with 0..29; behind still needs 41 on
    a.run_once()
    first = redis_client.xrange(key, "-", "+", count=1)
    assert first[0][0].decode() == ids[30]
    redis_client.xreadgroup("slow", "c1", {key: ">"})
    redis_client.xreadgroup("behind", "c1", {key: ">"})
    a.run_once()  # both groups have everything delivered, nothing acknowledged by "behind": pending from ids[41]
    first = redis_client.xrange(key, "-", "+", count=1)
    assert first[0][0].decode() == ids[30]  # slow's pending 30.. now holds it
    assert [s.stream_id for s in iter_run(redis_client, run_id)] == ids


def test_without_a_snapshot_nothing_is_trimmed(redis_client: redis.Redis, run_id: str, runs: Path) -> None:
    events = build_log(8)
    write_log(redis_client, run_id, events, snapshot_at=0)
    result = archiver(redis_client, runs, run_id, keep_live=0, archive_every=1).run_once()
    assert result.segments == () and result.trimmed == 0
    assert redis_client.xlen(log_key(run_id)) == len(events)


def test_a_crash_between_the_steps_of_a_pass_loses_and_duplicates_nothing(
    redis_client: redis.Redis, run_id: str, runs: Path
) -> None:
    events = build_log()
    ids = write_log(redis_client, run_id, events, snapshot_at=1.0)
    d = archive_dir(runs / run_id)
    a = archiver(redis_client, runs, run_id, keep_live=10, archive_every=30)

    # 1. a segment written and recorded, then a crash before the trim
    seg = a.write_segment(a.safe_point(), 30)
    assert seg is not None and seg.count == 30
    assert redis_client.xlen(log_key(run_id)) == len(events)
    assert [s.stream_id for s in iter_run(redis_client, run_id)] == ids  # archived entries still live: read once

    # 2. a segment file written but the pass died before recording it (the compare-and-set lost: simulated by a
    #    concurrent record), leaving an orphan file the next pass removes
    class Crashing(Archiver):
        def _fail(self, **_: Any) -> Any:
            raise RuntimeError("killed after writing the file")

    crashing = Crashing(redis_client, run_id, d, keep_live=10, archive_every=30)
    crashing._record = crashing._fail  # type: ignore[assignment]
    with pytest.raises(RuntimeError):
        crashing.write_segment(crashing.safe_point(), 30)
    orphans = {p.name for p in d.iterdir()} - {f"{seg.name}.msgpack", f"{seg.name}.json"}
    assert orphans, "the crashed pass left its file"

    # 3. the restarted archiver finishes the job: everything archived exactly once, the orphan gone
    b = archiver(redis_client, runs, run_id, keep_live=10, archive_every=30)
    for _ in range(len(events) // 30 + 2):
        b.run_once()
    manifest = read_manifest(redis_client, run_id)
    named = {f"{s.name}{suffix}" for s in manifest.segments for suffix in (".msgpack", ".json")}
    assert {p.name for p in d.iterdir()} == named  # the orphan was removed or rewritten as the same segment
    assert 10 <= redis_client.xlen(log_key(run_id)) < 10 + 30  # the window: keep_live plus under one segment
    assert sum(s.count for s in manifest.segments) == manifest.count
    assert manifest.count + redis_client.xlen(log_key(run_id)) == len(events)
    assert [s.stream_id for s in iter_run(redis_client, run_id)] == ids
    assert scan_run(redis_client, run_id, d).problems == []


def test_entries_trimmed_without_being_archived_are_reported(
    redis_client: redis.Redis, run_id: str, runs: Path
) -> None:
    events = build_log(8)
    ids = write_log(redis_client, run_id, events, snapshot_at=1.0)
    a = archiver(redis_client, runs, run_id, keep_live=10, archive_every=20)
    a.run_once()
    last = read_manifest(redis_client, run_id).last_id
    assert last is not None
    k = ids.index(last)
    redis_client.xtrim(log_key(run_id), minid=ids[k + 5], approximate=False)  # 4 entries lost from both
    [problem] = scan_run(redis_client, run_id, archive_dir(runs / run_id)).problems
    assert "4 missing" in problem.reason


def test_a_follower_starting_on_a_trimmed_log_starts_from_the_snapshot(
    redis_client: redis.Redis, run_id: str, runs: Path
) -> None:
    events = build_log()
    write_log(redis_client, run_id, events)
    archiver(redis_client, runs, run_id, keep_live=5, archive_every=10).run_once()
    assert redis_client.xlen(log_key(run_id)) < len(events)
    follower = Follower(EventLog(redis_client, run_id))
    follower.catch_up()
    assert follower.state.digest() == replay(events).digest()


def test_a_run_archives_as_it_goes_and_its_log_replays_and_audits(
    redis_url: str, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real `rolledger run` (torch engine) with a tiny window: the driver archives and trims (while the run goes
    once a snapshot allows it, and at its end); the archived + live log replays to the final snapshot's digest (folded from the live stream as the run went),
    every stored snapshot agrees, and the audit passes."""
    from test_run_loop import small

    from rolledger.workers.operator.local_run import LocalRun, RunOptions

    cfg = small(steps=3, log={"keep_live": 15, "archive_every": 15})  # entries: one per append
    summary = LocalRun(RunOptions(config=cfg, redis_url=redis_url, run_id=run_id, runs_dir=tmp_path)).execute()
    assert summary.status == "completed"
    client = redis.Redis.from_url(redis_url)
    try:
        manifest = read_manifest(client, run_id)
        added = int(client.xinfo_stream(log_key(run_id))["entries-added"])
        assert manifest.segments and manifest.trimmed is not None, added
        assert client.xlen(log_key(run_id)) < added
        final = latest_snapshot(client, run_id)
    finally:
        client.close()
    capsys.readouterr()  # the run's own log lines
    common = ("--redis", redis_url, "--runs-dir", str(tmp_path))
    code, out, _ = cli(capsys, "replay", run_id, "--json", *common)
    assert code == 0 and out["archive_problems"] == [] and all(s["ok"] for s in out["snapshots"])
    assert final is not None and out["digest"] == final.digest
    code, audit_out, _ = cli(capsys, "audit", run_id, "--json", *common)
    assert code == 0, audit_out

    # a real run's log with its first segment gone: the reducer cannot fold past the hole, the commands still report
    first = manifest.segments[0]
    (archive_dir(tmp_path / run_id) / f"{first.name}.msgpack").unlink()
    code, out, _ = cli(capsys, "replay", run_id, "--json", *common)
    named = [(p["first_id"], p["last_id"]) for p in out["archive_problems"]]
    assert code == 1 and named[0] == (first.first_id, first.last_id)
    code, audit_out, _ = cli(capsys, "audit", run_id, "--json", *common)
    assert code == 1 and any(f"{first.first_id}..{first.last_id}" in v["message"] for v in audit_out["violations"])


def test_archive_and_trim_through_a_cluster_client(redis_cluster: Any, run_id: str, runs: Path) -> None:
    """The archiver's commands (one-key Lua, XINFO, XPENDING, XTRIM, HSCAN) all name a key of the run's slot: the same
    pass through a Redis Cluster client keeps the whole log readable."""
    from rolledger.events.connection import connect

    client = connect(redis_cluster.url)
    try:
        events = build_log(8)
        ids = write_log(client, run_id, events)
        result = archiver(client, runs, run_id, keep_live=10, archive_every=20).run_once()
        assert result.segments and result.trimmed > 0
        assert [s.stream_id for s in iter_run(client, run_id)] == ids
        assert scan_run(client, run_id, archive_dir(runs / run_id)).problems == []
    finally:
        client.close()


def test_single_writer_keys_go_with_the_trim_and_a_pruned_step_or_version_stays_refused(
    redis_client: redis.Redis, run_id: str, runs: Path
) -> None:
    """The trainer's `append_once` keys (a step, its staged version, each group it consumes) are pruned behind the
    trim like event ids, so the dedupe hash stays bounded on a long run; a step or a version is refused afterwards
    all the same (its sequence's floor was raised past it before its key went), and the run's end stays recorded."""
    events = build_log()
    log = EventLog(redis_client, run_id)
    ids = []
    claimed: list[str] = []
    for e in events:
        if isinstance(e.payload, ev.BatchConsumed):
            step = e.payload.step
            keys = [f"step:{step}", f"UpdateStaged:v{step}", *(f"group:{g}" for g in e.payload.group_ids)]
            got = log.append_once([e], keys)
            assert got is not None
            ids.append(got[0])
            claimed += keys
        else:
            ids.append(log.append(e))
    k = int(len(events) * 0.75)
    take_snapshot(redis_client, run_id, replay(events[:k]), ids[k - 1])
    archiver(redis_client, runs, run_id, keep_live=5, archive_every=10).run_once()

    fields = {as_str(f) for f in redis_client.hkeys(dedupe_key(run_id))}
    left = [key for key in claimed if f"once:{key}" in fields]
    assert 0 < len(left) < len(claimed), left  # those behind the trim went, those in the live window stay
    assert "once:run-finished" in fields
    floor = int(redis_client.hget(dedupe_key(run_id), "floor:once:step:") or -1)
    assert floor >= 1 and "once:step:1" not in fields
    assert int(redis_client.hget(dedupe_key(run_id), "floor:once:UpdateStaged:v") or -1) == floor
    # an event not yet recorded: the keys are checked before the run's end is
    late = [msgspec.structs.replace(events[-1], event_id=f"01LATE{i:020d}") for i in range(4)]
    for e, key in zip(late, (f"step:{floor}", "step:1", f"UpdateStaged:v{floor}"), strict=False):
        assert log.append_once([e], [key]) is None, key  # still taken
    with pytest.raises(RunClosed):  # past the floor the key is free: the append reaches the run-ended check
        log.append_once([late[3]], [f"step:{floor + 1000}"])
