"""The trainer's decider: from the folded state to the next step's plan, and the agreement gate.

Owns every decision the trainer takes; `workers/roles/trainer.py` only does what a plan says (fetch the planned
trajectories, measure the logprob gap, train, stage, append).

- `plan_step(state) -> TrainPlan | Wait`: the next step, or why there is none. It waits while the run is not running,
  after a refused step, once the last step is taken, while an update is open (at most one transaction in flight;
  with `trainer.overlap_update` the next step is planned and trained beside its own last update, and recorded once
  that closes: `overlaps_update`, `may_record`, `lag_base`), in colocated mode while any engine is awake, and while
  fewer than `groups_per_step` groups are ready. Otherwise it drops every ready group over the lag cap (the second
  check after admission's; lag = published version - the group's oldest version: lags only grow, so none of them can
  ever be trained) and takes the `groups_per_step` oldest of the rest (by the version of their oldest tokens, then
  group id), so a drop does not shrink the batch; with fewer left, the plan is the drops alone. It plans: the step
  number (`trainer.step + 1`), the version it will stage (`next_version`: one past every version ever staged or
  published, so an aborted number is never reused), the version the trainer's weights are (`weights_version`), the
  on-policy trajectories the gap is measured on, and the rewards.
- `refusal(plan, gap_median, gap_p99, tokens, max_gap)`: the agreement gate. The gap is measured by the worker (it
  needs torch); "do not train on this, the run must fail" is this pure function of the measurement and the config.
  A refused step is the fact `TrainStepRefused`; the coordinator's decider ends the run from it.
- `TrainPlan.once_keys` / `refusal_keys`: the keys the worker appends the plan's outcome under
  (`EventLog.append_once`), so a step, a version and a group are recorded by one writer only: two trainers, or a
  restarted one planning on a stale view, never both take step s, stage version v or consume a group twice.

- `may_train(state, group_id, trajectory_id)`: can a finished trajectory still reach a step? The trainer keeps only
  those in memory (a sample a completed group did not accept, or of a group cancelled, dropped or consumed, is let go).

A plan is a function of the state alone: the same state gives the same plan, and once the events of a plan are folded
the next plan is another step (or a wait).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import DropReason, RunStatus, SampleStatus
from rolledger.workflows.handoff import engines_asleep
from rolledger.workflows.state import GroupState, RunState, group_version


class WaitReason(StrEnum):
    NOT_RUNNING = "not_running"
    REFUSED = "refused"
    LAST_STEP_TAKEN = "last_step_taken"
    UPDATE_OPEN = "update_open"
    ENGINES_AWAKE = "engines_awake"
    TOO_FEW_READY = "too_few_ready"

    @property
    def is_final(self) -> bool:
        """No later state gives the trainer a step: it may stop following."""
        return self in _FINAL


_FINAL = frozenset({WaitReason.REFUSED, WaitReason.LAST_STEP_TAKEN})


@dataclass(frozen=True, slots=True)
class Wait:
    reason: WaitReason


@dataclass(frozen=True, slots=True)
class TrainPlan:
    """One step, with everything the worker needs to carry it out and to record it."""

    step: int
    version: int  # the version this step stages
    base_version: int  # the published version it is trained under
    weights_version: int  # the version the trainer's weights are (the last one staged, or 0)
    drops: tuple[ev.TrajectoryDropped, ...]  # selected groups over the lag cap
    batch: ev.BatchConsumed | None  # None: every selected group was over the cap; only the drops are appended
    rewards: tuple[float, ...]  # per trajectory of batch.trajectory_ids
    # trajectories generated with the trainer's own weights: the agreement is measured on them
    on_policy: tuple[str, ...]

    @property
    def once_keys(self) -> tuple[str, ...]:
        """The single-writer keys of what this plan appends when it trains: the step, the staged version and every
        group it consumes or drops. A batch claiming any key claimed before is refused whole."""
        groups = [d.group_id for d in self.drops] + list(self.batch.group_ids if self.batch is not None else ())
        step = (f"step:{self.step}", f"UpdateStaged:v{self.version}") if self.batch is not None else ()
        return (*step, *(f"group:{g}" for g in groups))

    @property
    def refusal_keys(self) -> tuple[str, ...]:
        """The keys of a refusal (the step, and the groups it drops): it excludes training that step."""
        return (f"step:{self.step}", *(f"group:{d.group_id}" for d in self.drops))


def next_version(state: RunState) -> int:
    """One past every version ever staged or published: aborted numbers are never reused."""
    return max([*state.updates, state.policy_version]) + 1


def weights_version(state: RunState) -> int:
    """The version the trainer's weights are: the last it staged (published or not), 0 before the first."""
    return max(state.updates, default=0)


def lineage(state: RunState) -> frozenset[str]:
    """The weights digests the trainer may train its next version from: those of its last staged version
    (`weights_version`), or the published ones (before the first version: the initial weights; or a trainer that
    resumed from the published version because its copy of the last was never written). Weights that are neither
    do not descend from the run's history (a restarted trainer that reloaded v0, say): it must not stage them."""
    v = weights_version(state)
    return frozenset({state.weights_digest, *([state.updates[v].weights_digest] if v else [])})


def versions_to_keep(state: RunState) -> frozenset[int]:
    """The staged versions a store may not collect: the published one (what a rank rejoins on), the trainer's last
    (what a restarted trainer's weights are, `weights_version`) and an update still open; older ones are never read
    again."""
    keep = {state.policy_version, weights_version(state)}
    if state.open_update is not None:
        keep.add(state.open_update.version)
    return frozenset(keep)


