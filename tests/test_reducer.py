"""The reducer: deterministic replay, snapshot + tail equals a full replay, anomalies recorded instead of raised."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason
from rolledger.workflows.reducer import evolve, fold, replay
from rolledger.workflows.state import RunState

OPS = st.lists(
    st.sampled_from(["group", "partial_group", "consume", "update", "failed_update", "cancel", "drop"]),
    min_size=1,
    max_size=25,
)


def build_log(ops: list[str], ranks: int) -> list[ev.Event]:
    b = LogBuilder(group_size=2, ranks=ranks).start_run()
    ready: list[str] = []
    version = 0  # a version number is never reused, even after an abort (as the trainer numbers them)
    for op in ops:
        if op == "group":
            b.group()
            ready.append(b.last_group)
        elif op == "partial_group":
            b.admit(n=2)
            gid = b.last_group
            b.start(f"{gid}/0").start(f"{gid}/1").finish(f"{gid}/0")
        elif op == "consume" and ready:
            b.consume(ready[:2])
            ready = ready[2:]
        elif op == "update":
            version += 1
            b.update(version)
        elif op == "failed_update":
            version += 1
            b.update(version, fail_rank=ranks - 1)
        elif op == "cancel" and ready:
            b.cancel_group(ready.pop())
        elif op == "drop" and ready:
            b.drop(ready.pop())
    return b.finish_run().build()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, ranks=st.integers(1, 3), cut=st.floats(0, 1))
def test_replay_is_deterministic_and_snapshot_plus_tail_equals_full(ops: list[str], ranks: int, cut: float) -> None:
    events = build_log(ops, ranks)
    full = replay(events)
    assert replay(events).digest() == full.digest()
    k = int(cut * len(events))
    snapshot = RunState.from_dict(replay(events[:k]).to_dict())  # through the serialised form, as stored
    assert replay(events[k:], snapshot).digest() == full.digest()


@settings(max_examples=30, deadline=None)
@given(ops=OPS)
def test_a_valid_log_has_no_anomalies_and_consistent_counters(ops: list[str]) -> None:
    state = replay(build_log(ops, 2))
    assert state.anomalies == []
    assert state.admission.queued_bytes == sum(
        g.bytes for g in state.groups.values() if g.status in ("complete", "partial", "scored")
    )
    assert state.admission.inflight == sum(1 for g in state.groups.values() if g.status in ("admitted", "generating"))
    published = [u.version for u in state.updates.values() if u.status == "published"]
    assert state.policy_version == max(published, default=0)


def test_duplicate_event_is_recorded_not_applied_twice() -> None:
    b = LogBuilder().start_run()
    b.group()
    events = b.build()
    state = replay(events + [events[-1]])
    assert state.counts["GroupCompleted"] == 1
    assert [a.message for a in state.anomalies] == ["duplicate event id; not applied again"]
    assert state.anomalies[0].event_id == events[-1].event_id


def test_out_of_order_events_are_anomalies_not_crashes() -> None:
    b = LogBuilder().start_run()
    b.group()
    events = b.build()
    finished = next(i for i, e in enumerate(events) if e.type == "SampleFinished")
    started = next(i for i, e in enumerate(events) if e.type == "SampleStarted")
    shuffled = events[:started] + [events[finished]] + events[started:finished] + events[finished + 1 :]
    state = replay(shuffled)
    assert any("has no SampleStarted" in a.message for a in state.anomalies)
    assert any("started twice" in a.message for a in state.anomalies)


def test_commit_without_every_rank_prepared_is_an_anomaly() -> None:
    b = LogBuilder(ranks=2).start_run()
    b.stage(1).request_prepare(1).prepare(1, 0).pause(AdmissionReason.UPDATE).commit(1)
    state = replay(b.build())
    assert any("without RankPrepared from ranks [1]" in a.message for a in state.anomalies)


def test_evolve_leaves_the_old_state_alone() -> None:
    b = LogBuilder().start_run()
    events = b.group().build()
    before = replay(events[:-1])
    frozen = copy.deepcopy(before)
    after = evolve(before, events[-1])
    assert before.digest() == frozen.digest()
    assert after.digest() != before.digest()


def test_fold_reads_nothing_but_its_arguments() -> None:
    """Same events, states built at different times and in different processes' orders: same digest."""
    events = build_log(["group", "update", "group", "consume", "failed_update"], 2)
    a = RunState()
    for e in events:
        a = fold(a, e)
    b = replay(list(events))
    assert a.digest() == b.digest()
