"""The coordinator's decider: from the folded state (and the clock, as an input) to the decisions it appends.

Owns the one place where a run ends: `RunFinished` of every status, and the run halt (`AdmissionPaused(manual)`),
are produced here and nowhere else. Workers append facts (`TrainStepRefused`: the trainer would not train on weights
that did not arrive; `WorkerLost`: a crashed worker nothing restarts), and `decide_terminal` turns them into the
run's end; the coordinator worker appends that under its lease with `append_if`, like every other decision.

- `decide_terminal(state, now)`: the run ends now (failed: a refused step, a lost worker, ranks that never joined,
  `update.max_consecutive_aborts` updates aborted in a row with none published between, or no rank in service for
  `recovery.no_rank_in_service_s` since the last one was quarantined; aborted: the run deadline
  `config.run_deadline_s` after RunStarted passed). Each reason names its cause (the aborted versions and why, the
  quarantined ranks). With the lag gate measured against settled progress (workflows/admission.py), quarantine of
  the ranks that made an update abort (workflows/update.py) and these two terminals, every RUNNING state has a way
  forward: the next update, a rank rejoining, or the run's end (tests/test_liveness_properties.py checks it). A driver that must finish a run
  without a live coordinator uses this part alone, through the same fenced path.
- `decide_run_end(state)`: the orderly end once the last step is taken: cancel what is in flight, then completed.
- `decide_cancel(state, reason)`: the operator stopped the run (SIGTERM/SIGINT of `rolledger run`): cancelled now.
- `decide(state, now, fence, inputs)`: every decision on this state, in priority order.
- `DURABLE_DECISIONS`: decisions whose loss in a host crash would let a restarted coordinator decide differently.
"""

from __future__ import annotations

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason, EngineStatus, RunStatus, SampleStatus, UpdateStatus
from rolledger.workflows.admission import AdmissionInputs, decide_admission
from rolledger.workflows.groups import decide_groups
from rolledger.workflows.handoff import decide_handoff
from rolledger.workflows.state import RunState, UpdateState
from rolledger.workflows.update import decide_update

DURABLE_DECISIONS: tuple[type[ev.Payload], ...] = (ev.UpdateCommitted, ev.UpdateAborted, ev.PolicyPublished)


def _halt(state: RunState, reason: str) -> list[ev.Payload]:
    """Close admission for good (unless already closed manually), then fail the run."""
    out: list[ev.Payload] = []
    if AdmissionReason.MANUAL not in state.admission.paused:
        out.append(ev.AdmissionPaused(reason=AdmissionReason.MANUAL, detail=reason))
    out.append(ev.RunFinished(status=RunStatus.FAILED, reason=reason, steps=state.trainer.step))
    return out


def decide_terminal(state: RunState, now: float) -> list[ev.Payload]:
    """The run must end now, whatever else is open: a fact says it cannot go on, or its deadline passed."""
    cfg = state.config
    if state.status != RunStatus.RUNNING or cfg is None:
        return []
    if state.trainer.refused:
        return _halt(state, state.trainer.refused)
    if state.workers_lost:
        name, error = next(iter(state.workers_lost.items()))
        return [
            ev.RunFinished(status=RunStatus.FAILED, reason=f"worker {name} crashed: {error}", steps=state.trainer.step)
        ]
    missing = [r for r in range(cfg.ranks) if r not in state.ranks]
    if missing and now > state.first_wall_time + cfg.join_deadline_s:
        return [
            ev.RunFinished(
                status=RunStatus.FAILED, reason=f"ranks {missing} did not join within {cfg.join_deadline_s:g} s"
            )
        ]
    if state.reward_failures_in_a_row >= cfg.task.max_consecutive_reward_failures:
        return _halt(
            state,
            f"{state.reward_failures_in_a_row} samples in a row could not be scored "
            f"(task.max_consecutive_reward_failures; last: {state.last_reward_failure})",
        )
    aborts = consecutive_aborts(state)
    if len(aborts) >= cfg.update.max_consecutive_aborts:
        causes = "; ".join(f"v{u.version}: {u.abort_reason}" for u in aborts)
        return _halt(state, f"{len(aborts)} updates aborted in a row ({causes})")
    if not missing and not any(r.status.in_service for r in state.ranks.values()):
        since = max(r.quarantined_at for r in state.ranks.values())
        if now > since + cfg.recovery.no_rank_in_service_s:
            ranks = sorted(state.ranks)
            return _halt(
                state, f"no rank in service for {cfg.recovery.no_rank_in_service_s:g} s (ranks {ranks} quarantined)"
            )
    if now > state.first_wall_time + cfg.run_deadline_s:
        return [ev.RunFinished(status=RunStatus.ABORTED, reason="run deadline passed", steps=state.trainer.step)]
    return []


