"""audit(): for each invariant, a minimal log that breaks it is caught naming the right events, and the same log
without the offence passes; odd logs (shuffled, duplicated, truncated) are reported, never crash the auditor."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder, weights_digest_for

from rolledger.schemas.config import PartialPolicy
from rolledger.schemas.events import EnginePaused, Event, GroupCompleted, RankCommitted, SampleFinished
from rolledger.schemas.statuses import AdmissionReason, DrainMode
from rolledger.schemas.trajectory import VersionSpan
from rolledger.schemas.wire import encoded_size
from rolledger.workflows.audit import audit
from rolledger.workflows.audit_report import AuditReport


def only(report: AuditReport, invariant: int) -> list[tuple[str, ...]]:
    """The event ids of the violations of `invariant`, after asserting nothing else is violated."""
    others = [v for v in report.violations if v.invariant != invariant]
    assert not others, others
    return [v.event_ids for v in report.violations]


def assert_clean(report: AuditReport) -> None:
    assert report.ok, report.render()
    assert not [w for w in report.warnings if w.kind == "internal"], report.render()


def full_log() -> LogBuilder:
    """Two ranks; groups before and after a committed update, an aborted update, consumption, a finished run."""
    b = LogBuilder(ranks=2).start_run()
    b.group(rank=0)
    g1 = b.last_group
    b.group(rank=1)
    g2 = b.last_group
    b.consume([g1, g2])
    b.update()  # v1
    b.group(rank=1)
    g3 = b.last_group
    b.update(fail_rank=1)  # v2 aborted: ranks stay on v1
    b.group(rank=0, n=2, finished=2)
    g4 = b.last_group
    b.consume([g3, g4])
    b.admit()
    b.cancel_group(b.last_group)
    return b.finish_run()


def test_full_valid_log_passes_every_invariant() -> None:
    b = full_log()
    report = audit(b.build(), replay_digests=("d", "d"), snapshot_checks=[("01X", "s", "s")])
    assert_clean(report)
    assert report.warnings == ()
    assert all(report.checked[i] > 0 for i in range(1, 9)), report.checked
    assert report.run_finished and report.run_id == "run-test"
    data = json.loads(report.to_json())
    assert data["ok"] is True and data["violations"] == []
    assert "OK" in report.render()


# ---------------------------------------------------------------- 1: one version per sample
def test_inv1_two_versions_in_a_non_interruptible_sample() -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder().start_run()
        b.admit()
        g = b.last_group
        b.start(f"{g}/0").start(f"{g}/1")
        spans = (
            (
                VersionSpan(start=0, end=1, policy_version=0, weights_digest="w0000"),
                VersionSpan(start=1, end=2, policy_version=1, weights_digest="w0001"),
            )
            if bad
            else ()
        )
        b.finish(f"{g}/0", spans=spans).finish(f"{g}/1").complete(g)
        return b.finish_run()

    bad = log(True)
    ids = only(audit(bad.build()), 1)
    fin = bad.find("SampleFinished", trajectory_id="g000001/0").event_id
    assert ids and all(i == (fin,) for i in ids)
    assert_clean(audit(log(False).build()))


def test_inv1_trajectory_version_differs_from_its_sample_start() -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder().start_run()
        b.admit()
        g = b.last_group
        b.start(f"{g}/0").start(f"{g}/1")
        stamp: dict[str, Any] = {"policy_version": 3, "weights_digest": "w0003"} if bad else {}
        b.finish(f"{g}/0", **stamp)
        return b.finish(f"{g}/1").complete(g).finish_run()

    bad = log(True)
    start = bad.find("SampleStarted", sample_id="g000001/0").event_id
    fin = bad.find("SampleFinished", trajectory_id="g000001/0").event_id
    assert only(audit(bad.build()), 1) == [(start, fin)]
    assert_clean(audit(log(False).build()))


def test_inv1_interruptible_sample_must_stamp_every_span() -> None:
    def log(complete_spans: bool) -> LogBuilder:
        b = LogBuilder(interruptible=True).start_run()
        b.admit()
        g = b.last_group
        b.start(f"{g}/0").start(f"{g}/1")
        b.update()  # v1 lands while the samples are in flight (they started before the pause)
        spans = (
            VersionSpan(start=0, end=1, policy_version=0, weights_digest="w0000"),
            VersionSpan(start=1, end=2 if complete_spans else 1, policy_version=1, weights_digest="w0001"),
        )
        b.finish(f"{g}/0", spans=spans).finish(f"{g}/1").complete(g).consume([g])
        return b.finish_run()

    bad = log(False)
    fin = bad.find("SampleFinished", trajectory_id="g000001/0").event_id
    report = audit(bad.build())
    assert only(report, 1) == [(fin,)]
    assert "cover 1 of 2" in report.violations[0].message
    assert_clean(audit(log(True).build()))


# ---------------------------------------------------------------- 2: no admission/generation during an update
def _update_with(b: LogBuilder, during: str | None, *, abort: bool = False) -> None:
    """Update to v1 step by step; `during` = "admit" or "start" puts that event between the pause and the
    publication (or abort)."""
    b.stage(1).request_prepare(1).prepare(1, 0).pause(AdmissionReason.UPDATE)
    g = b.last_group
    if during == "drain":  # the rank had not stopped yet: the group it is running may start (and drain)
        b.start(f"{g}/1")
    b.emit(EnginePaused(rank=0, mode=DrainMode.WAIT))
    if during == "admit":
        b.admit("g-late")
    elif during == "start":
        b.start(f"{g}/1")
    if abort:
        b.abort(1)
    else:
        b.commit(1).commit_rank(1, 0).publish(1)
    b.resume(AdmissionReason.UPDATE)


@pytest.mark.parametrize("during", ["admit", "start"])
def test_inv2_no_admission_or_generation_between_pause_and_publish(during: str) -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder().start_run()
        b.admit()
        g = b.last_group
        b.start(f"{g}/0")
        if during == "admit":
            b.start(f"{g}/1")
        _update_with(b, during if bad else None)
        if not bad and during == "admit":
            b.admit("g-late")
        if not bad and during == "start":
            b.start(f"{g}/1")
        b.finish(f"{g}/0").finish(f"{g}/1").complete(g)
        if during == "admit":
            b.cancel_group("g-late")
        return b.finish_run()

    bad = log(True)
    pause = bad.find("AdmissionPaused" if during == "admit" else "EnginePaused").event_id
    offender = (
        bad.find("GroupAdmitted", group_id="g-late")
        if during == "admit"
        else bad.find("SampleStarted", sample_id="g000001/1")
    ).event_id
    report = audit(bad.build())
    # a sample started in the window on v0 is also on a rank that is still v0: only invariant 2 fires
    assert only(report, 2) == [(pause, offender)]
    assert_clean(audit(log(False).build()))


def test_inv2_a_start_before_the_rank_stopped_is_a_drain_not_a_violation() -> None:
    b = LogBuilder().start_run()
    b.admit()
    g = b.last_group
    b.start(f"{g}/0")
    _update_with(b, "drain")
    b.finish(f"{g}/0").finish(f"{g}/1").complete(g)
    assert_clean(audit(b.finish_run().build()))


@pytest.mark.parametrize("restarted", [True, False])
def test_inv2_a_pause_left_by_a_killed_rank_process_does_not_stop_its_next_process(restarted: bool) -> None:
    """Rank 0 paused for v1 and its process was killed before it resumed. Its next process joins (RankJoined) and
    may start a group in v2's window until it reports its own EnginePaused, like any rank draining. Without the
    join, the same start comes from a rank the log still says is paused: that is a violation."""
    b = LogBuilder().start_run()
    b.stage(1).request_prepare(1).prepare(1, 0).pause(AdmissionReason.UPDATE)
    b.emit(EnginePaused(rank=0, mode=DrainMode.WAIT))
    stale = b.last.event_id
    b.commit(1).commit_rank(1, 0).publish(1).resume(AdmissionReason.UPDATE)  # no EngineResumed: the process died
    if restarted:
        b.join(0, version=1)
    b.admit()
    g = b.last_group
    b.stage(2).request_prepare(2).prepare(2, 0).pause(AdmissionReason.UPDATE)
    b.start(f"{g}/0").start(f"{g}/1")  # raced the pause: started before the rank folded it
    offender = b.find("SampleStarted", sample_id=f"{g}/0").event_id
    b.emit(EnginePaused(rank=0, mode=DrainMode.WAIT))
    b.finish(f"{g}/0").finish(f"{g}/1").complete(g)
    b.commit(2).commit_rank(2, 0).publish(2).resume(AdmissionReason.UPDATE)
    report = audit(b.finish_run().build())
    if restarted:
        assert_clean(report)
    else:
        assert (stale, offender) in only(report, 2)


def test_inv2_no_start_on_any_rank_between_commit_and_publish() -> None:
    b = LogBuilder().start_run()
    b.admit()
    g = b.last_group
    b.start(f"{g}/0")
    b.stage(1).request_prepare(1).prepare(1, 0).pause(AdmissionReason.UPDATE).commit(1)
    b.start(f"{g}/1")
    offender = b.last.event_id
    commit = b.find("UpdateCommitted").event_id
    b.commit_rank(1, 0).publish(1).resume(AdmissionReason.UPDATE)
    b.finish(f"{g}/0").finish(f"{g}/1").complete(g)
    report = audit(b.finish_run().build())
    assert (commit, offender) in only(report, 2)


def test_inv2_window_closes_at_abort() -> None:
    b = LogBuilder().start_run()
    b.group()
    _update_with(b, None, abort=True)
    b.group()  # admitted after the abort: legal
    assert_clean(audit(b.finish_run().build()))


def test_inv2_window_opens_at_commit_when_no_pause_was_seen() -> None:
    b = LogBuilder().start_run()
    b.admit()
    g = b.last_group
    b.stage(1).request_prepare(1).prepare(1, 0).commit(1)
    b.start(f"{g}/0")
    b.commit_rank(1, 0).publish(1)
    report = audit(b.build())
    assert (b.find("UpdateCommitted").event_id, b.find("SampleStarted").event_id) in [
        v.event_ids for v in report.for_invariant(2)
    ]
    assert any(w.kind == "malformed" and "not paused" in w.message for w in report.warnings)


# ---------------------------------------------------------------- 3: fail-closed commit
def test_inv3_commit_needs_every_rank_prepared() -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder(ranks=2).start_run()
        b.stage(1).request_prepare(1).prepare(1, 0)
        if not bad:
            b.prepare(1, 1)
        b.pause().commit(1).commit_rank(1, 0).commit_rank(1, 1).publish(1).resume()
        return b.finish_run()

    bad = log(True)
    commit = bad.find("UpdateCommitted").event_id
    assert only(audit(bad.build()), 3) == [(commit,)]
    assert_clean(audit(log(False).build()))


def test_inv3_commit_needs_the_same_manifest_digest() -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder(ranks=2).start_run()
        b.stage(1).request_prepare(1).prepare(1, 0).prepare(1, 1, manifest="m-other" if bad else None)
        b.pause().commit(1).commit_rank(1, 0).commit_rank(1, 1).publish(1).resume()
        return b.finish_run()

    bad = log(True)
    prep = bad.find("RankPrepared", rank=1).event_id
    commit = bad.find("UpdateCommitted").event_id
    assert only(audit(bad.build()), 3) == [(prep, commit)]
    assert_clean(audit(log(False).build()))


def test_inv3_commit_after_a_failed_prepare_is_caught() -> None:
    b = LogBuilder(ranks=2).start_run()
    b.stage(1).request_prepare(1).prepare(1, 0).prepare_fail(1, 1).pause().commit(1, ranks=(0,))
    report = audit(b.build())
    commit = b.find("UpdateCommitted").event_id
    ids = [v.event_ids for v in report.for_invariant(3)]
    assert (b.find("RankPrepareFailed").event_id, commit) in ids  # failed rank
    assert (b.find("PrepareRequested").event_id, commit) in ids  # requested rank 1 left out of the commit


def test_inv3_aborted_version_must_leave_ranks_on_the_old_version() -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder().start_run()
        b.update(fail_rank=0)  # v1 aborted
        if bad:
            b.emit(b_rank_committed(1, 0))
        return b.finish_run()

    bad = log(True)
    abort = bad.find("UpdateAborted").event_id
    rc = bad.find("RankCommitted").event_id
    assert only(audit(bad.build()), 3) == [(abort, rc)]
    assert_clean(audit(log(False).build()))


def b_rank_committed(version: int, rank: int) -> RankCommitted:
    return RankCommitted(version=version, rank=rank, weights_digest=weights_digest_for(version))


def test_inv3_generation_with_an_aborted_version() -> None:
    b = LogBuilder().start_run()
    b.update(fail_rank=0)
    b.admit()
    g = b.last_group
    b.start(f"{g}/0", version=1, digest=weights_digest_for(1))
    report = audit(b.build())
    assert (b.find("UpdateAborted").event_id, b.find("SampleStarted").event_id) in [
        v.event_ids for v in report.for_invariant(3)
    ]


# ---------------------------------------------------------------- 4: one published state
def test_inv4_published_digest_must_match_every_rank() -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder(ranks=2).start_run()
        b.stage(1).request_prepare(1).prepare(1, 0).prepare(1, 1).pause().commit(1)
        b.commit_rank(1, 0).commit_rank(1, 1, weights="w-stale" if bad else None)
        return b.publish(1).resume().finish_run()

    bad = log(True)
    rc1 = bad.find("RankCommitted", rank=1).event_id
    pub = bad.find("PolicyPublished").event_id
    health1 = bad.find("HealthPassed", rank=1).event_id
    ids = only(audit(bad.build()), 4)
    assert (rc1, pub) in ids
    assert (health1, pub) in ids  # the rank's health check ran on the stale weights too
    assert_clean(audit(log(False).build()))


def test_inv4_ranks_whose_probes_disagree_do_not_all_run_the_published_weights() -> None:
    """Stale weights on one of two ranks: it claims the manifest's digest everywhere, and the probe vote is a tie, so
    the run publishes; the probes' disagreement is the evidence, and the audit must not say OK."""

    def log(bad: bool) -> LogBuilder:
        b = LogBuilder(ranks=2).start_run()
        b.stage(1).request_prepare(1).prepare(1, 0).prepare(1, 1).pause().commit(1)
        b.commit_rank(1, 0, probe="p-v1").commit_rank(1, 1, probe="p-v0" if bad else "p-v1")
        return b.publish(1).resume().finish_run()

    bad = log(True)
    ids = only(audit(bad.build()), 4)
    h0, h1 = (bad.find("HealthPassed", rank=r).event_id for r in (0, 1))
    assert (h0, h1, bad.find("PolicyPublished").event_id) in ids
    assert_clean(audit(log(False).build()))


