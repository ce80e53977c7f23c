"""The worker faults of workers/operator/faults.py on the real loop: a trainer, reward worker or coordinator killed by its
wrapper is replaced by its respawn, and the run ends as it would have without the fault (every step trained, every
update decided, a clean audit); the one update that may abort is the one a killed coordinator left undecided."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_run_loop import execute, small

from rolledger.schemas import events as ev
from rolledger.workflows.audit import audit

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("spec", ["kill-worker=trainer@2", "kill-worker=reward@3", "kill-worker=coordinator@5"])
def test_a_killed_worker_is_replaced_and_the_run_ends_as_without_the_fault(
    redis_url: str, run_id: str, tmp_path: Path, spec: str
) -> None:
    events, summary = execute(redis_url, run_id, tmp_path, small(), spec)
    kind = spec.split("=")[1].split("@")[0]
    # it died, and its respawn carried on (the first incarnation may die before it appended anything: a reward worker
    # scores a whole read before appending)
    assert f"{kind}#2" in {e.producer for e in events}
    assert summary.status == "completed" and summary.steps == 3
    aborts = [e.payload for e in events if isinstance(e.payload, ev.UpdateAborted)]
    if kind == "coordinator":
        # a coordinator killed inside a transaction leaves it undecided: its successor (a larger fence) aborts that
        # one, never commits it, and the next version commits; killed between transactions, nothing aborts
        assert all("lost before deciding" in a.reason for a in aborts), [a.reason for a in aborts]
        assert len(aborts) <= 1
    else:
        assert aborts == []
    assert summary.updates_committed + summary.updates_aborted == 3
    assert audit(events).ok
