"""The pure coordinators: admission gates, partial policies, and the weight-update transaction's decisions."""

from __future__ import annotations

import msgspec
import pytest
from logbuilder import LogBuilder
from pydantic import ValidationError

from rolledger.events.envelope import make_event
from rolledger.schemas import events as ev
from rolledger.schemas.config import AdmissionConfig, PartialPolicy, RunConfig, TrainerConfig
from rolledger.schemas.statuses import (
    AdmissionReason,
    DrainMode,
    GroupOutcome,
    GroupStatus,
    PolicyKind,
    PreparePhase,
    SampleStatus,
)
from rolledger.workflows.admission import AdmissionInputs, decide_admission, gates, group_bytes
from rolledger.workflows.groups import decide_group, decide_groups
from rolledger.workflows.reducer import replay
from rolledger.workflows.scheduler import PromptItem, remaining_tokens
from rolledger.workflows.state import GroupState, RunState, SampleState
from rolledger.workflows.update import decide_update

PROMPTS = [PromptItem(i, f"p{i}", (1, 2, 3, 4), "7") for i in range(50)]


def config(**kw: object) -> RunConfig:
    base: dict[str, object] = {"group_size": 2, "ranks": 1}
    base.update(kw)
    return RunConfig.model_validate(base)


def fold_all(state: RunState, payloads: list[ev.Payload], version: int | None = None) -> RunState:
    from rolledger.workflows.reducer import fold

    for p in payloads:
        fold(
            state,
            make_event(
                p, run_id="r", producer="test", policy_version=state.policy_version if version is None else version
            ),
        )
    return state


def started(cfg: RunConfig) -> RunState:
    return replay(LogBuilder(cfg).start_run().build())


# ---------------------------------------------------------------- admission
def test_admits_up_to_the_inflight_cap_in_fifo_order() -> None:
    cfg = config(admission=AdmissionConfig(max_inflight_groups=3, throttle_to_drain_rate=False))
    out = decide_admission(started(cfg), AdmissionInputs(now=0.0, prompts=PROMPTS))
    assert [p.prompt_id for p in out if isinstance(p, ev.GroupAdmitted)] == ["p0", "p1", "p2"]


def test_srgf_admits_the_shortest_estimated_groups_first() -> None:
    cfg = config(scheduler="srgf", admission=AdmissionConfig(max_inflight_groups=3, throttle_to_drain_rate=False))
    state = started(cfg)
    for i in range(6):  # completion lengths observed for these prompts (an earlier epoch): 2, 3, 4, 2, 3, 4 tokens
        state.scheduler.prompt_lengths[f"p{i}"] = [1, 2 + (i % 3)]
    out = decide_admission(state, AdmissionInputs(now=0.0, prompts=PROMPTS, window=6))
    admitted = [p for p in out if isinstance(p, ev.GroupAdmitted)]
    assert [p.prompt_id for p in admitted] == ["p0", "p3", "p1"]  # est 2, 2, 3 tokens (ties by identity)
    assert [p.est_remaining_tokens for p in admitted] == [4, 4, 6]
    assert [p.prompt_index for p in admitted] == [0, 3, 1]


