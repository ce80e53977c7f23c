"""What a queued sample holds is its trajectory's encoded size, and never more than admission reserved for it: a real
rank (the torch engine) declares each finished sample's size, and fails a sample that encodes larger than its
group's reservation rather than let the completed groups outgrow the byte cap (issue 14, item 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_heartbeats import Run, _wait_for

from rolledger.schemas import events as ev
from rolledger.schemas.wire import encoded_size
from rolledger.workflows.admission import sample_reserve
from rolledger.workflows.scheduler import PromptItem

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("reserved", ["by-admission", "too-little"])
def test_a_rank_declares_each_samples_encoded_size_and_fails_one_over_its_reservation(
    redis_url: str, run_id: str, tmp_path: Path, reserved: str
) -> None:
    run = Run(redis_url, run_id, tmp_path, groups=2, reserve=None if reserved == "by-admission" else 200)
    rank = run.rank(0)
    thread = rank.start()
    try:
        _wait_for(run.all_terminal, 60, "every sample to reach a terminal event")
    finally:
        rank.stop()
        thread.join(timeout=30)
    events = run.events()
    finished = [e.payload for e in events if isinstance(e.payload, ev.SampleFinished)]
    failed = [e.payload for e in events if isinstance(e.payload, ev.SampleFailed)]
    admitted = next(e.payload for e in events if isinstance(e.payload, ev.GroupAdmitted))
    assert isinstance(admitted, ev.GroupAdmitted)
    if reserved == "by-admission":
        assert not failed and len(finished) == 2 * run.n
        for p in finished:
            t = p.trajectory
            assert p.nbytes == encoded_size(t) > t.legacy_nbytes  # the formula undercounted what is held
            item = PromptItem(0, t.prompt_id, tuple(t.prompt_token_ids), "46")
            assert p.nbytes <= sample_reserve(t.group_id, item, run.n, t.sampling, False)
    else:
        assert not finished and len(failed) == 2 * run.n
        assert all("reserved per sample at admission" in p.error for p in failed), failed[0].error
    run.client.close()