def decide_cancel(state: RunState, reason: str) -> list[ev.Payload]:
    """The run is stopped from outside (a signal to its driver): close admission, then RunFinished(cancelled)."""
    if state.status != RunStatus.RUNNING:
        return []
    out: list[ev.Payload] = []
    if AdmissionReason.MANUAL not in state.admission.paused:
        out.append(ev.AdmissionPaused(reason=AdmissionReason.MANUAL, detail=reason))
    out.append(ev.RunFinished(status=RunStatus.CANCELLED, reason=reason, steps=state.trainer.step))
    return out


def consecutive_aborts(state: RunState) -> list[UpdateState]:
    """The aborted updates since the last published one, oldest first (an open transaction is not counted)."""
    run: list[UpdateState] = []
    for v in sorted(state.updates, reverse=True):
        u = state.updates[v]
        if u.status == UpdateStatus.ABORTED:
            run.append(u)
        elif u.status == UpdateStatus.PUBLISHED:
            break
    return run[::-1]


def decide_run_end(state: RunState) -> list[ev.Payload]:
    """Once the trainer has taken its last step and no update is open: cancel what is still in flight, then finish."""
    cfg = state.config
    if (
        cfg is None
        or state.status != RunStatus.RUNNING
        or state.trainer.step < cfg.steps
        or state.open_update is not None
    ):
        return []
    out: list[ev.Payload] = []
    if AdmissionReason.MANUAL not in state.admission.paused:
        out.append(ev.AdmissionPaused(reason=AdmissionReason.MANUAL, detail="run reached its last step"))
    if any(r.status is EngineStatus.ASLEEP for r in state.ranks.values()):
        return out  # a colocated rank is still waking up after the last update
    open_groups = [g for g in state.groups.values() if g.status.is_open]
    for g in open_groups:
        out.append(ev.GroupCancelled(group_id=g.group_id, reason="run finished"))
    unsettled = bool(state.raced)  # samples started on a group retired just before (workflows/reducer_rollout.py)
    unsettled |= any(s.status is SampleStatus.STARTED for g in state.groups.values() for s in g.samples.values())
    unsettled |= any(
        r.status is EngineStatus.PAUSED for r in state.ranks.values()
    )  # let ranks resume after the last publish
    if not open_groups and not unsettled:
        out.append(ev.RunFinished(status=RunStatus.COMPLETED, steps=state.trainer.step))
    return out


def decide(state: RunState, now: float, fence: int, inputs: AdmissionInputs) -> list[ev.Payload]:
    """Every coordinator's decision on this state, in priority order (the run's end forced by a fact or the clock,
    updates, groups, the handoff, the run's orderly end, admission)."""
    if state.status != RunStatus.RUNNING or state.config is None:
        return []
    terminal = decide_terminal(state, now)
    if terminal:
        return terminal
    if any(r not in state.ranks for r in range(state.config.ranks)):
        return []  # nothing is admitted or updated before every rank has joined: a run on fewer ranks is another run
    out: list[ev.Payload] = decide_update(state, now, fence)
    closing = decide_groups(state, now)
    out += closing
    out += decide_handoff(state)
    # the run's end cancels every open group: not in the decision that closes some of them (completed, or cancelled
    # for a deadline or as stale), or a group would be closed twice; it comes once those are folded
    end = [] if closing else decide_run_end(state)
    out += end
    if not out and not end:
        out += decide_admission(state, inputs)
    return out