def test_byte_cap_stops_admission_before_the_queue_outgrows_it_then_resumes() -> None:
    one = group_bytes(config(), PROMPTS[0], 0)  # a group of 2 samples, each reserved at sampling.max_tokens
    assert {group_bytes(config(), PROMPTS[i], i) for i in range(3)} == {one}  # the same for each of the first three
    cfg = config(
        admission=AdmissionConfig(
            max_queued_bytes=2 * one + one // 2, max_inflight_groups=8, throttle_to_drain_rate=False
        )
    )
    state = started(cfg)
    first = decide_admission(state, AdmissionInputs(now=0.0, prompts=PROMPTS))
    admitted = [p for p in first if isinstance(p, ev.GroupAdmitted)]
    assert len(admitted) == 2
    assert all(p.queued_bytes <= p.byte_cap for p in admitted)
    fold_all(state, first)
    second = decide_admission(state, AdmissionInputs(now=0.0, prompts=PROMPTS))
    assert [type(p).__name__ for p in second] == ["AdmissionPaused"]
    assert isinstance(second[0], ev.AdmissionPaused) and second[0].reason == "bytes"
    fold_all(state, second)
    # the two groups are generated, scored, completed and consumed: the queue drains and admission reopens
    for g in admitted:
        gid = g.group_id
        fold_all(
            state,
            [
                ev.SampleStarted(
                    sample_id=f"{gid}/{i}", group_id=gid, index=i, rank=0, policy_version=0, weights_digest="w"
                )
                for i in range(2)
            ],
        )
        state.groups[gid].samples[0].status = state.groups[gid].samples[1].status = SampleStatus.FINISHED
        state.groups[gid].samples[0].tokens = state.groups[gid].samples[1].tokens = 2
        fold_all(
            state,
            [
                ev.GroupCompleted(
                    group_id=gid, accepted=(f"{gid}/0", f"{gid}/1"), status=GroupOutcome.COMPLETE, bytes=one
                )
            ],
        )
    assert state.admission.queued_bytes == 2 * one
    assert decide_admission(state, AdmissionInputs(now=0.0, prompts=PROMPTS)) == []  # still over: stays paused
    for g in admitted:
        state.groups[g.group_id].status = GroupStatus.SCORED
    fold_all(
        state,
        [
            ev.BatchConsumed(
                step=1, group_ids=tuple(g.group_id for g in admitted), versions=(0, 0), lags=(0, 0), trajectory_ids=()
            )
        ],
    )
    reopened = decide_admission(state, AdmissionInputs(now=0.0, prompts=PROMPTS))
    assert isinstance(reopened[0], ev.AdmissionResumed) and reopened[0].reason == "bytes"
    assert any(isinstance(p, ev.GroupAdmitted) for p in reopened)


def test_lag_cap_bounds_admission_by_the_published_version() -> None:
    cfg = config(
        admission=AdmissionConfig(max_lag=0, throttle_to_drain_rate=False), trainer=TrainerConfig(groups_per_step=1)
    )
    state = started(cfg)
    out = decide_admission(state, AdmissionInputs(now=0.0, prompts=PROMPTS))
    assert (
        sum(isinstance(p, ev.GroupAdmitted) for p in out) == 1
    )  # the group trained at step 1 is the only one with lag 0
    fold_all(state, out)
    again = decide_admission(state, AdmissionInputs(now=0.0, prompts=PROMPTS))
    assert [(type(p).__name__, getattr(p, "reason", None)) for p in again] == [("AdmissionPaused", "lag")]
    fold_all(state, again)
    state.policy_version = 1  # v1 published (the transaction itself is tested below)
    resumed = decide_admission(state, AdmissionInputs(now=0.0, prompts=PROMPTS))
    assert isinstance(resumed[0], ev.AdmissionResumed) and sum(isinstance(p, ev.GroupAdmitted) for p in resumed) == 1


def test_rate_gate_keeps_at_most_two_batches_ahead_of_the_trainer() -> None:
    cfg = config(
        trainer=TrainerConfig(groups_per_step=2), admission=AdmissionConfig(max_inflight_groups=16, max_lag=10)
    )
    out = decide_admission(started(cfg), AdmissionInputs(now=0.0, prompts=PROMPTS))
    assert sum(isinstance(p, ev.GroupAdmitted) for p in out) == 4


def test_admission_is_silent_while_an_update_holds_it() -> None:
    cfg = config()
    state = fold_all(started(cfg), [ev.AdmissionPaused(reason=AdmissionReason.UPDATE)])
    assert decide_admission(state, AdmissionInputs(now=0.0, prompts=PROMPTS)) == []


def test_remaining_tokens_estimate() -> None:
    g = GroupState("g", "p", 4, 4, PolicyKind.ALL, "e", 0, 8, 100, 4)
    g.samples = {
        0: SampleState("g/0", 0, SampleStatus.FINISHED, 0, 0),
        1: SampleState("g/1", 1, SampleStatus.STARTED, 0, 0),
    }
    assert remaining_tokens(g, 3) == 9