def test_inv4_trajectory_must_carry_the_new_cache_generation() -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder().start_run()
        b.update()  # rank 0: CacheInvalidated(prefix, generation 1, v1)
        b.admit()
        g = b.last_group
        b.start(f"{g}/0").start(f"{g}/1")
        b.finish(f"{g}/0", **({"cache_generation": 0} if bad else {})).finish(f"{g}/1").complete(g)
        return b.finish_run()

    bad = log(True)
    inval = bad.find("CacheInvalidated").event_id
    fin = bad.find("SampleFinished", trajectory_id="g000001/0").event_id
    assert only(audit(bad.build()), 4) == [(inval, fin)]
    assert_clean(audit(log(False).build()))


def test_inv4_stale_weights_after_publication() -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder().start_run()
        b.update()
        b.admit()
        g = b.last_group
        b.start(f"{g}/0", digest=weights_digest_for(0) if bad else None).start(f"{g}/1")
        b.finish(f"{g}/0").finish(f"{g}/1").complete(g)
        return b.finish_run()

    bad = log(True)
    pub = bad.find("PolicyPublished").event_id
    start = bad.find("SampleStarted", sample_id="g000001/0").event_id
    ids = only(audit(bad.build()), 4)
    assert (pub, start) in ids
    assert_clean(audit(log(False).build()))


