"""Full disks, for real: a small tmpfs mounted for the test (root, or a user namespace that allows mounts; skipped,
saying why, where neither can mount), filled by a test-only file that takes every free byte, then deleted to make room.

- runs/ full while the trainer stages: the staging directory of a real run (every worker a thread, a real
  redis-server) is full before v1 is staged. The trainer says so in one line naming the file, stages nothing and
  appends nothing (no UpdateStaged, no step recorded, no version directory, no half-written temporary one) while the
  disk stays full; once the filler is deleted it stages v1 and the run completes with a clean audit.
- the Redis AOF's disk full: a redis-server whose `dir` is the small filesystem refuses writes (MISCONF) once its
  AOF write fails. An append waits (one "redis unavailable, retrying" line naming MISCONF), goes on once there is
  room, and every append that was acknowledged, before, during or after, is in the log exactly once after the server
  is SIGKILLed and restarted over its AOF. Past the deadline a refused write is one line (RedisRefusesWrites).
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from conftest import _free_port, redis_binary
from structlog.testing import capture_logs
from test_run_loop import small

from rolledger.events.connection import connect
from rolledger.events.disk_full import DiskFull, free_bytes
from rolledger.events.envelope import make_event
from rolledger.events.outage import RedisRefusesWrites, outages
from rolledger.events.refusal import refusal_line
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.workers.operator.local_run import LocalRun, RunOptions
from rolledger.workers.roles.trainer import TrainerWorker
from rolledger.workers.weights.staging_store import DirectoryStagingStore
from rolledger.workflows.audit import audit
from rolledger.workflows.summary import Summary

WAIT_S = 120.0  # bound on every wait for a condition below (a loaded 2-core machine)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """mount(size_bytes) -> a fresh tmpfs of that size (unmounted after the test)."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        got = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
        if got.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({' '.join(got.stderr.split()) or got.returncode})")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(fs: Path) -> Path:
    """A file taking every free byte of `fs` (1 MiB writes, then 4 KiB, then single bytes until ENOSPC)."""
    path = fs / f"filler-{uuid.uuid4().hex[:6]}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    assert free_bytes(fs) == 0
    return path


def until(cond: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.05)  # polling a condition with a deadline


# ---------------------------------------------------------------------- runs/ full while staging


@pytest.mark.slow
def test_a_full_staging_disk_stages_nothing_says_so_once_and_goes_on_once_there_is_room(
    small_fs: Callable[[int], Path], redis_url: str, run_id: str, tmp_path: Path
) -> None:
    staging = small_fs(8 << 20)  # the tiny policy's weights are 1.2 MB
    filler = fill(staging)
    cfg = small(update={"staging_dir": str(staging), "prepare_deadline_s": 20, "drain_deadline_s": 20})
    run = LocalRun(RunOptions(config=cfg, redis_url=redis_url, run_id=run_id, runs_dir=tmp_path, deadline_s=240))
    result: dict[str, object] = {}

    def go() -> None:
        try:
            result["summary"] = run.execute()
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    with capture_logs() as logs:
        driver = threading.Thread(target=go, daemon=True)
        driver.start()
        until(lambda: any(isinstance(w, TrainerWorker) for w in run.workers) or not driver.is_alive(), "trainer")
        trainer = next(w for w in run.workers if isinstance(w, TrainerWorker))
        assert trainer.seat.disk_full.wait(WAIT_S), result
        log = EventLog(redis.Redis.from_url(redis_url), run_id)
        # paused, not slow: the step waits with its version unstaged; the same holds a moment later
        for _ in range(2):
            payloads = [s.event.payload for s in log.read()]
            assert not [p for p in payloads if isinstance(p, (ev.UpdateStaged, ev.TrainStepFinished))]
            assert sorted(p.name for p in staging.iterdir()) == [filler.name]  # no version, no temporary directory
            assert trainer.alive and trainer.seat.disk_full.is_set()
            time.sleep(1.0)  # the claim is about what does not happen while the disk stays full
        filler.unlink()  # room again
        driver.join(WAIT_S)
    assert not driver.is_alive() and "error" not in result, result
    summary = result["summary"]
    assert isinstance(summary, Summary)
    events = [s.event for s in log.read()]
    assert summary.status == "completed", summary
    report = audit(events)
    assert report.ok, report.render()
    staged = [e.payload.version for e in events if isinstance(e.payload, ev.UpdateStaged)]
    assert staged == [1, 2, 3]  # v1 staged once, after the room came back; no version skipped or reused
    full = [e for e in logs if "no room to write" in str(e["event"])]
    assert len(full) == 1, full  # one line, naming the file, however long it waited
    line = str(full[0]["event"])
    assert "\n" not in line and str(staging) in line and "v1 is not staged" in line, line
    assert [e for e in logs if "room again" in str(e["event"])]
    assert not [e for e in logs if e.get("exc_info") or e["log_level"] == "critical"]