# ---------------------------------------------------------------- partial policies
def group(kind: str, n: int, k: int | None, statuses: list[str]) -> GroupState:
    g = GroupState(
        "g1", "p", n, PartialPolicy(kind=PolicyKind(kind), k=k).required(n), PolicyKind(kind), "e", 0, 8, 100, 4
    )
    for i, s in enumerate(statuses):
        g.samples[i] = SampleState(f"g1/{i}", i, SampleStatus(s), 0, 0, tokens=3)
    g.status = GroupStatus.GENERATING
    return g


@pytest.mark.parametrize(
    ("kind", "k", "statuses", "expected"),
    [
        ("all", None, ["finished", "finished", "started"], None),
        ("all", None, ["finished", "finished", "finished"], ("complete", 3)),
        ("all", None, ["finished", "failed", "started"], "cancelled"),
        ("at_least", 2, ["finished", "finished", "started"], None),  # waits for every sample to end
        ("at_least", 2, ["finished", "failed", "finished"], ("partial", 2)),
        ("at_least", 2, ["failed", "failed", "started"], "cancelled"),
        ("first_k", 2, ["started", "finished", "finished"], ("partial", 2)),
        ("first_k", 2, ["finished", "started", "started"], None),
    ],
)
def test_partial_policy_semantics(kind: str, k: int | None, statuses: list[str], expected: object) -> None:
    decision = decide_group(group(kind, 3, k, statuses), now=0.0, deadline=None)
    if expected is None:
        assert decision is None
    elif expected == "cancelled":
        assert isinstance(decision, ev.GroupCancelled)
    else:
        assert isinstance(decision, ev.GroupCompleted)
        assert (decision.status, len(decision.accepted)) == expected
        assert all(
            decision.accepted[i] in {f"g1/{j}" for j, s in enumerate(statuses) if s == "finished"}
            for i in range(len(decision.accepted))
        )


def test_first_k_accepts_the_first_k_finished_in_index_order() -> None:
    decision = decide_group(
        group("first_k", 4, 2, ["finished", "started", "finished", "finished"]), now=0.0, deadline=None
    )
    assert isinstance(decision, ev.GroupCompleted) and decision.accepted == ("g1/0", "g1/2")


def test_deadline_completes_a_group_with_k_and_cancels_one_without() -> None:
    enough = decide_group(group("at_least", 3, 1, ["finished", "started", "started"]), now=10.0, deadline=5.0)
    assert isinstance(enough, ev.GroupCompleted) and enough.status == "partial"
    short = decide_group(group("all", 3, None, ["finished", "started", "started"]), now=10.0, deadline=5.0)
    assert isinstance(short, ev.GroupCancelled) and "deadline" in short.reason
    assert decide_group(group("all", 3, None, ["finished", "started", "started"]), now=1.0, deadline=5.0) is None


# ---------------------------------------------------------------- weight-update transaction
def staged(ranks: int = 2) -> tuple[LogBuilder, RunState]:
    b = LogBuilder(ranks=ranks).start_run().stage(1)
    return b, replay(b.build())


def test_staged_update_asks_every_rank_in_service_to_prepare() -> None:
    _, state = staged()
    out = decide_update(state, now=100.0, fence=7)
    assert len(out) == 1 and isinstance(out[0], ev.PrepareRequested)
    assert out[0].ranks == (0, 1) and out[0].fence == 7 and out[0].deadline > 100.0


def test_commit_only_after_every_rank_prepared_and_drained() -> None:
    _, state = staged()
    fold_all(state, decide_update(state, 100.0, 7))
    fold_all(state, [ev.RankPrepared(version=1, rank=0, manifest_digest="m0001", staged_digest="w0001")])
    assert decide_update(state, 101.0, 7) == []  # rank 1 still preparing
    fold_all(state, [ev.RankPrepared(version=1, rank=1, manifest_digest="m0001", staged_digest="w0001")])
    pause = decide_update(state, 102.0, 7)
    assert [(type(p).__name__, getattr(p, "reason", None)) for p in pause] == [("AdmissionPaused", "update")]
    fold_all(state, pause)
    assert decide_update(state, 103.0, 7) == []  # ranks have not drained yet
    fold_all(state, [ev.EnginePaused(rank=0, mode=DrainMode.WAIT), ev.EnginePaused(rank=1, mode=DrainMode.WAIT)])
    commit = decide_update(state, 104.0, 7)
    assert isinstance(commit[0], ev.UpdateCommitted) and commit[0].ranks == (0, 1) and commit[0].fence == 7