def overlaps_update(state: RunState) -> bool:
    """Does the trainer plan its next step while its last update is open (`trainer.overlap_update`)? Only over an
    update of its own last staged version: one step training beside one transaction, never two transactions."""
    cfg, u = state.config, state.open_update
    return (
        cfg is not None
        and cfg.trainer.overlap_update
        and cfg.mode == "disaggregated"
        and u is not None
        and u.version == weights_version(state)
    )


def may_record(state: RunState) -> bool:
    """May a planned step be recorded (its BatchConsumed and UpdateStaged appended) now? Not while an update is
    open: a newer UpdateStaged would supersede it (workflows/update.py aborts the older), so a step planned beside
    an open update (`overlaps_update`) waits for it to close."""
    return state.open_update is None


def lag_base(state: RunState) -> int:
    """The version a planned step's lags are counted against: the published one, or, planning beside an open update,
    that update's version (it may be published before the step is recorded; if it aborts, the recorded lag is one
    more than the true one: the bound holds either way)."""
    u = state.open_update
    return max(state.policy_version, u.version) if u is not None and overlaps_update(state) else state.policy_version


def wait_reason(state: RunState) -> WaitReason | None:
    """Why the trainer has no step now, None when it has one."""
    cfg = state.config
    if cfg is None or state.status != RunStatus.RUNNING:
        return WaitReason.NOT_RUNNING
    if state.trainer.refused:
        return WaitReason.REFUSED
    if state.trainer.step >= cfg.steps:
        return WaitReason.LAST_STEP_TAKEN
    if state.open_update is not None and not overlaps_update(state):
        return WaitReason.UPDATE_OPEN
    if cfg.mode == "colocated" and not engines_asleep(state):
        return WaitReason.ENGINES_AWAKE  # colocated: the trainer's turn comes only while every engine sleeps
    if len(state.ready_groups()) < cfg.trainer.groups_per_step:
        return WaitReason.TOO_FEW_READY
    return None


def plan_step(state: RunState) -> TrainPlan | Wait:
    """The next step on this state, or why there is none (see the module docstring)."""
    why = wait_reason(state)
    if why is not None:
        return Wait(why)
    cfg = state.config
    assert cfg is not None  # wait_reason checked it
    # every ready group over the lag cap is dropped (lags only grow: none of them can ever be trained), and the step
    # takes the oldest tokens first (then admission order) among the rest: a group nearest the cap is trained before
    # it passes it, and a drop does not shrink the batch
    base = lag_base(state)
    ready = sorted(state.ready_groups(), key=lambda g: (group_version(g), g.group_id))
    drops = [
        ev.TrajectoryDropped(
            group_id=g.group_id, trajectory_ids=tuple(g.accepted), reason=DropReason.LAG, lag=base - group_version(g)
        )
        for g in ready
        if base - group_version(g) > cfg.admission.max_lag
    ]
    fresh = [g for g in ready if base - group_version(g) <= cfg.admission.max_lag]
    kept: list[GroupState] = fresh[: cfg.trainer.groups_per_step] if len(fresh) >= cfg.trainer.groups_per_step else []
    if not kept and not drops:
        return Wait(WaitReason.TOO_FEW_READY)  # (wait_reason counted them: unreachable, kept for the type's sake)
    step, version, held = state.trainer.step + 1, next_version(state), weights_version(state)
    if not kept:
        return TrainPlan(step, version, state.policy_version, held, tuple(drops), None, (), ())
    trajectory_ids = tuple(tid for g in kept for tid in g.accepted)
    samples = [g.samples[int(tid.rsplit("/", 1)[1])] for g in kept for tid in g.accepted]
    batch = ev.BatchConsumed(
        step=step,
        group_ids=tuple(g.group_id for g in kept),
        versions=tuple(group_version(g) for g in kept),
        lags=tuple(base - group_version(g) for g in kept),
        trajectory_ids=trajectory_ids,
        bytes=sum(g.bytes for g in kept),
    )
    rewards = tuple(s.reward or 0.0 for s in samples)
    # agreement is only defined where the engine ran the very weights the trainer holds
    on_policy = tuple(tid for tid, s in zip(trajectory_ids, samples, strict=True) if s.policy_version == held)
    return TrainPlan(step, version, state.policy_version, held, tuple(drops), batch, rewards, on_policy)


def refusal(
    plan: TrainPlan, gap_median: float, gap_p99: float, agreement_tokens: int, max_gap: float
) -> ev.TrainStepRefused | None:
    """The agreement gate: the refusal to record when the measured median gap exceeds the configured bound."""
    if gap_median <= max_gap:
        return None
    why = (
        f"logprob agreement lost on v{plan.weights_version}: median gap {gap_median:.4f} > {max_gap:g} over "
        f"{agreement_tokens} on-policy tokens; the weights did not arrive; not training on it"
    )
    return ev.TrainStepRefused(
        step=plan.step,
        version=plan.weights_version,
        reason=why,
        gap_median=gap_median,
        gap_p99=gap_p99,
        agreement_tokens=agreement_tokens,
    )


def may_train(state: RunState, group_id: str, trajectory_id: str) -> bool:
    """Can this finished trajectory still be trained on, per the folded state? Its group is live and untrained, the
    sample finished (its reward did not fail), and a completed group accepted it (an open one may still)."""
    g = state.groups.get(group_id)
    if g is None or not g.status.is_untrained:
        return False  # retired (consumed, dropped or cancelled and owing nothing) or gone
    index = int(trajectory_id.rsplit("/", 1)[1])
    smp = g.samples.get(index)
    if smp is None or smp.status != SampleStatus.FINISHED:
        return False
    return g.status.is_open or trajectory_id in g.accepted
