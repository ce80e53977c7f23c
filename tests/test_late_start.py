"""A process started after its run finished (a supervisor's late restart) exits 0 at once with one line, before it
loads a model or imports torch: the chaos suite saw a trainer restarted just after the end spend its start-up
loading weights for a run that was over, and outlive the run's exit deadline."""

from __future__ import annotations

import subprocess
import sys

import pytest
import redis

from rolledger.events.envelope import make_event
from rolledger.events.store import EventLog
from rolledger.schemas.events import RunFinished

PROBE = (
    "import sys; from rolledger.workers.cli import main; rc = main(sys.argv[1:]); "
    "print('torch imported' if 'torch' in sys.modules else 'torch not imported'); sys.exit(rc)"
)


@pytest.mark.parametrize(
    "argv",
    [["worker", "trainer"], ["worker", "rank", "--rank", "1"], ["worker", "reward"], ["coordinator"]],
    ids=["trainer", "rank", "reward", "coordinator"],
)
def test_a_process_started_after_the_end_exits_at_once(
    redis_client: redis.Redis, redis_url: str, run_id: str, argv: list[str]
) -> None:
    log = EventLog(redis_client, run_id)
    end_id = log.append(
        make_event(RunFinished(status="completed", steps=1), run_id=run_id, producer="test", policy_version=0)
    )
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv, "--redis", redis_url, "--run", run_id],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch not imported"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert f"run {run_id} already finished (RunFinished at {end_id}); nothing to do" in lines[0]
    assert log.length() == 1  # it appended nothing
