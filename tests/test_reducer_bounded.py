"""Bounded live state (issue 12, item 3): terminal groups that owe nothing leave `RunState.groups`, the counters the
deciders read stay exact, and the digest still covers every group (hash chain) and survives snapshot + tail.

The reference is the same reducer with retirement switched off (every group stays, as before issue 12): the bounded
state must hold exactly its groups that still owe something, tombstone the others in retirement order, and every
decider must decide the same on both.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder

from rolledger.schemas import events as ev
from rolledger.schemas.config import PartialPolicy
from rolledger.schemas.statuses import UpdateStatus
from rolledger.workflows import reducer_rollout, reducer_trainer, reducer_update
from rolledger.workflows import state as state_mod
from rolledger.workflows.admission import AdmissionInputs, gates, settled_version
from rolledger.workflows.coordinator import consecutive_aborts, decide
from rolledger.workflows.rank import RankLocal, decide_rank, may_serve, rejoin_version
from rolledger.workflows.reducer import replay
from rolledger.workflows.scheduler import PromptItem
from rolledger.workflows.state import GroupState, RunState, group_record, owes_nothing
from rolledger.workflows.trainer import lineage, next_version, versions_to_keep, weights_version
from rolledger.workflows.update import about_to_be_quarantined

OPS = st.lists(
    st.sampled_from(
        [
            "group",
            "partial_group",
            "first_k",
            "consume",
            "update",
            "abort",
            "cancel",
            "drop",
            "race",
            "late",
            "late_prepare",
            "quarantine",
            "rejoin",
            "update_without_1",
        ]
    ),
    min_size=1,
    max_size=30,
)
PROMPTS = [PromptItem(i, f"p{i}", (1, 2, 3), "6") for i in range(40)]


def build_log(ops: list[str]) -> list[ev.Event]:
    """A valid log of one run, with the lifecycles that end a group: consumed, dropped, cancelled (before or after
    its samples started, with a start racing the cancel), first-k leftovers cancelled after the group completed and
    was consumed, and the late result of a rank whose group was reclaimed; updates published and aborted, a rank's
    late prepare (and failure) for the first version, a rank quarantined and rejoining, and updates rank 1 takes no part
    in (it then holds an old version)."""
    b = LogBuilder(group_size=2, ranks=2).start_run()
    ready: list[str] = []
    version = 0
    for op in ops:
        if op == "group":
            b.group()
            ready.append(b.last_group)
        elif op == "partial_group":  # stays open: one sample still running
            b.admit(n=2)
            gid = b.last_group
            b.start(f"{gid}/0").start(f"{gid}/1").finish(f"{gid}/0")
        elif op == "first_k":  # completes with one sample while the other runs; the other is cut short later
            b.admit(n=2, partial_policy=PartialPolicy(kind="first_k", k=1))
            gid = b.last_group
            b.start(f"{gid}/0").start(f"{gid}/1").finish(f"{gid}/0").score(f"{gid}/0")
            b.complete(gid, accepted=(f"{gid}/0",))
            b.consume([gid])
            b.cancel(f"{gid}/1")
        elif op == "consume" and ready:
            b.consume(ready[:2])
            ready = ready[2:]
        elif op == "update":
            version += 1
            b.update(version)
        elif op == "abort":  # rank 1 fails its prepare: the version aborts, its number is not reused
            version += 1
            b.update(version, fail_rank=1)
        elif op == "cancel" and ready:
            b.cancel_group(ready.pop())
        elif op == "drop" and ready:
            b.drop(ready.pop())
        elif op == "race":  # cancelled before any sample started; a worker's start races the cancel, then cuts it
            b.admit(n=2)
            gid = b.last_group
            b.cancel_group(gid, reason="run finished")
            b.start(f"{gid}/0", rank=1).cancel(f"{gid}/0", reason="cancelled while generating")
        elif op == "late":  # rank 0 loses the group to rank 1, which finishes it; rank 0's late finish comes after
            b.admit(n=2)
            gid = b.last_group
            b.start(f"{gid}/0", rank=0).start(f"{gid}/1", rank=0)
            for i in (0, 1):
                b.emit(ev.SampleFailed(sample_id=f"{gid}/{i}", group_id=gid, index=i, rank=1, error="worker lost"))
            b.cancel_group(gid)
            b.emit(
                ev.SampleFailed(sample_id=f"{gid}/0", group_id=gid, index=0, rank=0, error="engine error"),
            )
        elif op == "late_prepare" and version:  # a slow rank's prepare of v1 (and another's failure) lands now
            b.prepare(1, 1).prepare_fail(1, 0)
        elif op == "update_without_1":  # rank 1 (quarantined, or left out) takes no part: it stays on its version
            version += 1
            b.stage(version).request_prepare(version, ranks=(0,)).prepare(version, 0).pause()
            b.commit(version, ranks=(0,)).commit_rank(version, 0).publish(version, ranks=(0,)).resume()
        elif op == "quarantine":
            b.quarantine(1)
        elif op == "rejoin":
            b.join(1)
    return b.finish_run().build()


@contextmanager
def doing_nothing(*where: tuple[object, str]) -> Iterator[None]:
    """Each (module, function) does nothing inside the block: the reducer as it was before that function."""
    mp = pytest.MonkeyPatch()
    for module, name in where:
        mp.setattr(module, name, lambda *args: None)
    try:
        yield
    finally:
        mp.undo()


def retirement_off() -> AbstractContextManager[None]:
    """The reducer as before issue 12: every group stays in `groups`."""
    return doing_nothing((reducer_rollout, "retire_if_done"), (reducer_trainer, "retire_if_done"))


def records(groups: dict[str, GroupState]) -> dict[str, list[object]]:
    return {gid: group_record(g) for gid, g in groups.items()}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, cut=st.floats(0, 1))
def test_bounded_state_holds_what_the_unbounded_one_still_owes_and_decides_alike(ops: list[str], cut: float) -> None:
    events = build_log(ops)
    k = int(cut * len(events)) or 1
    with retirement_off():
        ref = replay(events[:k])
    bounded = replay(events[:k])
    assert bounded.anomalies == ref.anomalies
    # live = the groups that still owe something; the rest are tombstoned, with their terminal status. A group
    # retired before a start raced its closure owes that sample, which `raced` holds instead of the group.
    started = {s.sample_id for g in ref.groups.values() for s in g.samples.values() if s.status == "started"}

    def gone_for_good(g: GroupState) -> bool:
        return owes_nothing(g) or (
            g.status.is_terminal
            and all(s.sample_id in bounded.raced for s in g.samples.values() if s.status == "started")
            and all(s.status != "finished" or s.reward is not None for s in g.samples.values())
        )

    assert records(bounded.groups) == records({gid: g for gid, g in ref.groups.items() if not gone_for_good(g)})
    gone = {gid: g.status for gid, g in ref.groups.items() if gone_for_good(g)}
    assert bounded.retired == gone
    assert bounded.retired_groups == len(gone)
    # the counters the deciders read instead of scanning every group, recounted from the unbounded state
    assert bounded.admission.gone_before_training == sum(
        1 for g in ref.groups.values() if g.status in ("cancelled", "dropped")
    )
    assert bounded.scheduler == ref.scheduler
    assert set(bounded.raced) == {sid for sid in started if sid.rsplit("/", 1)[0] in bounded.retired}
    assert bounded.lag == ref.lag
    assert [g.group_id for g in bounded.ready_groups()] == [g.group_id for g in ref.ready_groups()]
    cfg = bounded.config
    assert cfg is not None
    assert gates(bounded, cfg, 1, 100) == gates(ref, cfg, 1, 100)
    for now in (0.0, 1e12):  # before and after every deadline
        inputs = AdmissionInputs(now=now, prompts=PROMPTS)
        assert decide(bounded, now, 1, inputs) == decide(ref, now, 1, inputs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, cut=st.floats(0, 1))
def test_digest_of_snapshot_plus_tail_equals_the_full_replay(ops: list[str], cut: float) -> None:
    events = build_log(ops)
    full = replay(events)
    assert replay(events).digest() == full.digest()
    k = int(cut * len(events))
    snapshot = RunState.from_dict(replay(events[:k]).to_dict())  # through the serialised form, as stored
    tail = replay(events[k:], snapshot)
    assert tail.digest() == full.digest()
    assert tail.retired_digest == full.retired_digest


def test_consumed_dropped_and_cancelled_groups_leave_the_live_state() -> None:
    b = LogBuilder(group_size=2).start_run()
    for _ in range(4):
        b.group()
    consumed, dropped, cancelled, waiting = ("g000001", "g000002"), "g000003", "g000004", None
    b.consume(list(consumed)).drop(dropped).cancel_group(cancelled)
    b.group()
    waiting = b.last_group
    state = replay(b.build())
    assert state.anomalies == []
    assert list(state.groups) == [waiting]
    assert state.retired == {
        "g000001": "consumed",
        "g000002": "consumed",
        "g000003": "dropped",
        "g000004": "cancelled",
    }
    assert state.retired_groups == 4
    assert state.admission.gone_before_training == 2
    assert state.trainer.consumed_groups == 2


def test_a_group_with_a_running_sample_stays_live_until_the_sample_ends() -> None:
    b = LogBuilder(group_size=2).start_run()
    b.admit(n=2, partial_policy=PartialPolicy(kind="first_k", k=1))
    gid = b.last_group
    b.start(f"{gid}/0").start(f"{gid}/1").finish(f"{gid}/0").score(f"{gid}/0").complete(gid, accepted=(f"{gid}/0",))
    b.consume([gid])
    state = replay(b.build())
    assert state.groups[gid].status == "consumed"  # its second sample still runs
    state = replay(b.cancel(f"{gid}/1").build())
    assert gid not in state.groups and state.retired[gid] == "consumed"
    assert state.anomalies == []


def test_the_digest_still_covers_retired_groups() -> None:
    """Two runs whose only difference is a reward in a group long consumed have different digests."""

    def run(reward: float) -> RunState:
        b = LogBuilder(group_size=2).start_run()
        b.group(score=False, complete=False)
        gid = b.last_group
        b.score(f"{gid}/0", reward=reward).score(f"{gid}/1").complete(gid)
        b.consume([gid])
        return replay(b.build())

    one, other = run(1.0), run(0.0)
    assert one.anomalies == other.anomalies == []
    assert one.groups == other.groups == {}
    assert one.retired == other.retired
    assert one.retired_digest != other.retired_digest
    assert one.digest() != other.digest()


def test_tombstones_are_kept_to_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_mod, "RETIRED_KEPT", 3)
    b = LogBuilder(group_size=2).start_run()
    for _ in range(6):
        b.group()
        b.consume([b.last_group])
    state = replay(b.build())
    assert state.anomalies == []
    assert list(state.retired) == ["g000004", "g000005", "g000006"]  # the newest, oldest first
    assert state.retired_groups == 6 and state.groups == {}
    # an event for a tombstoned group names it; one for a forgotten group is an unknown group, as before
    for gid, message in (
        ("g000006", "group g000006 already consumed and retired"),
        ("g000001", "unknown group g000001"),
    ):
        b.emit(ev.GroupCancelled(group_id=gid, reason="late"))
        state = replay(b.events[-1:], state)
        assert state.anomalies[-1].message == message


def test_a_retired_group_record_has_every_field() -> None:
    """group_record must list every GroupState (and SampleState) field, or the chain would miss a change."""
    b = LogBuilder(group_size=2).start_run()
    b.group()
    g = replay(b.build()).groups[b.last_group]
    assert len(group_record(g)) == len(dataclasses.fields(GroupState))
    assert len(group_record(g)[13][0]) == len(dataclasses.fields(type(next(iter(g.samples.values())))))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, cut=st.floats(0, 1))
def test_a_snapshot_from_before_the_bound_restores_to_a_state_that_decides_alike(ops: list[str], cut: float) -> None:
    """A snapshot taken before issue 12 (every group kept, none of the new fields, nor issue 14's scheduler state and sample sizes):
    restored, it holds what the bounded reducer holds and its deciders decide as a bounded replay's do."""
    events = build_log(ops)
    k = int(cut * len(events)) or 1
    with retirement_off():
        old = replay(events[:k]).to_dict()
    for name in ("retired", "retired_groups", "retired_digest", "after_retired", "raced", "scheduler"):
        del old[name]
    del old["admission"]["gone_before_training"]
    for group in old["groups"].values():  # nor what each finished sample holds (counted by the formula then)
        for sample in group["samples"].values():
            del sample["nbytes"]
    restored = RunState.from_dict(old)
    bounded = replay(events[:k])
    if bounded.raced:
        return  # a start that raced a closure: the old state holds it in its group, which stays live here
    assert records(restored.groups) == records(bounded.groups)
    assert set(restored.retired) == set(bounded.retired)
    assert restored.admission == bounded.admission
    assert restored.scheduler == bounded.scheduler
    cfg = bounded.config
    assert cfg is not None
    for now in (0.0, 1e12):
        inputs = AdmissionInputs(now=now, prompts=PROMPTS)
        assert decide(restored, now, 1, inputs) == decide(bounded, now, 1, inputs)
    later = replay(events[k:], restored)
    assert records(later.groups) == records(replay(events).groups)


def progress_kept() -> AbstractContextManager[None]:
    """The reducer as before: a closed update keeps every rank's progress."""
    return doing_nothing((reducer_update, "forget_progress"))


_PROGRESS = ("prepared", "committed", "invalidated", "healthy", "probe_digests")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, cut=st.floats(0, 1))
def test_a_closed_update_forgets_its_per_rank_progress_and_every_decider_decides_alike(
    ops: list[str], cut: float
) -> None:
    events = build_log(ops)
    k = int(cut * len(events)) or 1
    with progress_kept():
        ref = replay(events[:k])
    lean = replay(events[:k])
    assert lean.anomalies == ref.anomalies and lean.updates.keys() == ref.updates.keys()
    for v, u in lean.updates.items():
        full = dataclasses.asdict(ref.updates[v])
        if u.open:
            assert dataclasses.asdict(u) == full  # the open transaction is whole
        else:
            assert all(not getattr(u, name) for name in _PROGRESS)
            assert {n: x for n, x in dataclasses.asdict(u).items() if n not in _PROGRESS} == {
                n: x for n, x in full.items() if n not in _PROGRESS
            }
    for now in (0.0, 1e12):
        inputs = AdmissionInputs(now=now, prompts=PROMPTS)
        assert decide(lean, now, 1, inputs) == decide(ref, now, 1, inputs)
    newest = max(lean.updates, default=0)
    for rank, r in ref.ranks.items():
        for local in (
            RankLocal(live_version=r.committed_version),
            RankLocal(running=1, engine_paused=True, staged_version=newest, live_version=r.committed_version),
            RankLocal(staged_version=max(newest - 1, 0), live_version=max(r.committed_version - 1, 0)),
        ):
            assert decide_rank(lean, rank, local) == decide_rank(ref, rank, local), (rank, local)