def test_a_stage_on_a_full_disk_removes_what_it_wrote_and_names_the_file(
    small_fs: Callable[[int], Path], tmp_path: Path
) -> None:
    """The store's part alone: a write that runs out of room mid-file leaves nothing and raises DiskFull."""
    import torch

    fs = small_fs(1 << 20)
    store = DirectoryStagingStore(fs / "staging")
    weights = {"w": torch.arange(400_000, dtype=torch.float32)}  # 1.6 MB: more than the filesystem holds
    with pytest.raises(DiskFull) as got:
        store.stage(1, 0, weights)
    assert "staging v1: no room to write" in str(got.value) and str(fs) in str(got.value)
    assert got.value.need > 1_600_000
    assert list((fs / "staging").iterdir()) == [] and store.versions() == []


# ---------------------------------------------------------------------- the Redis AOF's disk full


class SmallDiskRedis:
    """A redis-server whose AOF directory is `fs`, on a free loopback port (appendfsync no, as the embedded one)."""

    def __init__(self, fs: Path) -> None:
        self.fs = fs
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                redis_binary(),
                *("--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.fs)),
                *("--appendonly", "yes", "--appendfsync", "no", "--save", ""),
                *("--logfile", str(self.fs.parent / f"redis-{self.port}.log")),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        probe = redis.Redis.from_url(self.url)
        until(lambda: self._answers(probe), "redis-server")
        probe.close()

    def _answers(self, probe: redis.Redis) -> bool:
        assert self.proc is not None and self.proc.poll() is None, "redis-server exited"
        try:
            return bool(probe.ping())
        except redis.ConnectionError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=20)


def _event(i: int) -> ev.Event:
    return make_event(
        ev.SampleScored(sample_id=f"g{i}/0", group_id=f"g{i}", reward=0.5, correct=True),
        run_id="df",
        producer="test",
        policy_version=0,
    )


def test_a_full_aof_disk_pauses_writes_in_one_line_and_loses_nothing_acknowledged(
    small_fs: Callable[[int], Path],
) -> None:
    fs = small_fs(4 << 20)
    server = SmallDiskRedis(fs)
    server.start()
    try:
        client = connect(server.url, retry_deadline=WAIT_S)
        log = EventLog(client, "df")
        acked: list[tuple[str, str]] = []  # (event id, stream id) of every append Redis acknowledged
        for i in range(20):
            e = _event(i)
            acked.append((e.event_id, log.append(e)))
        filler = fill(fs)
        stop = threading.Event()
        failed: list[BaseException] = []

        def writer() -> None:
            i = 100
            try:
                while not stop.is_set():
                    e = _event(i)
                    acked.append((e.event_id, log.append(e)))
                    i += 1
            except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
                failed.append(exc)

        with capture_logs() as logs:
            t = threading.Thread(target=writer, daemon=True)
            t.start()
            until(lambda: outages(client) >= 1 or bool(failed), "MISCONF wait")  # the AOF write failed: refused
            during = len(acked)
            time.sleep(1.0)  # the claim is about what does not happen while the disk stays full
            assert len(acked) == during and t.is_alive() and not failed, failed  # the append waits, not fails
            filler.unlink()  # room: the server writes its AOF buffer out and takes writes again
            until(lambda: len(acked) >= during + 20 or bool(failed), "appends after the room came back")
            stop.set()
            t.join(WAIT_S)
        assert not failed, failed
        waits = [e for e in logs if e["event"] == "redis unavailable, retrying"]
        assert len(waits) == 1 and "MISCONF" in str(waits[0]["error"]), waits  # one line, naming the cause
        assert [e for e in logs if e["event"] == "redis available again"]
        client.close()

        server.kill()  # SIGKILL: only what reached the AOF comes back
        server.start()
        after = EventLog(redis.Redis.from_url(server.url), "df")
        stored = {s.event.event_id: s.stream_id for s in after.read()}
        assert len(stored) == len(acked) == len(set(acked))
        assert all(stored.get(eid) == sid for eid, sid in acked), "an acknowledged append was lost"

        # past the deadline, a refused write is one line saying what Redis refused and where
        filler = fill(fs)
        quick = connect(server.url, retry_deadline=1.0)
        quick_log = EventLog(quick, "df")
        with pytest.raises(RedisRefusesWrites) as refused:
            for i in range(1000, 3000):  # the first appends fill the AOF's last page; then it is refused
                quick_log.append(_event(i))
        line = refusal_line(refused.value, server.url)
        assert line is not None and "\n" not in line and "refused writes" in line and "MISCONF" in line, line
        quick.close()
        filler.unlink()
    finally:
        server.kill()


