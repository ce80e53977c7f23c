"""Inputs refused at the door, each with one line on stderr and exit 2 before anything starts: run ids, reused run
ids, configs (bools for numbers, inf/nan, missing, unparsable, YAML), a busy metrics port; secrets never written or
echoed; snapshots kept bounded."""

from __future__ import annotations

import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import RedisProcess
from logbuilder import LogBuilder

from rolledger.events.open_run import _live_url
from rolledger.events.redact import redact, with_password
from rolledger.events.snapshots import KEEP_LATEST, stored_snapshots, take_snapshot
from rolledger.events.store import EventLog
from rolledger.schemas.config import ConfigError, RunConfig
from rolledger.workers.operator.cli import main
from rolledger.workers.operator.local_run import LocalRun, RunOptions, RunRefused
from rolledger.workers.runtime.netguard import EngineAddressError, check_engine_address
from rolledger.workflows.reducer import replay
from rolledger.workflows.replay import check_replay


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ---------------------------------------------------------------- run ids
@pytest.mark.parametrize("bad", ["..", "../x", "/abs", "a/b", "x{y}", "", "-lead", "a b", "x" * 129, "a\\b"])
def test_bad_run_ids_are_refused_before_anything_starts(
    bad: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    assert main(["run", "--runs-dir", str(runs), f"--run-id={bad}"]) == 2
    assert "run id" in one_error_line(capsys)
    assert not runs.exists() and not (tmp_path / "x").exists()


def test_a_reused_run_id_is_refused_without_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text("{}")
    assert main(["run", "--runs-dir", str(tmp_path), "--run-id", "old"]) == 2
    line = one_error_line(capsys)
    assert "already exists" in line and "--resume" in line


def test_a_run_id_with_a_log_is_refused_without_resume(redis_url: str, run_id: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    EventLog(client, run_id).append_many(LogBuilder(run_id=run_id).start_run().build())
    run = LocalRun(RunOptions(config=RunConfig(), redis_url=redis_url, run_id=run_id, runs_dir=tmp_path))
    with pytest.raises(RunRefused, match="already has a log"):
        run.connect()
    resumed = LocalRun(
        RunOptions(config=RunConfig(), redis_url=redis_url, run_id=run_id, runs_dir=tmp_path, resume=True)
    )
    resumed.connect()  # --resume reopens it


# ---------------------------------------------------------------- configs
@pytest.mark.parametrize(
    ("text", "suffix", "needle"),
    [
        ("steps = true\n", ".toml", "steps: Value error, expected a number, got the boolean true"),
        ("[update]\nprepare_deadline_s = inf\n", ".toml", "update.prepare_deadline_s"),
        ("run_deadline_s = nan\n", ".toml", "run_deadline_s"),
        ('{"steps": false}', ".json", "steps"),
        ("steps = = 3\n", ".toml", "not valid TOML"),
        ("steps: [\n", ".yaml", "not valid YAML"),
        ("steps = 3\n", ".ini", "unknown config format"),
    ],
)
def test_bad_configs_are_one_line_naming_the_file_and_field(
    text: str, suffix: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / f"c{suffix}"
    cfg.write_text(text)
    assert main(["run", "--config", str(cfg), "--runs-dir", str(tmp_path / "runs")]) == 2
    line = one_error_line(capsys)
    assert str(cfg) in line and needle in line, line
    assert not (tmp_path / "runs").exists()


def test_a_missing_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--config", str(tmp_path / "nope.toml"), "--runs-dir", str(tmp_path)]) == 2
    assert "nope.toml: cannot read the config file" in one_error_line(capsys)


def test_bools_are_not_numbers_but_are_bools() -> None:
    with pytest.raises(ValueError, match="boolean"):
        RunConfig.model_validate({"trainer": {"groups_per_step": True}})
    assert RunConfig.model_validate({"interruptible": True}).interruptible is True
    with pytest.raises(ConfigError):
        RunConfig.load(Path("/nonexistent/c.json"))


# ---------------------------------------------------------------- a busy metrics port
@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_a_busy_metrics_port_is_refused_before_any_worker_starts(
    busy_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    assert main(["run", "--metrics-port", str(busy_port), "--runs-dir", str(runs), "--run-id", "m"]) == 2
    assert f"--metrics-port {busy_port}" in one_error_line(capsys)
    assert not runs.exists()  # nothing was created, no Redis started


# ---------------------------------------------------------------- secrets
@pytest.fixture(scope="module")
def password_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of its own that requires the password hunter2."""
    server = RedisProcess(tmp_path_factory.mktemp("redis-auth"))
    server.start()
    client = redis.Redis.from_url(server.url)
    client.config_set("requirepass", "hunter2")
    client.close()
    yield server.url.replace("redis://", "redis://:hunter2@")
    server.stop()


def test_redis_url_file_holds_no_password_and_is_private(
    password_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = LocalRun(RunOptions(config=RunConfig(), redis_url=password_url, run_id=run_id, runs_dir=tmp_path))
    run.connect()
    f = tmp_path / run_id / "redis_url"
    text = f.read_text()
    assert "hunter2" not in text and ":***@" in text
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    assert _live_url(tmp_path / run_id) is None  # a redacted URL is not used without REDIS_PASSWORD
    monkeypatch.setenv("REDIS_PASSWORD", "hunter2")
    assert _live_url(tmp_path / run_id) == password_url  # the password comes from the environment at use


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:pa:ss@host:6379/0", "redis://user:***@host:6379/0"),
        ("rediss://:tok@h", "rediss://:***@h"),
        ("unix:///tmp/r.sock?password=pw&db=1", "unix:///tmp/r.sock?password=***&db=1"),
        ("redis://host:6379", "redis://host:6379"),
    ],
)
def test_redact_hides_every_password(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert with_password(shown, "pw") == url or "pw" not in url


def test_a_missing_run_on_a_password_redis_never_echoes_the_password(
    password_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", "no-such-run", "--redis", password_url]) == 2
    line = one_error_line(capsys)
    assert "no such run" in line and "hunter2" not in line and ":***@" in line, line


# ---------------------------------------------------------------- snapshots stay bounded
def test_only_the_first_and_the_latest_snapshots_are_kept(redis_client: redis.Redis, run_id: str) -> None:
    b = LogBuilder(run_id=run_id).start_run()
    for _ in range(12):
        b.group(rank=0)
    events = b.build()
    log = EventLog(redis_client, run_id)
    ids = [log.append(e) for e in events]  # an entry each: a snapshot may sit after any of them
    every = len(events) // 20 or 1
    taken = []
    for i in range(every - 1, len(events), every):
        taken.append(take_snapshot(redis_client, run_id, replay(events[: i + 1]), ids[i]))
    assert len(taken) > KEEP_LATEST + 5
    kept = stored_snapshots(redis_client, run_id)
    assert kept == [taken[0], *taken[-KEEP_LATEST:]]
    report = check_replay(log.read(), kept)
    assert report.ok and len(report.snapshot_checks) == KEEP_LATEST + 1


@pytest.mark.parametrize(
    "url", ["ftp://u:hunter2@127.0.0.1:80", "http://u:hunter2@", "http://u:hunter2@127.0.0.1:99999"]
)
def test_netguard_errors_never_echo_the_password(url: str) -> None:
    with pytest.raises(EngineAddressError) as err:
        check_engine_address(url, allow_remote=False)
    assert "hunter2" not in str(err.value) and "***" in str(err.value), err.value
