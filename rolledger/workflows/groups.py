"""Group completion by the algorithm's partial policy: `decide_groups(state, now) -> [payloads]`, pure.

- all: complete when all N finished; cancelled when a sample failed or was cancelled (N can no longer be reached).
- at_least k: complete (status "complete" if all N finished, else "partial") once every sample is terminal and at
  least k finished; cancelled when fewer than k can still finish.
- first_k: complete with the first k finished samples as soon as k finished; the rest are cancelled.
- a completed group one of whose accepted samples could not be scored (SampleFailed, stage "reward") is cancelled:
  it can never be trained on. (An open group counts such a sample as failed, like any other.)
- deadline (any policy): at the deadline a group with at least k finished completes as partial, the rest of its
  samples are cancelled; a group short of k is cancelled.
- stale (any policy): an open group that can no longer be trained within `admission.max_lag` of the published version
  is cancelled at once (its tokens are too old, or too few of its samples can be newer), not generated to the end
  for the trainer to drop (prime-rl drops stale groups early the same way).
- overload (scheduler = "youngest-cancel", prime-rl's overload policy): when the untrained groups (completed and
  waiting for the trainer, or in flight) outnumber the rate throttle's cap (`admission.throttle_cap`: the trainer's
  drain slowed since they were admitted), the youngest open groups are cancelled down to the cap, newest admission
  first: they hold the least generated work, and the older ones, nearest to done, keep going. FIFO and SRGF only stop
  admitting and let the excess finish (it may be dropped for lag later).
Cancelling is a decision here (GroupCompleted/GroupCancelled); the rollout worker that holds the samples sees it and
ends each unfinished sample with SampleCancelled, so every dispatched sample reaches a terminal event.
"""

from __future__ import annotations

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import GroupOutcome, GroupStatus, PolicyKind, SampleStatus
from rolledger.workflows.admission import throttle_cap
from rolledger.workflows.reducer_common import sample_index
from rolledger.workflows.state import GroupState, RunState, SampleState

_LOST = frozenset({SampleStatus.FAILED, SampleStatus.CANCELLED})


def decide_groups(state: RunState, now: float) -> list[ev.Payload]:
    """Decisions for every group still admitted/generating."""
    out: list[ev.Payload] = []
    for g in state.groups.values():
        if g.status.is_queued and g.status != GroupStatus.SCORED:
            unscorable = [sid for sid in g.accepted if g.samples[sample_index(sid)].status == SampleStatus.FAILED]
            if unscorable:
                out.append(ev.GroupCancelled(group_id=g.group_id, reason=f"sample {unscorable[0]} could not be scored"))
            continue
        if not g.status.is_open:
            continue
        decision = decide_group(g, now, g.deadline) or _cancel_if_stale(state, g)
        if decision is not None:
            out.append(decision)
    return out + _cancel_youngest_on_overload(state, out)


def _cancel_youngest_on_overload(state: RunState, decided: list[ev.Payload]) -> list[ev.Payload]:
    """Under youngest-cancel: the youngest open groups, down to the throttle's cap on untrained groups (module
    docstring). Groups this round already closes are not candidates; those it cancels no longer count."""
    cfg = state.config
    if cfg is None or cfg.scheduler != "youngest-cancel":
        return []
    closing = {p.group_id for p in decided if isinstance(p, (ev.GroupCompleted, ev.GroupCancelled))}
    cancelled = {p.group_id for p in decided if isinstance(p, ev.GroupCancelled)}
    untrained = [g for g in state.groups.values() if g.untrained and g.group_id not in cancelled]
    cap = throttle_cap(state, cfg)
    excess = len(untrained) - cap
    if excess <= 0:
        return []
    open_groups = [g for g in untrained if g.status.is_open and g.group_id not in closing]
    youngest = sorted(open_groups, key=lambda g: (g.admitted_at, g.group_id), reverse=True)[:excess]
    why = f"overload (youngest-cancel): {len(untrained)} untrained groups > the throttle's cap {cap}"
    return [ev.GroupCancelled(group_id=g.group_id, reason=why) for g in youngest]


def _cancel_if_stale(state: RunState, g: GroupState) -> ev.GroupCancelled | None:
    """An open group that can no longer be trained is cancelled now rather than generated to the end and dropped by
    the trainer: a finished sample's tokens are older than the lag cap allows (published - max_lag), or too few of
    its samples can still finish on versions within it. Lags only grow, so this never cancels a trainable group
    (the trainer counts lags against the published version or a newer one)."""
    cfg = state.config
    if cfg is None:
        return None
    floor = state.policy_version - cfg.admission.max_lag  # the oldest version a trained token may come from
    if floor <= 0:
        return None
    why = f"stale: v{state.policy_version} is published and max_lag is {cfg.admission.max_lag}"
    if g.versions and g.versions[0] < floor:
        return ev.GroupCancelled(group_id=g.group_id, reason=f"{why}; it holds tokens of v{g.versions[0]}")
    # a sample not started yet would start on a version within the cap; a lost one, or one started before the floor,
    # cannot give a trainable sample
    stale = sum(1 for s in g.samples.values() if s.status in _LOST or s.policy_version < floor)
    if g.n - stale < g.required:
        return ev.GroupCancelled(
            group_id=g.group_id, reason=f"{why}; only {g.n - stale} of the {g.required} required samples can be newer"
        )
    return None


def decide_group(g: GroupState, now: float, deadline: float | None) -> ev.Payload | None:
    done = terminal = 0  # counted first: most open groups decide nothing, and only a completion needs the samples
    for s in g.samples.values():
        if s.status == SampleStatus.FINISHED:
            done += 1
        if s.status.is_terminal:
            terminal += 1
    lost = terminal - done  # failed or cancelled
    k = g.required
    if g.policy_kind == PolicyKind.FIRST_K and done >= k:
        return _complete(g, _finished(g)[:k], GroupOutcome.COMPLETE if k == g.n else GroupOutcome.PARTIAL)
    if g.policy_kind == PolicyKind.ALL and done == g.n:
        return _complete(g, _finished(g), GroupOutcome.COMPLETE)
    if g.policy_kind == PolicyKind.AT_LEAST and terminal == g.n and done >= k:
        return _complete(g, _finished(g), GroupOutcome.COMPLETE if done == g.n else GroupOutcome.PARTIAL)
    if g.n - lost < k:
        return ev.GroupCancelled(
            group_id=g.group_id, reason=f"only {g.n - lost} of the {k} required samples can finish"
        )
    if deadline is not None and now >= deadline:
        if done >= k and g.policy_kind != PolicyKind.ALL:
            return _complete(g, _finished(g), GroupOutcome.PARTIAL)
        return ev.GroupCancelled(group_id=g.group_id, reason=f"deadline passed with {done} of {k} finished")
    return None


def _finished(g: GroupState) -> list[SampleState]:
    """The group's finished samples in index order."""
    return [s for s in sorted(g.samples.values(), key=lambda s: s.index) if s.status == SampleStatus.FINISHED]


def _complete(g: GroupState, accepted: list[SampleState], status: GroupOutcome) -> ev.GroupCompleted:
    nbytes = sum(s.nbytes for s in accepted)
    return ev.GroupCompleted(
        group_id=g.group_id, accepted=tuple(s.sample_id for s in accepted), status=status, bytes=nbytes
    )