def test_any_prepare_failure_aborts_and_nothing_commits() -> None:
    _, state = staged()
    fold_all(state, decide_update(state, 100.0, 7))
    fold_all(
        state,
        [
            ev.RankPrepared(version=1, rank=0, manifest_digest="m0001", staged_digest="w0001"),
            ev.RankPrepareFailed(
                version=1, rank=1, phase=PreparePhase.TRANSFER, tensor="model.norm.weight", reason="checksum"
            ),
        ],
    )
    out = decide_update(state, 101.0, 7)
    assert isinstance(out[0], ev.UpdateAborted) and out[0].failed_ranks == (1,)
    assert out[1:] == [  # the rank that failed leaves service with the abort (it rejoins on the published weights)
        ev.RankQuarantined(rank=1, version=1, reason=f"v1 aborted: {out[0].reason}")
    ]
    fold_all(state, out)
    assert state.policy_version == 0 and all(r.committed_version == 0 for r in state.ranks.values())


def test_prepare_deadline_aborts() -> None:
    _, state = staged()
    fold_all(state, decide_update(state, 100.0, 7))
    deadline = state.updates[1].deadline
    assert decide_update(state, deadline - 1, 7) == []
    out = decide_update(state, deadline + 1, 7)
    assert isinstance(out[0], ev.UpdateAborted) and "deadline" in out[0].reason


def test_a_new_coordinator_aborts_an_undecided_transaction_at_its_deadline_never_commits_it() -> None:
    _, state = staged(1)
    fold_all(state, decide_update(state, 100.0, fence=7))
    fold_all(state, [ev.RankPrepared(version=1, rank=0, manifest_digest="m0001", staged_digest="w0001")])
    assert decide_update(state, 101.0, fence=8) == []
    out = decide_update(state, state.updates[1].deadline + 1, fence=8)
    assert isinstance(out[0], ev.UpdateAborted) and out[0].fence == 8


def committed(ranks: int = 2) -> RunState:
    b = LogBuilder(ranks=ranks).start_run()
    b.stage(1).request_prepare(1)
    for r in range(ranks):
        b.prepare(1, r)
    b.pause(AdmissionReason.UPDATE).commit(1)
    return replay(b.build())


def test_publish_after_every_rank_swapped_and_passed_health() -> None:
    state = committed()
    fold_all(
        state,
        [
            ev.RankCommitted(version=1, rank=0, weights_digest="w0001"),
            ev.HealthPassed(rank=0, version=1, weights_digest="w0001", probe_digest="p"),
        ],
    )
    assert decide_update(state, 100.0, 1) == []
    fold_all(
        state,
        [
            ev.RankCommitted(version=1, rank=1, weights_digest="w0001"),
            ev.HealthPassed(rank=1, version=1, weights_digest="w0001", probe_digest="p"),
        ],
    )
    out = decide_update(state, 100.0, 1)
    assert isinstance(out[0], ev.PolicyPublished) and out[0].ranks == (0, 1) and out[0].weights_digest == "w0001"
    fold_all(state, out)
    assert decide_update(state, 100.0, 1) == [ev.AdmissionResumed(reason=AdmissionReason.UPDATE)]


def test_a_rank_with_the_wrong_digest_or_a_stale_probe_is_quarantined_and_the_rest_publish() -> None:
    state = committed(3)
    fold_all(state, [ev.RankCommitted(version=1, rank=r, weights_digest="w0001") for r in range(3)])
    fold_all(
        state,
        [
            ev.HealthPassed(rank=r, version=1, weights_digest="w0001", probe_digest="old" if r == 2 else "new")
            for r in range(3)
        ],
    )
    out = decide_update(state, 100.0, 1)
    assert [(type(p).__name__, getattr(p, "rank", None)) for p in out] == [("RankQuarantined", 2)]
    fold_all(state, out)
    publish = decide_update(state, 100.0, 1)
    assert isinstance(publish[0], ev.PolicyPublished) and publish[0].ranks == (0, 1)


