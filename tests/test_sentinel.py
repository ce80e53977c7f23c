"""redis+sentinel:// URLs (events/connection.py) against a real primary, replica and three sentinels
(tests/redis_sentinel.py): parsing, appends that go on across a coordinated SENTINEL FAILOVER, and a real run failed
over mid-run: coordinated (it finishes, its audit is clean) and uncoordinated (the promoted replica lacks entries the
primary acknowledged: the audit names them from the writers' append marks, VIOLATED, exit 1)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest
import redis
from redis_sentinel import MASTER_NAME, SentinelProcesses

from rolledger.events.connection import connect, parse_redis_url, sentinel_target
from rolledger.events.keys import log_key
from rolledger.events.scan import scan_log
from rolledger.schemas import events as ev
from rolledger.workflows.audit import audit
from rolledger.workflows.audit_report import LOG_INTEGRITY


def test_sentinel_url_parses() -> None:
    scheme, options, nodes = parse_redis_url("redis+sentinel://:pw@127.0.0.1:26379,[::1]:26380/mymaster/2")
    assert scheme == "redis+sentinel"
    assert nodes == [("127.0.0.1", 26379), ("::1", 26380)]
    assert options["service_name"] == "mymaster" and options["db"] == 2 and options["password"] == "pw"


@pytest.mark.parametrize(
    "url", ["redis+sentinel://127.0.0.1:26379", "redis+sentinel://127.0.0.1:26379/m/x", "redis+sentinel://h/m"]
)
def test_bad_sentinel_url_is_one_line_without_the_password(url: str) -> None:
    with pytest.raises(ValueError, match="redis\\+sentinel://|is not host:port") as info:
        sentinel_target(url.replace("://", "://:secret@"))
    assert "secret" not in str(info.value)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelProcesses]:
    kit = SentinelProcesses(tmp_path).start()
    try:
        yield kit
    finally:
        kit.stop()
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_appends_go_on_across_a_coordinated_failover(sentinels: SentinelProcesses) -> None:
    client = connect(sentinels.url, retry_deadline=30)
    for i in range(50):
        client.xadd("s", {"i": i})
    old = sentinels.primary()
    assert client.execute_command("WAIT", 1, 5000) == 1  # replicated before the switch
    new = sentinels.failover()
    assert new != old
    for i in range(50, 100):
        client.xadd("s", {"i": i})  # the same client: the demoted primary's READONLY sends it to the new one
    assert sentinels.node(new).xlen("s") == 100
    assert [int(f[b"i"]) for _, f in cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange("s"))] == list(
        range(100)
    )
    assert MASTER_NAME in sentinels.url


def test_a_write_acknowledged_by_a_primary_being_replaced_is_lost_and_wait_says_so(
    sentinels: SentinelProcesses,
) -> None:
    """What an uncoordinated switch loses: a write the old primary acknowledged after its replica stopped following
    it. WAIT 1 answers 0 for that write (no replica has it), which is what a min_replicas append would refuse."""
    old = sentinels.primary()
    direct = sentinels.node(old)
    direct.xadd("s", {"i": 0})
    assert direct.execute_command("WAIT", 1, 5000) == 1
    new = sentinels.failover(until_demoted=False)
    if sentinels.role(old) == "slave":
        pytest.skip("the sentinels demoted the old primary before the test could write to it")
    direct.xadd("s", {"i": 1})  # acknowledged by the old primary, which no replica follows now
    assert direct.execute_command("WAIT", 1, 200) == 0
    sentinels.failover_settled(old)
    assert [int(f[b"i"]) for _, f in cast(list[tuple[bytes, dict[bytes, bytes]]], sentinels.node(new).xrange("s"))] == [
        0
    ]  # the acknowledged write is gone


# ---------------------------------------------------------------- a real run, failed over mid-run (issue 41)
def _primary_client(kit: SentinelProcesses) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=kit.primary(), socket_timeout=5)


def _entries(client: redis.Redis, run_id: str) -> int:
    return int(client.xlen(log_key(run_id)))


def _stepped(kit: SentinelProcesses, run_id: str) -> bool:
    try:
        client = _primary_client(kit)
        try:
            return any(isinstance(s.event.payload, ev.TrainStepFinished) for s in scan_log(client, run_id).entries)
        finally:
            client.close()
    except redis.RedisError:
        return False


def _run_with(
    kit: SentinelProcesses, run_id: str, tmp_path: Path, switch: Callable[[], object], *, deadline_s: float = 90
) -> tuple[str, float]:
    """A real run (torch engine, two ranks, in one process) against the sentinel URL; `switch` runs on a thread once
    the trainer has finished a step. The run's ending (its summary's status, or the exception that ended it) and
    the seconds it took."""
    from test_run_loop import small

    from rolledger.workers.operator.local_run import LocalRun, RunOptions

    switched = threading.Event()
    failed: list[BaseException] = []

    def watch() -> None:
        try:
            deadline = time.monotonic() + 120
            while not _stepped(kit, run_id):
                assert time.monotonic() < deadline, "no trainer step in 120 s"
                time.sleep(0.1)  # polling the log for a condition, with a deadline
            switch()
            switched.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test, not lost on the thread
            failed.append(exc)

    watcher = threading.Thread(target=watch, name="switch", daemon=True)
    t0 = time.monotonic()
    watcher.start()
    run = LocalRun(
        RunOptions(config=small(steps=3), redis_url=kit.url, run_id=run_id, runs_dir=tmp_path, deadline_s=deadline_s)
    )
    try:
        ending = str(run.execute().status)
    except Exception as exc:  # noqa: BLE001 - an uncoordinated switch may end the run any way: the audit judges it
        ending = f"{type(exc).__name__}: {exc}"
    watcher.join(timeout=60)
    assert not failed, failed
    assert switched.is_set(), f"the run ended ({ending}) before the switch"
    return ending, time.monotonic() - t0


def _audit_cli(kit: SentinelProcesses, run_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rolledger.workers.operator.cli", "audit", run_id, "--redis", kit.url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def proxied_sentinels(tmp_path: Path) -> Iterator[SentinelProcesses]:
    kit = SentinelProcesses(tmp_path / "redis").start(replication_proxy=True)
    try:
        yield kit
    finally:
        kit.stop()


@pytest.mark.slow
def test_a_run_failed_over_coordinated_mid_run_finishes_and_audits_clean(
    proxied_sentinels: SentinelProcesses, run_id: str, tmp_path: Path
) -> None:
    """Once the trainer has finished a step: writes paused, the replica caught up, SENTINEL FAILOVER, the old primary
    demoted and its clients disconnected (SentinelProcesses.coordinated_failover). Every process of the run goes on
    against the new primary, the run completes, and its audit (every append mark checked) is clean."""
    kit = proxied_sentinels
    old = kit.primary()
    ending, took = _run_with(kit, run_id, tmp_path, kit.coordinated_failover)
    assert ending == "completed", ending
    assert kit.primary() != old
    done = _audit_cli(kit, run_id)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ", OK" in done.stdout.splitlines()[0]
    client = _primary_client(kit)
    events = [s.event for s in scan_log(client, run_id).entries]
    client.close()
    report = audit(events)
    assert report.passed and report.checked[LOG_INTEGRITY] > 10  # the marks were checked, and none is missing
    print(f"coordinated failover mid-run: {took:.1f} s, {len(events)} events")


@pytest.mark.slow
def test_an_uncoordinated_failover_mid_run_loses_acknowledged_appends_and_the_audit_names_them(
    proxied_sentinels: SentinelProcesses, run_id: str, tmp_path: Path
) -> None:
    """The replica stops receiving (the primary still acknowledges every append), the primary is SIGKILLed once it
    holds 5 log entries appended since, and the sentinels promote the replica: those entries are gone, and every
    process of the run had been told they were written. The coordinator's next decision finds the log ending before
    what it read (LogLostEntries: it is restarted and folds the log as it now is), the run goes on or ends at its
    deadline, and either way the audit is VIOLATED, naming the missing appends, and `rolledger audit` exits 1."""
    kit = proxied_sentinels
    counts: dict[str, int] = {}

    def lose() -> None:
        primary = _primary_client(kit)
        kit.lag_replica()
        cut_at = _entries(primary, run_id)  # every entry after these is appended after the cut: no replica has it
        deadline = time.monotonic() + 60
        while _entries(primary, run_id) < cut_at + 5:
            assert time.monotonic() < deadline, "the run appended nothing for 60 s"
            time.sleep(0.05)  # polling the primary's log length, with a deadline
        counts["acknowledged"] = _entries(primary, run_id)  # a lower bound: the run goes on appending until the kill
        primary.close()
        new = kit.wait_promoted(kit.kill_primary())
        counts["kept"] = _entries(kit.node(new), run_id)

    ending, took = _run_with(kit, run_id, tmp_path, lose, deadline_s=40)  # a run that wedges ends at 40 s
    assert counts["kept"] < counts["acknowledged"], counts  # the promoted replica lacks acknowledged entries
    done = _audit_cli(kit, run_id)
    assert done.returncode == 1, done.stdout + done.stderr
    headline = done.stdout.splitlines()[0]
    assert headline.endswith("VIOLATED"), done.stdout
    client = _primary_client(kit)
    events = [s.event for s in scan_log(client, run_id).entries]
    client.close()
    gaps = [v for v in audit(events).for_invariant(LOG_INTEGRITY) if "the log lost acknowledged events" in v.message]
    assert gaps and all(v.message in done.stdout for v in gaps), done.stdout
    lost = counts["acknowledged"] - counts["kept"]
    print(f"uncoordinated failover mid-run: {took:.1f} s, ended {ending!r}, >= {lost} acknowledged entries lost:")
    for v in gaps:
        print("  " + v.message)