def test_inv4_publish_needs_cache_invalidation_and_health() -> None:
    b = LogBuilder(ranks=2).start_run()
    b.stage(1).request_prepare(1).prepare(1, 0).prepare(1, 1).pause().commit(1)
    b.commit_rank(1, 0, invalidate=False).commit_rank(1, 1, health=False).publish(1)
    report = audit(b.build())
    pub = b.find("PolicyPublished").event_id
    ids = [v.event_ids for v in report.for_invariant(4)]
    assert (b.find("RankCommitted", rank=0).event_id, pub) in ids
    assert (b.find("HealthFailed").event_id, pub) in ids


def test_inv4_quarantined_rank_may_be_left_out_of_the_publication() -> None:
    def log(quarantine: bool) -> LogBuilder:
        b = LogBuilder(ranks=2).start_run()
        b.stage(1).request_prepare(1).prepare(1, 0).prepare(1, 1).pause().commit(1)
        b.commit_rank(1, 0).commit_rank(1, 1, health=False)
        if quarantine:
            b.quarantine(1)
        return b.publish(1, ranks=(0,)).resume().finish_run()

    assert_clean(audit(log(True).build()))
    bad = log(False)
    assert only(audit(bad.build()), 4) == [(bad.find("UpdateCommitted").event_id, bad.find("PolicyPublished").event_id)]