def test_a_run_of_many_updates_keeps_a_small_record_of_each() -> None:
    b = LogBuilder(group_size=2, ranks=16).start_run()
    for _ in range(20):
        b.group()
        b.consume([b.last_group])
        b.update()
    state = replay(b.finish_run().build())
    kept = state_mod.UPDATES_KEPT
    assert sorted(state.updates) == list(range(21 - kept, 21))  # the newest; every rank holds v20 and took part in it
    assert all(u.status == "published" and not any(getattr(u, n) for n in _PROGRESS) for u in state.updates.values())
    assert list(state.retired_updates) == list(range(1, 21 - kept))
    assert all(t.status == "published" and t.closing_event for t in state.retired_updates.values())
    assert (state.updates_published, state.updates_aborted, state.updates_committed) == (20, 0, 20)
    assert not state.anomalies


def records_kept() -> AbstractContextManager[None]:
    """The reducer as before: every closed update's record stays in `updates`."""
    return doing_nothing((reducer_update, "retire_updates"))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, cut=st.floats(0, 1))
# rank 1 holds v1, took part last in v3 (aborted), and none of v2, v4, v5: v1 is its reload's source, v3's abort what
# resumes it, and v2 and v4 retire
@example(ops=["update", "update_without_1", "abort", "update_without_1", "update_without_1"], cut=0.99)
@example(ops=["update", "update", "abort", "abort"], cut=0.99)  # the aborts since v2 are counted: they stay
def test_closed_update_records_retire_and_every_decider_decides_alike(ops: list[str], cut: float) -> None:
    """With no closed record kept for its age alone (UPDATES_KEPT = 0: only those a decider reads stay), every
    decider decides as with every record kept, and the counts are whole."""
    events = build_log(ops)
    k = int(cut * len(events)) or 1
    with records_kept():
        ref = replay(events[:k])
    mp = pytest.MonkeyPatch()
    mp.setattr(reducer_update, "UPDATES_KEPT", 0)
    try:
        lean = replay(events[:k])
    finally:
        mp.undo()
    if ops == ["update", "update_without_1", "abort", "update_without_1", "update_without_1"]:
        assert sorted(lean.updates) == [1, 3, 5] and list(lean.retired_updates) == [2, 4]  # the example above
    # an event for a retired version is still an anomaly where it was one (its text names the retirement)
    assert [a.event_id for a in lean.anomalies] == [a.event_id for a in ref.anomalies]
    assert lean.updates.keys() <= ref.updates.keys()
    for v, u in lean.updates.items():
        assert u == ref.updates[v]
    for v, gone in lean.retired_updates.items():
        u = ref.updates[v]
        assert not u.open and gone.status == u.status and gone.closing_event == (u.published_event or u.decided_event)
    assert lean.updates.keys() | lean.retired_updates.keys() == ref.updates.keys()
    statuses = [u.status for u in ref.updates.values()]
    assert lean.updates_published == statuses.count(UpdateStatus.PUBLISHED) == ref.updates_published
    assert lean.updates_aborted == statuses.count(UpdateStatus.ABORTED) == ref.updates_aborted
    assert lean.updates_committed == sum(1 for s in statuses if s.is_decided_commit)
    for now in (0.0, 1e12):
        inputs = AdmissionInputs(now=now, prompts=PROMPTS)
        assert decide(lean, now, 1, inputs) == decide(ref, now, 1, inputs)
    for reader in (next_version, weights_version, lineage, versions_to_keep, settled_version):
        assert reader(lean) == reader(ref), reader.__name__
    assert consecutive_aborts(lean) == consecutive_aborts(ref)
    assert rejoin_version(lean) == rejoin_version(ref)
    for rank, r in ref.ranks.items():
        for local in [
            RankLocal(live_version=r.committed_version),
            RankLocal(running=1, engine_paused=True, live_version=r.committed_version),
            *(RankLocal(staged_version=v, live_version=max(r.committed_version - 1, 0)) for v in ref.updates),
        ]:
            assert decide_rank(lean, rank, local) == decide_rank(ref, rank, local), (rank, local)
        assert may_serve(lean, rank) == may_serve(ref, rank)
        assert about_to_be_quarantined(lean, rank, 0.0) == about_to_be_quarantined(ref, rank, 0.0)


