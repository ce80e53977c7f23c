"""The issue's hang, on the real loop: two aborted updates in a row with the default lag cap (max_lag = 1). Before,
the lag gate counted against the published version, which aborts never advance: nothing more was admitted, nothing
trained, no update came. Now the run finishes, the rank that failed is quarantined with each abort and rejoins.

One rank, so that the second update cannot go on without it: with two, the other rank could publish v2 alone before
the quarantined one rejoined on v0, and the rejoin (then on v2, read back through prepare) took the second injection
instead of an update (seen once in CI). With one, v2 waits for the rank to rejoin on v0 (from its initial weights,
which no prepare injection touches; v2 used to be aborted at once for 'no rank in service', the third abort in a row
that ended the run), so both injections fail updates, v1 then v2."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_run_loop import execute, of, small

from rolledger.schemas import events as ev
from rolledger.workflows.audit import audit

pytestmark = pytest.mark.slow


def test_two_aborts_in_a_row_do_not_hang_the_run(redis_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = small(
        steps=4,
        group_size=4,
        ranks=1,
        trainer={"warm_start_steps": 10, "groups_per_step": 2},
        update={"prepare_deadline_s": 10, "drain_deadline_s": 10, "commit_deadline_s": 10},
    )
    events, summary = execute(
        redis_url, run_id, tmp_path, cfg, "fail-rank=0@prepare", "fail-rank=0@transfer", deadline_s=150
    )
    assert summary.status == "completed" and summary.steps == 4
    aborts = of(events, ev.UpdateAborted)
    assert [(a.version, a.failed_ranks) for a in aborts] == [(1, (0,)), (2, (0,))]  # in a row
    assert "fail-rank=0@prepare" in aborts[0].reason and "fail-rank=0@transfer" in aborts[1].reason
    quarantined = of(events, ev.RankQuarantined)
    assert [(q.rank, q.version) for q in quarantined] == [(0, 1), (0, 2)]  # one per abort, and it rejoined after each
    assert len(of(events, ev.RankJoined)) == 3  # the start, then a rejoin after each abort
    assert summary.updates_aborted == 2 and summary.updates_committed == 2
    assert audit(events).ok, audit(events).render()