# ---------------------------------------------------------------------- the archive's disk full


def test_an_archive_segment_on_a_full_disk_trims_nothing_and_is_written_by_a_later_pass(
    small_fs: Callable[[int], Path], redis_client: redis.Redis, run_id: str
) -> None:
    from test_archive import build_log, write_log

    from rolledger.events.archive import read_manifest
    from rolledger.events.archiver import Archiver
    from rolledger.events.keys import log_key

    fs = small_fs(1 << 20)
    ids = write_log(redis_client, run_id, build_log())
    archiver = Archiver(redis_client, run_id, fs / "archive", keep_live=5, archive_every=10)
    archiver.directory.mkdir()
    filler = fill(fs)
    with pytest.raises(DiskFull) as got:
        archiver.run_once()
    assert "archive segment: no room to write" in str(got.value) and str(fs) in str(got.value)
    assert redis_client.xlen(log_key(run_id)) == len(ids)  # nothing trimmed
    assert read_manifest(redis_client, run_id).segments == ()  # nothing recorded
    assert list(archiver.directory.iterdir()) == []  # nothing half-written left
    filler.unlink()
    done = archiver.run_once()
    assert done.segments and done.trimmed == sum(s.count for s in done.segments)
    assert done.segments[0].first_id == ids[0]


def test_a_summary_on_a_full_disk_is_one_line_and_leaves_no_partial_file(
    small_fs: Callable[[int], Path], redis_url: str, run_id: str
) -> None:
    from rolledger.workflows.state import RunState
    from rolledger.workflows.summary import summarize

    runs = small_fs(1 << 20)
    run = LocalRun(RunOptions(config=small(), redis_url=redis_url, run_id=run_id, runs_dir=runs))
    filler = fill(runs)
    with capture_logs() as logs:
        run._write_summary(summarize(RunState(), [], []))
    assert run.summary_error is not None and str(run.run_dir / "summary.json") in run.summary_error
    lines = [str(e["event"]) for e in logs if e["log_level"] == "error"]
    assert len(lines) == 1 and "\n" not in lines[0] and f"--resume {run_id}" in lines[0], lines
    assert sorted(p.name for p in run.run_dir.iterdir()) == []  # no partial summary.json, no temporary file
    filler.unlink()
    run._write_summary(summarize(RunState(), [], []))
    assert run.summary_error is None and (run.run_dir / "summary.json").is_file()


def test_the_dist_transport_offers_no_version_its_durable_copy_has_no_room_for(
    small_fs: Callable[[int], Path],
) -> None:
    """Under --transport dist the version would be served from memory at once: with no room for the trainer's copy
    it is not offered (every transfer of it would fail, and its update abort); with room it is."""
    import torch

    from rolledger.workers.weights.transport import DistStagingStore

    fs = small_fs(4 << 20)
    store = DistStagingStore(fs / "trainer", "127.0.0.1", 0, timeout_s=60, fsync=False)
    try:
        weights = {"w": torch.arange(250_000, dtype=torch.float32)}  # 1 MB
        filler = fill(fs)
        with pytest.raises(DiskFull) as got:
            store.stage(1, 0, weights)
        assert "staging v1: no room to write" in str(got.value) and got.value.need > 1_000_000
        assert store.server._held == {} and store.versions() == []  # nothing offered, nothing written
        filler.unlink()
        staged = store.stage(1, 0, weights)
        store.wait_persisted()
        assert store.versions() == [1] and staged.uri.startswith("dist://")
    finally:
        store.close()


def test_optimizer_state_on_a_full_disk_is_a_disk_full_naming_the_file(small_fs: Callable[[int], Path]) -> None:
    """torch.save reports a full disk without an errno; save_optimizer still says DiskFull and leaves no file."""
    import torch

    from rolledger.workers.roles.trainer import save_optimizer

    fs = small_fs(1 << 20)
    model = torch.nn.Linear(300, 300)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 300)).sum().backward()
    optimizer.step()  # moments of 90k parameters: 0.7 MB
    filler = fill(fs)
    with pytest.raises(DiskFull) as got:
        save_optimizer(fs / "trainer-state", 3, optimizer)
    assert "optimizer state of v3: no room to write" in str(got.value) and str(fs) in str(got.value)
    assert list((fs / "trainer-state").iterdir()) == []
    filler.unlink()
    assert save_optimizer(fs / "trainer-state", 3, optimizer).is_file()
