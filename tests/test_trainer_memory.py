"""The trainer holds in memory only what it may still train on (issue 14): a sample a first-k group did not accept, a
cancelled group's samples, dropped trajectories and a sample whose reward failed leave `TrainerClient.trajectories`
as the log says so, and a late sample of a closed group never enters it. A real redis-server, the real client."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from logbuilder import LogBuilder

from rolledger.events.store import EventLog
from rolledger.schemas.config import PartialPolicy, RunConfig
from rolledger.schemas.events import SampleFailed
from rolledger.workers.roles.trainer_api import UpdateFailed
from rolledger.workers.roles.trainer_client import TrainerClient
from rolledger.workers.weights.staging_store import DirectoryStagingStore
from rolledger.workflows.state import UPDATES_KEPT


def test_the_trainer_lets_go_of_every_trajectory_it_can_no_longer_train(
    redis_client: redis.Redis, run_id: str, tmp_path: Path
) -> None:
    cfg = RunConfig(group_size=4, partial_policy=PartialPolicy(kind="first_k", k=2))
    b = LogBuilder(cfg, run_id=run_id).start_run()
    log = EventLog(redis_client, run_id)
    client = TrainerClient(redis_client, run_id, "trainer", DirectoryStagingStore(tmp_path))

    def follow() -> set[str]:
        log.append_many(b.build()[len(appended) :])
        appended.extend(b.build()[len(appended) :])
        client.follow()
        return set(client.trajectories)

    appended: list[object] = []
    # first k = 2 of 4: two finish and are accepted, a third finishes after the group completed, one is cancelled
    b.admit()
    first = b.last_group
    for i in range(4):
        b.start(f"{first}/{i}")
    b.finish(f"{first}/0").finish(f"{first}/1")
    assert follow() == {f"{first}/0", f"{first}/1"}  # open: both may be accepted
    b.complete(first, (f"{first}/0", f"{first}/1"))
    b.finish(f"{first}/2").cancel(f"{first}/3", reason="first_k")
    assert follow() == {f"{first}/0", f"{first}/1"}  # the late third never enters

    # a group whose samples finished and that is then cancelled
    b.admit()
    cancelled = b.last_group
    for i in range(4):
        b.start(f"{cancelled}/{i}")
    b.finish(f"{cancelled}/0").finish(f"{cancelled}/1")
    assert {f"{cancelled}/0", f"{cancelled}/1"} <= follow()
    b.cancel_group(cancelled)
    assert follow() == {f"{first}/0", f"{first}/1"}

    # a completed group dropped for lag, and a sample whose reward failed
    b.admit()
    dropped = b.last_group
    for i in range(4):
        b.start(f"{dropped}/{i}")
    b.finish(f"{dropped}/0").finish(f"{dropped}/1").complete(dropped, (f"{dropped}/0", f"{dropped}/1"))
    assert {f"{dropped}/0", f"{dropped}/1"} <= follow()
    b.drop(dropped)
    b.emit(SampleFailed(sample_id=f"{first}/1", group_id=first, index=1, rank=-1, error="boom", stage="reward"))
    assert follow() == {f"{first}/0"}


def test_waiting_for_a_version_whose_record_retired_still_learns_its_outcome(
    redis_client: redis.Redis, run_id: str, tmp_path: Path
) -> None:
    """Issue 12: a closed update's record leaves the state once no decider reads it; a trainer asking about that
    version late gets its outcome from the tombstone instead of waiting out its deadline."""
    b = LogBuilder(RunConfig(ranks=2), run_id=run_id).start_run()
    b.update(1, fail_rank=1)
    for v in range(2, 2 + UPDATES_KEPT + 1):
        b.update(v)
    EventLog(redis_client, run_id).append_many(b.build())
    client = TrainerClient(redis_client, run_id, "trainer", DirectoryStagingStore(tmp_path))
    client.follow()
    assert {1, 2} <= client.follower.state.retired_updates.keys()
    assert client.wait_published(2, timeout_s=0.5) == 2
    with pytest.raises(UpdateFailed, match="v1 aborted"):
        client.wait_published(1, timeout_s=0.5)
