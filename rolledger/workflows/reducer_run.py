"""The reducer's run and admission events: RunStarted/RunFinished, WorkerLost, GroupAdmitted, AdmissionPaused/Resumed."""

from __future__ import annotations

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason, RunStatus
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.reducer_common import anomaly
from rolledger.workflows.scheduler import admit_index
from rolledger.workflows.state import GroupState, RunState

handlers: Handlers[RunState, None] = Handlers("reducer: run and admission")


@handlers.on(ev.RunStarted)
def _run_started(s: RunState, e: ev.Event, p: ev.RunStarted) -> None:
    if s.status != RunStatus.PENDING:
        anomaly(s, e, f"RunStarted while the run is {s.status}")
        return
    s.run_id, s.config, s.status, s.started_event = e.run_id, p.config, RunStatus.RUNNING, e.event_id
    s.weights_digest = p.initial_weights_digest


@handlers.on(ev.RunFinished)
def _run_finished(s: RunState, e: ev.Event, p: ev.RunFinished) -> None:
    if s.status.is_terminal:  # a second end (a duplicate, or two deciders) does not rewrite the first
        anomaly(s, e, f"a second end ({p.status}) after the run already finished ({s.status}); not applied")
        return
    if s.status != RunStatus.RUNNING:
        anomaly(s, e, f"RunFinished while the run is {s.status}")
    s.status = p.status


@handlers.on(ev.GroupAdmitted)
def _group_admitted(s: RunState, e: ev.Event, p: ev.GroupAdmitted) -> None:
    if p.group_id in s.groups or p.group_id in s.retired:
        anomaly(s, e, f"group {p.group_id} admitted twice")
        return
    if s.admission.paused:
        anomaly(s, e, f"group {p.group_id} admitted while admission is paused ({', '.join(s.admission.paused)})")
    s.groups[p.group_id] = GroupState(
        group_id=p.group_id,
        prompt_id=p.prompt_id,
        n=p.n,
        required=p.partial_policy.required(p.n),
        policy_kind=p.partial_policy.kind,
        admitted_event=e.event_id,
        admitted_version=e.policy_version,
        est_remaining_tokens=p.est_remaining_tokens,
        est_bytes=p.est_bytes,
        prompt_tokens=len(p.prompt_token_ids),
        deadline=p.deadline,
        admitted_at=e.wall_time,
    )
    # a log written before GroupAdmitted carried its prompt's index admitted in index order: its count is the index
    admit_index(s.scheduler, p.prompt_index if p.prompt_index is not None else s.admission.admitted)
    s.admission.admitted += 1
    s.admission.inflight += 1


@handlers.on(ev.AdmissionPaused)
def _admission_paused(s: RunState, e: ev.Event, p: ev.AdmissionPaused) -> None:
    if p.reason in s.admission.paused:
        anomaly(s, e, f"admission already paused for {p.reason}")
        return
    s.admission.paused.append(p.reason)
    if p.reason == AdmissionReason.UPDATE and (u := s.open_update) is not None:
        u.paused_at, u.paused_event = e.wall_time, e.event_id
    if p.reason == AdmissionReason.HANDOFF:
        s.admission.handoff_step, s.admission.handoff_event = s.trainer.step, e.event_id


@handlers.on(ev.AdmissionResumed)
def _admission_resumed(s: RunState, e: ev.Event, p: ev.AdmissionResumed) -> None:
    if p.reason not in s.admission.paused:
        anomaly(s, e, f"admission resumed for {p.reason} but it was not paused for it")
        return
    s.admission.paused.remove(p.reason)


@handlers.on(ev.WorkerLost)
def _worker_lost(s: RunState, e: ev.Event, p: ev.WorkerLost) -> None:
    """A fact the driver records; the coordinator decides the run's end on it."""
    s.workers_lost[p.worker] = p.error
