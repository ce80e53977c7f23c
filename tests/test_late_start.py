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
from rolledger.schemas.statuses import RunStatus

PROBE = (
    "import sys; from rolledger.workers.operator.cli import main; rc = main(sys.argv[1:]); "
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
        make_event(RunFinished(status=RunStatus.COMPLETED, steps=1), run_id=run_id, producer="test", policy_version=0)
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


def test_a_rank_whose_run_ends_as_it_starts_exits(redis_client: redis.Redis, run_id: str) -> None:
    """The race the chaos suite found (seed 15 of CI on a03c7fd): a rank process starts while the run is live, its
    process's shared tail already holds the run's start, the run ends, and the rank's RankJoined is refused. A rank
    that caught up only through its own appends (none yet) then never read the log again and spun after the end."""
    import threading

    from logbuilder import LogBuilder

    from rolledger.schemas.config import RunConfig
    from rolledger.workers.engines.torch_engine import TorchEngine
    from rolledger.workers.policy.policy_model import build_model, build_tokenizer
    from rolledger.workers.roles.rank import RankWorker
    from rolledger.workers.runtime.runtime import Follower

    log = EventLog(redis_client, run_id)
    started = LogBuilder(run_id=run_id).start_run(join_ranks=False).build()
    for e in started:
        log.append(e)
    other = Follower(log)  # another role of this process (kept alive: the tail is shared while a follower lives)
    other.catch_up()  # this process's tail now holds the run's start
    log.append(
        make_event(RunFinished(status=RunStatus.COMPLETED, steps=1), run_id=run_id, producer="test", policy_version=0)
    )
    tok = build_tokenizer()
    worker = RankWorker(redis_client, run_id, 0, TorchEngine(build_model(RunConfig().model, len(tok), 0), tok, rank=0))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    thread.join(60)
    alive = thread.is_alive()
    worker.stop()
    assert not alive, "the rank did not see the run's end"
    assert log.length() == len(started) + 1  # its RankJoined was refused: nothing appended after the end