# ---------------------------------------------------------------- 5: consumption within bounds
def test_inv5_lag_over_the_bound() -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder().start_run()
        b.group()
        g = b.last_group
        b.update()
        if bad:
            b.update()  # v2: the v0 group is now 2 versions old, max_lag is 1
        b.consume([g])
        return b.finish_run()

    bad = log(True)
    batch = bad.find("BatchConsumed").event_id
    report = audit(bad.build())
    ids = only(report, 5)
    assert (bad.find("GroupAdmitted").event_id, batch) in ids  # the recorded lag 2
    assert (bad.find("PolicyPublished", version=2).event_id, batch) in ids  # the lag the log proves
    assert_clean(audit(log(False).build()))


def test_inv5_understated_lag_is_caught_from_the_log() -> None:
    b = LogBuilder().start_run()
    b.group()
    g = b.last_group
    b.update().update()
    b.consume([g], lags=(0,), versions=(2,))
    report = audit(b.build())
    assert [v.event_ids for v in report.violations] == [
        (b.find("PolicyPublished", version=2).event_id, b.find("BatchConsumed").event_id)
    ]


def test_inv5_group_must_satisfy_its_partial_policy() -> None:
    def log(policy: PartialPolicy) -> LogBuilder:
        b = LogBuilder(partial_policy=policy).start_run()
        b.group(finished=1)  # one of two samples finished, the other failed
        g = b.last_group
        b.consume([g])
        return b.finish_run()

    bad = log(PartialPolicy(kind="all"))
    ids = only(audit(bad.build()), 5)
    assert ids == [
        (bad.find("GroupAdmitted").event_id, bad.find("GroupCompleted").event_id, bad.find("BatchConsumed").event_id)
    ]
    assert_clean(audit(log(PartialPolicy(kind="at_least", k=1)).build()))


