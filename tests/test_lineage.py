"""lineage(): the provenance chain of a trajectory over a small full log with an aborted update, then a committed
retry of the same version with a new manifest - the chain must name the committed attempt, not the aborted one."""

from __future__ import annotations

import json

import pytest
from logbuilder import LogBuilder, payload_of

from rolledger.schemas.events import Event, UpdateStaged
from rolledger.workflows.audit import audit
from rolledger.workflows.lineage import lineage


def build() -> tuple[LogBuilder, list[Event]]:
    b = LogBuilder(ranks=2).start_run()
    b.group(rank=0)  # g000001 at v0
    g1 = b.last_group
    b.consume([g1])
    b.update(1, fail_rank=1)  # v1: rank 1 fails to prepare, aborted, both ranks stay on v0
    b.update(2)  # v2: committed and published
    b.group(rank=1)  # g000002 at v2 on rank 1
    g2 = b.last_group
    b.consume([g2])
    b.admit()  # g000003: started, never finished
    g3 = b.last_group
    b.start(f"{g3}/0")
    return b, b.build()


def test_the_log_itself_is_valid() -> None:
    _, events = build()
    report = audit(events)
    assert report.ok, report.render()


def test_lineage_names_every_link_of_the_chain() -> None:
    b, events = build()
    lin = lineage(events, "g000002/1")
    assert lin.run_id == "run-test"
    assert lin.sample.started_event_id == b.find("SampleStarted", sample_id="g000002/1").event_id
    assert lin.sample.finished_event_id == b.find("SampleFinished", trajectory_id="g000002/1").event_id
    assert lin.group.admitted_event_id == b.find("GroupAdmitted", group_id="g000002").event_id
    assert lin.group.outcome == "complete" and lin.group.accepted
    assert lin.sampling == b.config.sampling.model_dump(mode="json") and lin.sampling_matches_group
    assert lin.versions == (2,)

    (pol,) = lin.policies
    stage = b.find("UpdateStaged", version=2)
    assert pol.source == "update" and pol.version == 2
    assert pol.manifest_digest == "m0002" and pol.weights_digest == "w0002"
    assert pol.staged_event_id == stage.event_id and pol.uri == payload_of(stage, UpdateStaged).uri
    assert [p.event_id for p in pol.prepared] == [e.event_id for e in b.find_all("RankPrepared", version=2)]
    assert [p.rank for p in pol.prepared] == [0, 1]
    assert pol.committed_event_id == b.find("UpdateCommitted").event_id and pol.committed_ranks == (0, 1)
    assert pol.published_event_id == b.find("PolicyPublished").event_id
    (aborted,) = pol.aborted_attempts  # the v1 that never made it
    assert aborted.version == 1 and aborted.event_id == b.find("UpdateAborted").event_id
    assert aborted.failed_ranks == (1,) and aborted.manifest_digest == "m0001"

    assert lin.rank.rank == 1 and lin.rank.weights_digest == "w0002"
    assert lin.rank.rank_weights_event_id == b.find("RankCommitted", rank=1).event_id
    assert lin.rank.cache_generation == 1
    assert lin.rank.cache_event_id == b.find("CacheInvalidated", rank=1).event_id
    assert lin.rank.health_event_id == b.find("HealthPassed", rank=1).event_id
    assert lin.reward is not None and lin.reward.event_id == b.find("SampleScored", sample_id="g000002/1").event_id
    batch = b.find("BatchConsumed", step=2)
    assert lin.consumed is not None and lin.consumed.event_id == batch.event_id
    assert lin.consumed.step == 2 and lin.consumed.lag == 0
    assert lin.consumed.train_step_event_id == b.find("TrainStepFinished", step=2).event_id
    assert lin.dropped is None

    data = json.loads(lin.to_json())
    assert data["policies"][0]["manifest_digest"] == "m0002"
    text = lin.render()
    for needle in (
        "trajectory g000002/1",
        "manifest m0002",
        "update to v1 aborted",
        "rank 1 prepared",
        "cache generation 1",
        "consumed by trainer at trainer step 2 with lag 0",
    ):
        assert needle in text, text


def test_a_retried_version_names_the_committed_attempt_not_the_aborted_one() -> None:
    """Robustness: if a version is staged again after an abort, the chain follows the manifest that committed."""
    b = LogBuilder(ranks=2).start_run()
    b.update(1, fail_rank=1)
    b.update(1, manifest="m0001-retry", weights="w0001-retry")
    b.group(rank=0)
    lin = lineage(b.build(), "g000001/0")
    (pol,) = lin.policies
    assert pol.manifest_digest == "m0001-retry" and pol.weights_digest == "w0001-retry"
    retry = b.find_all("RankPrepared", manifest_digest="m0001-retry")
    assert [p.event_id for p in pol.prepared] == [e.event_id for e in retry]  # not the aborted attempt's prepare
    assert [a.manifest_digest for a in pol.aborted_attempts] == ["m0001"]
    assert audit(b.build()).ok


def test_version_zero_is_the_initial_weights() -> None:
    b, events = build()
    lin = lineage(events, "g000001/0")
    (pol,) = lin.policies
    assert pol.source == "initial" and pol.weights_digest == "w0000"
    assert pol.run_started_event_id == b.find("RunStarted").event_id
    assert lin.rank.rank_weights_event_id == b.find("RankJoined", rank=0).event_id
    assert lin.rank.cache_event_id is None  # no invalidation before it was generated
    assert lin.consumed is not None and lin.consumed.step == 1
    assert "initial weights w0000" in lin.render()


def test_unknown_and_unfinished_trajectories_raise_a_clear_key_error() -> None:
    _, events = build()
    with pytest.raises(KeyError, match="no such sample"):
        lineage(events, "g999999/0")
    with pytest.raises(KeyError, match="never finished"):
        lineage(events, "g000003/0")


def test_duplicated_events_do_not_change_the_chain() -> None:
    _, events = build()
    assert lineage(events + events[:20], "g000002/1") == lineage(events, "g000002/1")