# ---------------------------------------------------------------- the run waits for its ranks
def test_nothing_is_decided_until_every_rank_joined_and_a_missing_rank_fails_the_run() -> None:
    from rolledger.workflows.coordinator import decide

    b = LogBuilder(ranks=2).start_run(join_ranks=False)
    b.join(0)
    state = replay(b.build())
    inputs = AdmissionInputs(now=state.first_wall_time + 1, prompts=PROMPTS)
    assert decide(state, inputs.now, 1, inputs) == []
    late = AdmissionInputs(now=state.first_wall_time + 601, prompts=PROMPTS)
    out = decide(state, late.now, 1, late)
    assert isinstance(out[0], ev.RunFinished) and out[0].status == "failed" and "[1]" in out[0].reason
    fold_all(state, [ev.RankJoined(rank=1, engine="torch", policy_version=0, weights_digest="w0000")])
    assert any(isinstance(p, ev.GroupAdmitted) for p in decide(state, inputs.now, 1, inputs))


def test_the_rate_throttle_follows_the_measured_generation_latency_and_trainer_step_time() -> None:
    """Little's law: with groups taking three trainer steps to generate, three batches must be in flight for one to
    be ready at every step, so the cap is four batches ahead (one being trained on); bounded by the lag cap."""
    cfg = config(trainer=TrainerConfig(groups_per_step=2), admission=AdmissionConfig(max_lag=5, max_inflight_groups=64))
    b = LogBuilder(cfg).start_run()
    b.admit()  # at t0
    gid = b.last_group
    for i in range(2):
        b.start(f"{gid}/{i}")
    for i in range(2):
        b.finish(f"{gid}/{i}")
    b.complete(gid)
    b.stage(1)
    b.request_prepare(1).prepare(1, 0).commit(1).publish(1)
    events = b.build()
    t0 = next(e.wall_time for e in events if isinstance(e.payload, ev.GroupAdmitted))
    latency, train_s, update_s = 30.0, 6.0, 4.0  # W = 30 s, T = 6 + 4 = 10 s: ceil(W / T) = 3 batches in flight
    timed = []
    for e in events:
        p = e.payload
        t = e.wall_time
        if isinstance(p, ev.GroupCompleted):
            t = t0 + latency
        elif isinstance(p, ev.UpdateStaged):
            t = t0 + latency + 1.0
        elif isinstance(p, ev.PolicyPublished):
            t = t0 + latency + 1.0 + update_s
        timed.append(msgspec.structs.replace(e, wall_time=t))
    step = make_event(
        ev.TrainStepFinished(
            step=1,
            loss=0.0,
            reward_mean=0.0,
            logprob_gap_median=0.0,
            logprob_gap_p99=0.0,
            max_seq_ratio=1.0,
            clipped_frac=0.0,
            train_ms=train_s * 1e3,
        ),
        run_id="r",
        producer="trainer",
        policy_version=0,
        wall_time=t0 + latency + 1.0,
    )
    staged = next(i for i, e in enumerate(timed) if isinstance(e.payload, ev.UpdateStaged))
    state = replay([*timed[:staged], step, *timed[staged:]])
    assert state.admission.gen_latency_s == pytest.approx(latency)
    assert state.admission.step_busy_s == pytest.approx(train_s + update_s)
    assert gates(state, cfg, 0, 0).rate_cap == 2 * (1 + 3)
    out = decide_admission(state, AdmissionInputs(now=0.0, prompts=PROMPTS))
    assert sum(isinstance(p, ev.GroupAdmitted) for p in out) == 2 * (1 + 3) - 1  # the completed group is untrained
    # the lag cap bounds the batches in flight: max_lag + 1
    tight = cfg.model_copy(update={"admission": cfg.admission.model_copy(update={"max_lag": 1})})
    assert gates(state, tight, 0, 0).rate_cap == 2 * (1 + 2)
    # before anything is measured: two batches
    assert gates(started(cfg), cfg, 0, 0).rate_cap == 2 * 2


