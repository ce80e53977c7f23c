"""`rolledger run` as a process: SIGTERM stops it cleanly (RunFinished cancelled, workers stopped, summary.json from
the final log, exit 143, its redis-server gone), and SIGKILL leaves no orphaned embedded redis-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from rolledger.events.keys import log_key
from rolledger.events.open_run import open_run
from rolledger.events.scan import scan_log
from rolledger.events.store import entry_types
from rolledger.schemas import events as ev

pytestmark = pytest.mark.slow

CONFIG = """
steps = 200
group_size = 4
[trainer]
warm_start_steps = 2
groups_per_step = 2
[task]
num_prompts = 16
"""


def start_run(tmp_path: Path, run_id: str) -> subprocess.Popen[bytes]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["ROLLEDGER_TEST_THREADS"] = "1"
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rolledger.workers.operator.cli",
            "run",
            "--config",
            str(cfg),
            "--runs-dir",
            str(tmp_path),
        ]
        + ["--run-id", run_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )


def children_named(pid: int, name: str) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            comm = stat.read_text().split("(", 1)[1].rsplit(")", 1)[0]
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and comm.startswith(name):
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(what: str, cond: object, deadline_s: float, proc: subprocess.Popen[bytes]) -> None:
    assert callable(cond)
    end = time.monotonic() + deadline_s
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"run exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]!r}")  # type: ignore[union-attr]
        assert time.monotonic() < end, f"no {what} within {deadline_s}s"
        time.sleep(0.1)  # polling a condition with a deadline


def log_has(run_dir: Path, run_id: str, type_: str) -> bool:
    url_file = run_dir / "redis_url"
    if not url_file.exists():
        return False
    try:
        client = redis.Redis.from_url(url_file.read_text().strip())
        entries: Any = client.xrange(log_key(run_id))
        found = any(type_ in entry_types(fields) for _, fields in entries)
        client.close()
        return found
    except (redis.RedisError, OSError):
        return False


def test_sigkill_of_rolledger_run_takes_its_redis_server_with_it(tmp_path: Path) -> None:
    proc = start_run(tmp_path, "killed")
    try:
        # the run's redis_url is written once its server serves; before that a child named redis-server may be the
        # short-lived `redis-server --version` probe that picks the binary
        url_file = tmp_path / "killed" / "redis_url"
        wait_for(
            "an embedded redis-server",
            lambda: url_file.exists() and children_named(proc.pid, "redis-server"),
            120,
            proc,
        )
        (server,) = children_named(proc.pid, "redis-server")
        proc.kill()
        proc.wait(timeout=30)
        end = time.monotonic() + 15
        while alive(server):
            assert time.monotonic() < end, f"redis-server {server} outlived its SIGKILLed run"
            time.sleep(0.05)  # polling a condition with a deadline
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_cancels_the_run_cleanly_with_a_summary_of_the_final_log(tmp_path: Path) -> None:
    run_id = "termed"
    run_dir = tmp_path / run_id
    proc = start_run(tmp_path, run_id)
    try:
        wait_for("a trained step", lambda: log_has(run_dir, run_id, "TrainStepFinished"), 300, proc)
        (server,) = children_named(proc.pid, "redis-server")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert not alive(server)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "cancelled", summary
    with open_run(str(run_dir)) as (client, rid):
        scan = scan_log(client, rid)
    events = [s.event for s in scan.entries]
    ends = [e.payload for e in events if isinstance(e.payload, ev.RunFinished)]
    assert len(ends) == 1 and ends[0].status == "cancelled" and ends[0].reason == "signal SIGTERM"
    assert summary["events"] == len(events), (summary["events"], len(events))