def test_late_events_for_a_retired_version_are_judged_by_its_tombstone() -> None:
    b = LogBuilder(group_size=2, ranks=2).start_run()
    b.update(1, fail_rank=1)  # v1 aborts: rank 1 failed; rank 0's prepare of it may still land late, legally
    for v in range(2, 2 + state_mod.UPDATES_KEPT + 1):
        b.update(v)
    newest = 1 + state_mod.UPDATES_KEPT + 1
    before = replay(b.build())
    assert 1 in before.retired_updates and 2 in before.retired_updates and 1 not in before.updates
    b.prepare(1, 0).prepare_fail(1, 1)  # late, after its abort: legal, as when the record was kept
    assert replay(b.build()).anomalies == []
    b.prepare(2, 0)  # a prepare of a published version: an anomaly, as before
    b.commit_rank(2, 1)  # no rank swaps in weights that old: an anomaly, and the rank stays where it is
    b.stage(2)  # its number is never staged again
    state = replay(b.build())
    assert [a.event_type for a in state.anomalies] == ["RankPrepared", "RankCommitted", "UpdateStaged"]
    assert "v2 already published" in state.anomalies[1].message
    assert state.ranks[1].committed_version == newest
    assert next_version(state) == newest + 1
    back = RunState.from_dict(json.loads(json.dumps(state.to_dict())))  # a snapshot keeps the tombstones
    assert back.digest() == state.digest() and back.retired_updates == state.retired_updates
    assert all(type(t.status) is UpdateStatus for t in back.retired_updates.values())