def test_inv5_consuming_a_cancelled_group() -> None:
    b = LogBuilder().start_run()
    b.group()
    g = b.last_group
    b.cancel_group(g)  # withdrawn after completion
    b.consume([g])
    report = audit(b.build())
    assert [v.invariant for v in report.violations] == [5]
    assert b.find("GroupCancelled").event_id in report.violations[0].event_ids


# ---------------------------------------------------------------- 6: bytes under the cap
@pytest.mark.parametrize("field", ["queued_bytes", "byte_cap"])
def test_inv6_queued_bytes_over_the_cap(field: str) -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder().start_run()
        cap = b.config.admission.max_queued_bytes
        if field == "queued_bytes":
            b.admit(queued_bytes=cap + 1 if bad else cap)
        else:  # the controller used a looser cap than the run declared, and filled it
            b.admit(queued_bytes=cap + 1 if bad else cap, byte_cap=2 * cap if bad else cap)
        b.cancel_group(b.last_group)
        return b.finish_run()

    bad = log(True)
    assert only(audit(bad.build()), 6) == [(bad.find("GroupAdmitted").event_id,)]
    assert_clean(audit(log(False).build()))


def _one_sample_size() -> tuple[str, int]:
    """The group id and the encoded size of the trajectory the builder finishes the first group's sample with."""
    b = LogBuilder(group_size=1).start_run().admit(est_bytes=10_000)
    g = b.last_group
    p = b.start(f"{g}/0").finish(f"{g}/0").find("SampleFinished").payload
    assert isinstance(p, SampleFinished)
    return g, encoded_size(p.trajectory)


