"""The colocated handoff coordinator: `decide_handoff(state) -> [payloads]`, pure.

In colocated mode the trainer and the engines take turns on the same memory. One handoff:
  AdmissionPaused(handoff) when the trainer has a batch ready -> every rank drains and sleeps (EngineSlept, release
  verified by measured memory) -> the trainer's phase (it trains only while every rank sleeps) -> UpdateStaged ->
  each rank wakes its weights (EngineWoke weights) and the weight-update transaction runs (never while the weights
  sleep) -> each rank wakes its KV cache (EngineWoke kv_cache), resets the prefix cache, runs the health probe ->
  PolicyPublished -> ranks resume -> AdmissionResumed(handoff).
The handoff closes once the trainer has taken its step, no update is open, and every rank in service is awake.
Every stage is an event with its wall time, so the timeline and the duty-cycle tax come from the log.
"""

from __future__ import annotations

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason, EngineStatus, RunStatus
from rolledger.workflows.state import RunState, group_lag


def decide_handoff(state: RunState) -> list[ev.Payload]:
    cfg = state.config
    if cfg is None or cfg.mode != "colocated" or state.status != RunStatus.RUNNING:
        return []
    ranks = [r for r in state.ranks.values() if r.status.in_service]
    if AdmissionReason.HANDOFF not in state.admission.paused:
        # only groups the trainer will keep: one it drops for lag during the handoff trains nothing, and a handoff
        # whose batch is all dropped would leave every engine asleep with nothing to train on (the trainer waits for
        # groups that no sleeping engine can generate). The lag cannot change before the step: no publish comes
        # between the handoff's start and its training step.
        fresh = [g for g in state.ready_groups() if group_lag(state, g) <= cfg.admission.max_lag]
        ready = len(fresh) >= cfg.trainer.groups_per_step
        idle = state.open_update is None and all(r.status == EngineStatus.AWAKE for r in ranks)
        if ready and idle and state.trainer.step < cfg.steps:
            return [
                ev.AdmissionPaused(
                    reason=AdmissionReason.HANDOFF,
                    queued_bytes=state.admission.queued_bytes,
                    lag=state.lag,
                    detail=f"trainer step {state.trainer.step + 1}: engines sleep (level {cfg.sleep_level})",
                )
            ]
        return []
    trained = state.trainer.step > state.admission.handoff_step
    if trained and state.open_update is None and all(r.status == EngineStatus.AWAKE for r in ranks):
        return [ev.AdmissionResumed(reason=AdmissionReason.HANDOFF)]
    return []


def engines_asleep(state: RunState) -> bool:
    """The trainer's turn: a handoff is open and every rank in service sleeps."""
    ranks = [r for r in state.ranks.values() if r.status.in_service]
    return (
        AdmissionReason.HANDOFF in state.admission.paused
        and bool(ranks)
        and all(r.status == EngineStatus.ASLEEP for r in ranks)
    )
