"""Closed statuses and the one dispatch style: wire values unchanged, predicates equal to the sets they replaced,
state digests unchanged for a fixed log, and the dispatch registry's rules."""

from __future__ import annotations

import json
from enum import StrEnum

import pytest
from logbuilder import LogBuilder, payload_of

from rolledger.events.codec import decode, encode
from rolledger.schemas import events as ev
from rolledger.schemas.config import PartialPolicy, RunConfig
from rolledger.schemas.statuses import (
    AdmissionReason,
    CacheKind,
    DrainMode,
    DropReason,
    EngineStatus,
    GroupOutcome,
    GroupStatus,
    LogprobMode,
    PolicyKind,
    PreparePhase,
    RunStatus,
    SampleStatus,
    UpdateStatus,
    WakeTag,
)
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.reducer import HANDLERS, replay
from rolledger.workflows.state import RunState

# ---------------------------------------------------------------- wire values
WIRE: dict[type[StrEnum], list[str]] = {
    RunStatus: ["pending", "running", "completed", "failed", "aborted", "cancelled"],
    GroupStatus: ["admitted", "generating", "complete", "partial", "cancelled", "scored", "consumed", "dropped"],
    SampleStatus: ["started", "finished", "failed", "cancelled"],
    UpdateStatus: ["staged", "preparing", "committed", "aborted", "invalidated", "healthy", "published"],
    EngineStatus: ["awake", "paused", "asleep", "quarantined"],
    AdmissionReason: ["bytes", "lag", "update", "handoff", "manual", "rate"],
    DrainMode: ["abort", "wait", "keep"],
    PreparePhase: ["prepare", "transfer", "commit"],
    CacheKind: ["prefix", "kv", "graph", "encoder"],
    DropReason: ["lag", "mixed_versions", "quarantined_rank"],
    GroupOutcome: ["complete", "partial"],
    WakeTag: ["weights", "kv_cache"],
    LogprobMode: ["raw", "processed"],
    PolicyKind: ["all", "at_least", "first_k"],
}


@pytest.mark.parametrize("enum", list(WIRE), ids=lambda e: e.__name__)
def test_every_member_is_its_wire_string(enum: type[StrEnum]) -> None:
    assert [m.value for m in enum] == WIRE[enum]
    for m in enum:
        assert m == m.value and f"{m}" == m.value and json.dumps(m) == json.dumps(m.value)


def test_predicates_are_the_sets_they_replaced() -> None:
    def having(enum: type[StrEnum], pred: str) -> set[str]:
        return {m.value for m in enum if getattr(m, pred)}

    assert having(RunStatus, "is_terminal") == {"completed", "failed", "aborted", "cancelled"}
    assert having(GroupStatus, "is_open") == {"admitted", "generating"}
    assert having(GroupStatus, "is_completed") == {"complete", "partial"}
    assert having(GroupStatus, "is_queued") == {"complete", "partial", "scored"}
    assert having(GroupStatus, "is_terminal") == {"consumed", "dropped", "cancelled"}
    assert having(GroupStatus, "is_untrained") == set(WIRE[GroupStatus]) - {"consumed", "dropped", "cancelled"}
    assert having(SampleStatus, "is_terminal") == {"finished", "failed", "cancelled"}
    assert having(UpdateStatus, "is_undecided") == {"staged", "preparing"}
    assert having(UpdateStatus, "is_swappable") == {"committed", "invalidated", "healthy"}
    assert having(UpdateStatus, "is_decided_commit") == {"committed", "invalidated", "healthy", "published"}
    assert having(UpdateStatus, "is_open") == set(WIRE[UpdateStatus]) - {"aborted", "published"}
    assert having(EngineStatus, "is_stopped") == {"paused", "asleep"}
    assert having(EngineStatus, "in_service") == {"awake", "paused", "asleep"}
    assert having(CacheKind, "is_token_cache") == {"prefix", "kv"}
    assert having(CacheKind, "is_graph") == {"graph"}