@pytest.mark.parametrize("wrong", [0, 1, -1])
def test_inv6_a_sample_declares_its_trajectorys_encoded_size(wrong: int) -> None:
    """A finished sample counts its trajectory's encoded size, which the audit recomputes: a declared size off by
    even one byte is a violation at that SampleFinished (and at the completion whose bytes it summed)."""
    g, size = _one_sample_size()
    b = LogBuilder(group_size=1).start_run().admit(est_bytes=10_000)
    b.start(f"{g}/0")
    b.finish(f"{g}/0", nbytes=size + wrong)
    b.complete(g).cancel_group(g)
    report = audit(b.finish_run().build())
    if wrong == 0:
        assert_clean(report)
    else:
        assert (b.find("SampleFinished").event_id,) in only(report, 6)


@pytest.mark.parametrize("reserved", ["enough", "short"])
def test_inv6_a_sample_holds_no_more_than_its_group_reserved(reserved: str) -> None:
    """Admission reserves bytes per sample (GroupAdmitted.est_bytes / n); a sample that holds more overruns what the
    byte cap was checked against: a violation, however small the queue."""
    g, size = _one_sample_size()
    b = LogBuilder(group_size=1).start_run().admit(est_bytes=size if reserved == "enough" else size - 1)
    b.start(f"{g}/0")
    b.finish(f"{g}/0", nbytes=size)
    b.complete(g).cancel_group(g)
    report = audit(b.finish_run().build())
    if reserved == "enough":
        assert_clean(report)
    else:
        assert only(report, 6) == [(b.find("SampleFinished").event_id,)]


# ---------------------------------------------------------------- 7: nothing silently lost
def test_inv7_unterminated_units_are_violations_once_the_run_finished() -> None:
    def log(bad: bool, finished: bool = True) -> LogBuilder:
        b = LogBuilder().start_run()
        b.admit()
        g = b.last_group
        b.start(f"{g}/0").start(f"{g}/1").finish(f"{g}/0")
        if not bad:
            b.fail(f"{g}/1").complete(g)
        return b.finish_run() if finished else b

    bad = log(True)
    end = bad.find("RunFinished").event_id
    ids = only(audit(bad.build()), 7)
    assert sorted(ids) == sorted(
        [(bad.find("SampleStarted", sample_id="g000001/1").event_id, end), (bad.find("GroupAdmitted").event_id, end)]
    )
    assert_clean(audit(log(False).build()))
    running = audit(log(True, finished=False).build())  # not finished yet: open units are warnings
    assert running.ok and not running.passed and running.verdict == "UNFINISHED"
    assert sorted(w.kind for w in running.warnings) == ["open", "open", "unfinished"]


# ---------------------------------------------------------------- 8: deterministic replay (digests from the reducer)
def test_inv8_replay_and_snapshot_digests() -> None:
    events = full_log().build()
    assert audit(events, replay_digests=("abc", "abc"), snapshot_checks=[("01SNAP", "d1", "d1")]).ok
    twice = audit(events, replay_digests=("abc", "abd"))
    assert only(twice, 8) == [(events[-1].event_id,)]
    snap = audit(events, snapshot_checks=[("01SNAP", "d1", "d1"), ("01SNAQ", "d2", "dX")])
    assert only(snap, 8) == [("01SNAQ",)]
    assert snap.checked[8] == 2


# ---------------------------------------------------------------- odd logs never crash the auditor
def test_duplicates_are_reported_and_ignored() -> None:
    events = full_log().build()
    doubled = events[:10] + [events[5], events[9]] + events[10:]
    report = audit(doubled)
    assert report.ok, report.render()
    assert [w.kind for w in report.warnings] == ["duplicate", "duplicate"]
    assert report.warnings[0].event_ids == (events[5].event_id,)


def test_conflicting_duplicate_id_is_reported() -> None:
    events = full_log().build()
    clash = msgspec.structs.replace(events[3], event_id=events[2].event_id)
    report = audit(events[:4] + [clash] + events[4:])
    assert any(w.kind == "conflicting_duplicate" for w in report.warnings)


def test_out_of_order_ids_of_one_producer_are_reported() -> None:
    # ids only have to rise within one producer (across producers, creation and append order may differ)
    events = [msgspec.structs.replace(e, producer="one") for e in full_log().build()]
    swapped = events[:3] + [events[4], events[3]] + events[5:]
    report = audit(swapped)
    assert any(w.kind == "out_of_order" and w.event_ids == (events[3].event_id,) for w in report.warnings)


