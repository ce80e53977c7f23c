"""The reducer's engine events: sleep and wake, pause and resume, ranks joining and quarantined, refusals."""

from __future__ import annotations

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason, EngineStatus, WakeTag
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.reducer_common import anomaly, find_rank
from rolledger.workflows.state import RankState, RunState

handlers: Handlers[RunState, None] = Handlers("reducer: engine")


@handlers.on(ev.EngineSlept)
def _engine_slept(s: RunState, e: ev.Event, p: ev.EngineSlept) -> None:
    r = find_rank(s, e, p.rank)
    if r is None:
        return
    if r.status == EngineStatus.ASLEEP:
        anomaly(s, e, f"rank {p.rank} slept twice")
    r.status, r.sleep_level, r.woke = EngineStatus.ASLEEP, p.level, []
    in_handoff = AdmissionReason.HANDOFF in s.admission.paused
    r.slept_in_handoff, r.wake_on_abort = s.admission.handoff_step if in_handoff else -1, False


@handlers.on(ev.EngineWoke)
def _engine_woke(s: RunState, e: ev.Event, p: ev.EngineWoke) -> None:
    r = find_rank(s, e, p.rank)
    if r is None:
        return
    if r.status != EngineStatus.ASLEEP:
        anomaly(s, e, f"rank {p.rank} woke while {r.status}")
        return
    for tag in p.tags:
        if tag == WakeTag.KV_CACHE and WakeTag.WEIGHTS not in r.woke and WakeTag.WEIGHTS not in p.tags:
            anomaly(s, e, f"rank {p.rank} woke kv_cache before weights")
        if tag not in r.woke:
            r.woke.append(tag)
    if WakeTag.WEIGHTS in r.woke and WakeTag.KV_CACHE in r.woke:
        r.status, r.sleep_level, r.woke, r.wake_on_abort = EngineStatus.PAUSED, 0, [], False


@handlers.on(ev.EnginePaused)
def _engine_paused(s: RunState, e: ev.Event, p: ev.EnginePaused) -> None:
    r = find_rank(s, e, p.rank)
    if r is None:
        return
    if r.status == EngineStatus.AWAKE:
        r.status = EngineStatus.PAUSED
    if (u := s.open_update) is not None and p.rank in u.ranks:
        r.drained_for = u.version


@handlers.on(ev.EngineResumed)
def _engine_resumed(s: RunState, e: ev.Event, p: ev.EngineResumed) -> None:
    r = find_rank(s, e, p.rank)
    if r is None:
        return
    if r.status == EngineStatus.ASLEEP:
        anomaly(s, e, f"rank {p.rank} resumed while asleep")
        return
    if r.status == EngineStatus.PAUSED:
        r.status = EngineStatus.AWAKE


@handlers.on(ev.RankJoined)
def _rank_joined(s: RunState, e: ev.Event, p: ev.RankJoined) -> None:
    r = s.ranks.get(p.rank)
    if r is None:
        r = s.ranks[p.rank] = RankState(p.rank, p.engine)
    elif r.status.in_service and p.incarnation == r.incarnation:
        anomaly(s, e, f"rank {p.rank} joined twice")  # a new incarnation (a restarted process) joins again, rightly
    r.status, r.engine, r.sleep_level, r.woke = EngineStatus.AWAKE, p.engine, 0, []
    r.drained_for = 0  # a new process drains for the open update itself: its predecessor's drain does not hold it
    r.incarnation = p.incarnation
    r.committed_version, r.weights_digest = p.policy_version, p.weights_digest
    r.sleep_levels, r.logprob_mode = list(p.sleep_levels), p.logprob_mode


@handlers.on(ev.RankQuarantined)
def _rank_quarantined(s: RunState, e: ev.Event, p: ev.RankQuarantined) -> None:
    r = find_rank(s, e, p.rank)
    if r is not None:
        r.status, r.quarantined_event, r.quarantined_at = EngineStatus.QUARANTINED, e.event_id, e.wall_time
    u = s.updates.get(p.version)
    if u is not None and p.rank not in u.quarantined:
        u.quarantined.append(p.rank)


@handlers.on(ev.CommandRefused)
def _command_refused(s: RunState, e: ev.Event, p: ev.CommandRefused) -> None:
    """Refusals change no state; they are counted in `counts` and explained by audit."""