def test_old_wire_strings_decode_to_members_and_encode_back_unchanged() -> None:
    b = LogBuilder()
    payloads: list[ev.Payload] = [
        ev.RunFinished(status=RunStatus.ABORTED),
        ev.AdmissionPaused(reason=AdmissionReason.RATE),
        ev.RankPrepareFailed(version=1, rank=0, phase=PreparePhase.TRANSFER, reason="x"),
        ev.CacheInvalidated(rank=0, kind=CacheKind.KV, generation=1, version=1),
        ev.EngineWoke(rank=0, tags=(WakeTag.WEIGHTS, WakeTag.KV_CACHE)),
        ev.EnginePaused(rank=0, mode=DrainMode.KEEP),
        ev.TrajectoryDropped(group_id="g", trajectory_ids=(), reason=DropReason.QUARANTINED_RANK),
        ev.RankJoined(rank=0, engine="torch", policy_version=0, weights_digest="w", logprob_mode=LogprobMode.PROCESSED),
    ]
    for p in payloads:
        b.emit(p)
    for e in b.build():
        back = decode(encode(e))
        assert back == e and encode(back) == encode(e)
    assert payload_of(decode(encode(b.build()[0])), ev.RunFinished).status is RunStatus.ABORTED
    assert ev.EngineWoke(rank=0, tags=(WakeTag.WEIGHTS,)).tags == (WakeTag.WEIGHTS,)


def test_a_run_finishes_only_on_a_terminal_status() -> None:
    for status in ("pending", "running", "bogus"):
        with pytest.raises(ValueError):
            ev.RunFinished(status=RunStatus(status))


# ---------------------------------------------------------------- digests
def golden_log() -> list[ev.Event]:
    """Every status, reason, kind, phase, mode and tag the reducer folds, in one valid log."""
    b = LogBuilder(RunConfig(group_size=2, ranks=2, partial_policy=PartialPolicy(kind="at_least", k=1))).start_run()
    b.group()
    g1 = b.last_group
    b.admit(n=2)
    g2 = b.last_group
    b.start(f"{g2}/0").start(f"{g2}/1").finish(f"{g2}/0").fail(f"{g2}/1")
    b.complete(g2, accepted=(f"{g2}/0",), status="partial")
    b.score(f"{g2}/0")
    b.admit(n=2)
    g3 = b.last_group
    b.start(f"{g3}/0").cancel(f"{g3}/0").cancel(f"{g3}/1")
    b.cancel_group(g3)
    b.emit(ev.AdmissionPaused(reason=AdmissionReason.BYTES, queued_bytes=10, detail="cap"))
    b.emit(ev.AdmissionResumed(reason=AdmissionReason.BYTES))
    b.consume([g1])
    b.update(1)
    b.update(2, fail_rank=1)
    b.emit(ev.AdmissionPaused(reason=AdmissionReason.HANDOFF))
    for r in (0, 1):
        b.emit(ev.EnginePaused(rank=r, mode=DrainMode.WAIT))
        b.emit(ev.EngineSlept(rank=r, level=1, bytes_freed=100, verified=True))
        b.emit(ev.EngineWoke(rank=r, tags=(WakeTag.WEIGHTS,)))
        b.emit(ev.EngineWoke(rank=r, tags=(WakeTag.KV_CACHE,)))
        b.emit(ev.CacheInvalidated(rank=r, kind=CacheKind.GRAPH, generation=3, version=1))
        b.emit(ev.CacheInvalidated(rank=r, kind=CacheKind.ENCODER, generation=4, version=1))
        b.emit(ev.EngineResumed(rank=r))
    b.emit(ev.AdmissionResumed(reason=AdmissionReason.HANDOFF))
    b.emit(ev.RankPrepareFailed(version=2, rank=0, phase=PreparePhase.COMMIT, reason="late"))
    b.drop(g2, reason="mixed_versions", lag=0)
    b.quarantine(1)
    b.emit(ev.CommandRefused(command="resume", reason="asleep", rank=0))
    b.emit(
        ev.RankJoined(rank=1, engine="torch", policy_version=1, weights_digest="w", logprob_mode=LogprobMode.PROCESSED)
    )
    return b.finish_run("aborted").build()