_EVENTS: list[Event] = full_log().build()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.permutations(_EVENTS), st.integers(0, len(_EVENTS)), st.lists(st.integers(0, len(_EVENTS) - 1), max_size=4))
def test_any_shuffle_truncation_or_duplication_is_audited_without_crashing(
    shuffled: list[Event], cut: int, dups: list[int]
) -> None:
    log = shuffled[:cut] + [shuffled[i] for i in dups if i < cut]
    report = audit(log)
    assert not [w for w in report.warnings if w.kind == "internal"], report.render()
    json.loads(report.to_json())
    report.render()


def test_a_shuffled_log_is_not_silently_accepted() -> None:
    events = list(_EVENTS)
    random.Random(7).shuffle(events)
    report = audit(events)
    assert not report.ok or report.warnings


def test_inv4_failure_after_commit_rolls_forward_on_the_other_ranks() -> None:
    """The coordinator's roll-forward: a rank that fails its swap is quarantined and v is published on the rest."""

    def log(quarantine: bool) -> LogBuilder:
        b = LogBuilder(ranks=2).start_run()
        b.stage(1).request_prepare(1).prepare(1, 0).prepare(1, 1).pause().commit(1)
        b.commit_rank(1, 0).prepare_fail(1, 1, phase="commit")
        if quarantine:
            b.quarantine(1)
            b.publish(1, ranks=(0,))
        else:
            b.publish(1)
        return b.resume().finish_run()

    assert_clean(audit(log(True).build()))
    bad = log(False)
    ids = only(audit(bad.build()), 4)
    assert (bad.find("RankPrepareFailed").event_id, bad.find("PolicyPublished").event_id) in ids


def test_builder_logs_fold_through_the_reducer_without_anomalies() -> None:
    """The builder's logs are the ones the run loop writes: the project's reducer accepts them as they are."""
    reducer = pytest.importorskip("rolledger.workflows.reducer")
    events = full_log().build()
    state = reducer.replay(events)
    assert state.anomalies == []
    assert reducer.replay(events).digest() == state.digest()


def test_inv6_a_completion_must_record_the_bytes_its_samples_hold() -> None:
    def log(bad: bool) -> LogBuilder:
        b = LogBuilder(group_size=2).start_run()
        b.group()
        if bad:  # the same group completed by a coordinator that under-counts
            done = b.find("GroupCompleted")
            p = done.payload
            assert isinstance(p, GroupCompleted)
            b.events[b.events.index(done)] = msgspec.structs.replace(done, payload=msgspec.structs.replace(p, bytes=1))
        return b.finish_run()

    bad = log(True)
    assert only(audit(bad.build()), 6) == [(bad.find("GroupCompleted").event_id,)]
    assert_clean(audit(log(False).build()))


@pytest.mark.parametrize("bounded", [True, False])
def test_inv6_the_recomputed_queue_over_the_cap_is_a_violation_once_admission_bounds_it(bounded: bool) -> None:
    """Two completed groups hold more than the cap. A log whose admission counts groups in flight at max_tokens
    (GroupAdmitted v2) can never get there: a violation at the completion that overflows. An older log: a warning."""
    b = LogBuilder(group_size=2).start_run()
    b.group()
    one = b.find("GroupCompleted").payload
    assert isinstance(one, GroupCompleted)
    cfg = b.config.model_copy(
        update={"admission": b.config.admission.model_copy(update={"max_queued_bytes": one.bytes + one.bytes // 2})}
    )
    b = LogBuilder(cfg).start_run()
    for _ in range(2):
        b.admit(prompt_index=-1 if bounded else None, queued_bytes=0)
        g = b.last_group
        for i in range(2):
            b.start(f"{g}/{i}")
        for i in range(2):
            b.finish(f"{g}/{i}")
        b.complete(g)
    report = audit(b.finish_run().build())
    second = b.find_all("GroupCompleted")[1].event_id
    if bounded:
        assert only(report, 6) == [(second,)]
    else:
        assert report.ok and [w.kind for w in report.warnings] == ["queued_bytes"]
