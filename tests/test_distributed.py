"""The distributed processes of DESIGN's command line: a driver (`rolledger run --external-workers`), the coordinator
and every worker as its own OS process, talking only through a real redis-server. The run learns nothing new here;
what is checked is that the same loop runs across processes and its log audits clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from audit_check import audited_clean

from rolledger.events.store import EventLog
from rolledger.schemas import events as ev

pytestmark = pytest.mark.slow

CONFIG = """
steps = 3
group_size = 4
ranks = 2
[trainer]
warm_start_steps = 20
groups_per_step = 2
[task]
num_prompts = 64
"""


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "rolledger.workers.operator.cli", "--json-logs", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )


@pytest.mark.parametrize("transport", ["directory", "dist"])
def test_a_run_across_processes_completes_and_audits_clean(
    redis_url: str, run_id: str, tmp_path: Path, transport: str
) -> None:
    """With the dist transport the trainer process serves the weights over torch.distributed, and it is SIGKILLed once
    after the first version is published and started again: the new process serves on the port RunStarted recorded,
    from its own directory, and the run goes on."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG + f'[update]\ntransport = "{transport}"\n')
    client = redis.Redis.from_url(redis_url)
    log = EventLog(client, run_id)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["driver"] = _spawn(
            [
                "run",
                "--redis",
                redis_url,
                "--run-id",
                run_id,
                "--config",
                str(cfg),
                "--runs-dir",
                str(tmp_path),
                "--external-workers",
            ],
            tmp_path / "driver.log",
        )
        deadline = time.monotonic() + 120
        while log.length() == 0:  # the driver warms the policy up, then appends RunStarted
            assert procs["driver"].poll() is None, (tmp_path / "driver.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "no RunStarted within 120 s"
            time.sleep(0.1)  # polling the log with a deadline
        common = ["--redis", redis_url, "--run", run_id]
        procs["coordinator"] = _spawn(["coordinator", *common], tmp_path / "coordinator.log")
        for r in (0, 1):
            procs[f"rank{r}"] = _spawn(["worker", "rank", *common, "--rank", str(r)], tmp_path / f"rank{r}.log")
        procs["reward"] = _spawn(["worker", "reward", *common], tmp_path / "reward.log")
        procs["trainer"] = _spawn(["worker", "trainer", *common], tmp_path / "trainer.log")
        if transport == "dist":
            deadline = time.monotonic() + 120
            while not any(isinstance(s.event.payload, ev.PolicyPublished) for s in log.read()):
                assert time.monotonic() < deadline, "no PolicyPublished within 120 s"
                time.sleep(0.1)  # polling the log with a deadline
            procs["trainer"].kill()
            procs["trainer"].wait(timeout=30)
            procs["trainer"] = _spawn(["worker", "trainer", *common], tmp_path / "trainer.log")
        assert procs["driver"].wait(timeout=240) == 0, (tmp_path / "driver.log").read_text()[-3000:]
        for name, p in procs.items():  # every process ends by itself once RunFinished is in the log
            assert p.wait(timeout=60) == 0, f"{name}: " + (tmp_path / f"{name}.log").read_text()[-2000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    events = audited_clean(log.read())
    summary = json.loads((tmp_path / run_id / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["anomalies"] == 0
    producers = {e.producer for e in events}
    assert {"rank-0", "rank-1", "reward", "trainer"} <= producers
    assert any(p.startswith("coordinator@") for p in producers)  # a process identity, host and pid
    ranks = {e.payload.trajectory.rank for e in events if isinstance(e.payload, ev.SampleFinished)}
    assert ranks == {0, 1}
    scheme = "dist://" if transport == "dist" else "file://"
    assert all(e.payload.uri.startswith(scheme) for e in events if isinstance(e.payload, ev.UpdateStaged))
    client.close()