# The digest the reducer gives this log. It was first computed before statuses were StrEnums (6193d03a...: the enums
# serialise as their strings, so the move to enums left it unchanged); it moves only when RunState gains fields, and
# was recomputed then (the trainer's `refused`, the run's `workers_lost`, a rank's `drained_for`, `slept_in_handoff`
# and `wake_on_abort`; then the command ids the rank's causation ids come from: the run's `started_event`, an
# update's `prepare_event`, `paused_event` and `published_event`, admission's `handoff_event`, a rank's
# `abort_event` and `quarantined_event`; then the builder's steps numbered from 1, as the trainer numbers them,
# once TrainStepFinished is applied only as trainer.step + 1; then the recovery fields: a rank's `quarantined_at`, the
# run's `reclaimed` and `late_results`, the `recovery` config; then a rank's
# `incarnation`; then the update config's transport fields and `staging_fsync`; then the model config's
# `architecture`; then the task config's plug-in fields; then the trainer config's `importance`, `is_cap` and `checkpoint_every`;
# then the log config (archive); then the bounded live state of issue 12: retired groups leave `groups` for the
# `retired` tombstones and the `retired_digest` hash chain, with `retired_groups`, `after_retired`, `raced`,
# `recent_prompts` and admission's `gone_before_training`; the digest hashes the state less its two bounded windows,
# `retired` and `recent_prompts`); then the run config's `sglang_urls` (issue 17); then issue 14: the scheduler's
# state (frontier, observed lengths, estimate error; `recent_prompts` gone, the digest now leaves out `retired` only),
# the measured pace (a group's `admitted_at`, an update's `staged_at`, admission's `gen_latency_s`/`step_busy_s`, the
# trainer's `last_train_s`), and the config's `rank_slots`, `kv_cache_cap`, `admission.max_wait_rounds` and `simulated`
# section; then the trainer config's `overlap_update`; then the run config's `torch_engine` section (issue 14: the
# engine in a process of its own, max_batch_groups); then issue 12: a closed update's per-rank progress (prepared,
# committed, invalidated, healthy, probe digests) leaves the state when it closes; then issue 12 again: closed update
# records no decider reads retire to `retired_updates` tombstones, with the `updates_published`/`updates_aborted` counts;
# then issue 40: the task config's environment fields (`env`, `max_turns`, `max_episode_tokens`, `env_timeout_s`,
# `env_workers`).
GOLDEN_DIGEST = "a4ed22f7dd9071b36305b4e9da558a1b"


def test_state_digest_of_a_fixed_log_is_unchanged() -> None:
    state = replay(golden_log())
    assert state.anomalies == []
    assert state.digest() == GOLDEN_DIGEST


def test_serialised_state_holds_plain_strings_and_restores_members() -> None:
    state = replay(golden_log())
    data = state.to_dict()

    def walk(obj: object) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                assert type(k) in (str, int), k
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)
        else:
            assert type(obj) in (str, int, float, bool, type(None)), (obj, type(obj))

    walk(data)
    back = RunState.from_dict(json.loads(json.dumps(data)))
    assert back.digest() == state.digest() == GOLDEN_DIGEST
    assert back.status is RunStatus.ABORTED
    assert all(type(g.status) is GroupStatus and type(g.policy_kind) is PolicyKind for g in back.groups.values())
    assert all(type(s.status) is SampleStatus for g in back.groups.values() for s in g.samples.values())
    assert all(type(u.status) is UpdateStatus for u in back.updates.values())
    assert all(type(r.status) is EngineStatus and type(r.logprob_mode) is LogprobMode for r in back.ranks.values())


# ---------------------------------------------------------------- dispatch
def test_the_reducer_handles_every_payload_type() -> None:
    assert set(HANDLERS.table) == set(ev.PAYLOAD_TYPES.values())


def test_handlers_refuse_a_second_handler_and_skip_unhandled_types() -> None:
    h: Handlers[list[str], None] = Handlers("test")

    @h.on(ev.RunStarted)
    def _started(ctx: list[str], e: ev.Event, p: ev.RunStarted) -> None:
        ctx.append(p.initial_weights_digest)

    with pytest.raises(ValueError, match="already has a handler"):
        h.on(ev.RunStarted)(_started)
    seen: list[str] = []
    for e in LogBuilder().start_run().group().build():
        h.apply(seen, e)
    assert len(seen) == 1
    with pytest.raises(ImportError, match="no handler for"):
        h.require_all()
    with pytest.raises(ValueError, match="handled by two parts"):
        Handlers.merge("both", h, h)