def _stale_cancels(b: LogBuilder) -> list[tuple[str, str]]:
    return [
        (p.group_id, p.reason) for p in decide_groups(replay(b.build()), now=0.0) if isinstance(p, ev.GroupCancelled)
    ]


def test_an_open_group_that_can_no_longer_be_trained_is_cancelled_as_stale() -> None:
    """max_lag 1. A group whose first sample finished on v0 is trainable while v1 is published and doomed once v2 is
    (the trainer would drop it for lag): it is cancelled then, not generated to the end. Under first 1 of 2, a group
    with a sample not yet started can still give a sample within the cap, so it stays; a group started on v1 stays."""
    b = LogBuilder(group_size=2)
    b.start_run()
    b.admit("g-old")
    b.start("g-old/0").start("g-old/1").finish("g-old/0")
    b.update()
    assert _stale_cancels(b) == []  # v1 published: tokens of v0 are within max_lag 1
    b.update()
    [(gid, why)] = _stale_cancels(b)
    assert gid == "g-old" and "v2 is published and max_lag is 1" in why and "tokens of v0" in why

    k = LogBuilder(group_size=2, partial_policy={"kind": "first_k", "k": 1})
    k.start_run()
    k.admit("g-both").start("g-both/0").start("g-both/1")  # both started on v0, none finished
    k.admit("g-one").start("g-one/0")  # its second sample has not started: it would start on a version in the cap
    k.update()
    k.admit("g-new").start("g-new/0").start("g-new/1")  # started on v1
    k.update()
    cancels = _stale_cancels(k)
    assert [gid for gid, _ in cancels] == ["g-both"]
    assert "only 0 of the 1 required samples can be newer" in cancels[0][1]


def _youngest_cancel_log(scheduler: str) -> LogBuilder:
    """groups_per_step 2, so the throttle's cap is 4 before the drain rate is measured; six groups untrained: g0
    completed (waiting for the trainer), g1-g5 open, admitted in that order."""
    b = LogBuilder(group_size=2, scheduler=scheduler, trainer=TrainerConfig(groups_per_step=2))
    b.start_run()
    b.admit("g0").start("g0/0").start("g0/1").finish("g0/0").finish("g0/1").complete("g0")
    for gid in ("g1", "g2", "g3", "g4", "g5"):
        b.admit(gid)
    return b


def test_youngest_cancel_cancels_the_newest_open_groups_down_to_the_throttle_cap() -> None:
    """prime-rl's overload policy. Six untrained groups against a cap of four: the two admitted last are cancelled,
    naming the overload; the completed group counts but is never a candidate. FIFO and SRGF cancel nothing (they
    only stop admitting). A group the same round cancels for another reason is not counted: one youngest goes, not
    two. Once the excess is cancelled nothing more is."""
    for scheduler in ("fifo", "srgf"):
        assert decide_groups(replay(_youngest_cancel_log(scheduler).build()), now=0.0) == []

    b = _youngest_cancel_log("youngest-cancel")
    out = decide_groups(replay(b.build()), now=0.0)
    assert [p.group_id for p in out if isinstance(p, ev.GroupCancelled)] == ["g5", "g4"] and len(out) == 2
    assert all(
        isinstance(p, ev.GroupCancelled) and "6 untrained groups > the throttle's cap 4" in p.reason for p in out
    )
    assert decide_groups(fold_all(replay(b.build()), out), now=0.0) == []

    b.start("g1/0").fail("g1/0")  # all 2 of 2 required: g1 can no longer complete, so this round cancels it
    out = decide_groups(replay(b.build()), now=0.0)
    cancelled = [(p.group_id, p.reason) for p in out if isinstance(p, ev.GroupCancelled)]
    assert [gid for gid, _ in cancelled] == ["g1", "g5"] and len(out) == 2
    assert "5 untrained groups > the throttle's cap 4" in cancelled[1][1]


def test_youngest_cancel_needs_the_rate_throttle() -> None:
    with pytest.raises(ValidationError, match="'youngest-cancel' needs admission.throttle_to_drain_rate"):
        RunConfig(scheduler="youngest-cancel", admission=AdmissionConfig(throttle_to_drain_rate=False))
