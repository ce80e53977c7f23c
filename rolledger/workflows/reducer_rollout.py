"""The reducer's rollout and reward events: samples starting and ending, groups completing or cancelled, scores.

Late results. Rollout work is delivered at least once: a rank whose heartbeat stopped (a stopped process, a long
pause) loses its group to another rank, which closes the samples still running with SampleFailed ("worker lost";
`state.reclaimed` records each such sample and the rank that started it). If the first rank comes back and appends
results for those samples before it sees it lost its claim, they are the expected leftovers of at-least-once
delivery, not impossible transitions: each is counted in `state.late_results` and otherwise ignored (no anomaly).
The same event from any other rank, or for a sample that was not reclaimed, is still an anomaly.

Retired groups (workflows.state: terminal groups that owe nothing leave the live state). Every handler that can leave
a group owing nothing retires it. An event for a retired group is judged from what is kept: a late result of a
reclaimed sample is counted as above; a SampleStarted that raced the group's closure (a worker starting a group the
coordinator had just cancelled) is counted in `state.after_retired` and held in `state.raced` until the sample ends
(the worker sees the closure and cuts it short; the run's end waits for it, as it waited for such a sample in the
group); anything else is an anomaly, as it was while such groups stayed in the state.
"""

from __future__ import annotations

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import GroupOutcome, GroupStatus, SampleStatus
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.reducer_common import anomaly, find_group, moving_average, sample_index
from rolledger.workflows.scheduler import observe_completion
from rolledger.workflows.state import GroupState, RunState, SampleState, retire_if_done

handlers: Handlers[RunState, None] = Handlers("reducer: rollout and reward")

# The statuses the hot handlers compare with, as module constants: an enum member read off its class, and an enum
# predicate (a property), are each a Python-level lookup per event (cProfile over bench_replay's log).
_STARTED = SampleStatus.STARTED
_FINISHED = SampleStatus.FINISHED
_FAILED = SampleStatus.FAILED
_ADMITTED = GroupStatus.ADMITTED
_GENERATING = GroupStatus.GENERATING
_SCORED = GroupStatus.SCORED
_COMPLETED = frozenset(m for m in GroupStatus if m.is_completed)
_OUTCOME_STATUS = {o: GroupStatus(o.value) for o in GroupOutcome}  # GroupStatus(outcome) without the enum call


def _late(s: RunState, group_id: str, sample_id: str, rank: int | None, *, start: bool = False) -> bool:
    """An event for a sample of a retired group that is expected (counted, True) rather than an anomaly: a late result
    of a reclaimed sample (from the rank that lost it, when the event names its rank), a start that raced the group's
    closure (`start`: held in `raced`), or the end of such a raced sample."""
    if group_id in s.groups or group_id not in s.retired:
        return False
    if sample_id in s.reclaimed and (rank is None or s.reclaimed[sample_id] == rank):
        s.late_results += 1
        return True
    if start and sample_id not in s.raced:
        s.raced[sample_id] = group_id
        s.after_retired += 1
        return True
    if not start and s.raced.pop(sample_id, None) is not None:
        s.after_retired += 1
        return True
    return False


def _live_group(
    s: RunState, e: ev.Event, group_id: str, sample_id: str, rank: int | None, *, start: bool = False
) -> GroupState | None:
    """The live group a sample event is for; None when it is not live: an expected late event (`_late`, counted) or
    an anomaly (`find_group`). One lookup where the group is live, which is almost always."""
    g = s.groups.get(group_id)
    if g is None and not _late(s, group_id, sample_id, rank, start=start):
        find_group(s, e, group_id)
    return g


@handlers.on(ev.SampleStarted)
def _sample_started(s: RunState, e: ev.Event, p: ev.SampleStarted) -> None:
    g = _live_group(s, e, p.group_id, p.sample_id, None, start=True)
    if g is None:
        return
    # A group the coordinator closed while a worker was starting it is a race, not an error: the worker sees the
    # closure and ends the sample with SampleCancelled, which invariant 7 checks.
    if p.index in g.samples:
        anomaly(s, e, f"sample {p.sample_id} started twice")
        return
    if g.status == _ADMITTED:
        g.status = _GENERATING
        rank = s.ranks.get(p.rank)
        if rank is not None:
            rank.groups_generated += 1
    g.samples[p.index] = SampleState(p.sample_id, p.index, _STARTED, p.rank, p.policy_version, p.weights_digest)


def _sample(
    s: RunState, e: ev.Event, group_id: str, index: int, sample_id: str, rank: int | None
) -> tuple[GroupState, SampleState] | None:
    """The sample an end event is for, while it is still running; None (recorded) otherwise. `rank`: the rank the
    event comes from, when it says (a late result from the rank that lost the sample's group is counted, not an
    anomaly)."""
    g = _live_group(s, e, group_id, sample_id, rank)
    if g is None:
        return None
    smp = g.samples.get(index)
    if smp is None:
        anomaly(s, e, f"sample {sample_id} has no SampleStarted")
        smp = g.samples[index] = SampleState(sample_id, index, _STARTED, -1, e.policy_version)
    elif smp.status is not _STARTED:  # terminal (SampleStatus.is_terminal)
        if rank is not None and s.reclaimed.get(sample_id) == rank:
            s.late_results += 1
        else:
            anomaly(s, e, f"sample {sample_id} already {smp.status}")
        return None
    return g, smp


@handlers.on(ev.SampleFinished)
def _sample_finished(s: RunState, e: ev.Event, p: ev.SampleFinished) -> None:
    t = p.trajectory
    found = _sample(s, e, t.group_id, t.index, t.trajectory_id, t.rank)
    if found is None:
        return
    g, smp = found
    tokens = len(t.token_ids)
    smp.status, smp.tokens = _FINISHED, tokens
    smp.nbytes = t.legacy_nbytes if p.nbytes is None else p.nbytes
    observe_completion(s.scheduler, g, tokens)
    version, spans = t.policy_version, t.spans
    if version != smp.policy_version and smp.rank >= 0 and not spans:  # spans: interruptible, stamped
        anomaly(s, e, f"sample {t.trajectory_id} started on v{smp.policy_version}, finished on v{version}")
    smp.policy_version, smp.weights_digest = version, t.weights_digest
    versions = g.versions
    for v in t.versions if spans else (version,):  # without spans, t.versions is {policy_version}: no set built
        if v not in versions:
            versions.append(v)
            versions.sort()
    retire_if_done(s, g)


@handlers.on(ev.SampleFailed)
def _sample_failed(s: RunState, e: ev.Event, p: ev.SampleFailed) -> None:
    if p.stage == "reward":
        _reward_failed(s, e, p)
        return
    found = _sample(s, e, p.group_id, p.index, p.sample_id, p.rank)
    if found is not None:
        g, smp = found
        smp.status = SampleStatus.FAILED
        if smp.rank >= 0 and p.rank != smp.rank:  # another rank closed it: it reclaimed the group
            s.reclaimed[p.sample_id] = smp.rank
        retire_if_done(s, g)


def _reward_failed(s: RunState, e: ev.Event, p: ev.SampleFailed) -> None:
    """A finished sample its reward functions could not score: failed, so its group cannot complete with it (an
    open one goes on without it or is cancelled, a completed one is cancelled by the coordinator, groups.py)."""
    if _late(s, p.group_id, p.sample_id, None):
        return
    g = find_group(s, e, p.group_id)
    if g is None:
        return
    smp = g.samples.get(p.index)
    if smp is not None and smp.status == SampleStatus.FAILED and p.sample_id in s.reclaimed:
        s.late_results += 1  # like a late score: the reward worker saw the finish before the reclaim
        return
    if smp is None or smp.status != SampleStatus.FINISHED or smp.reward is not None:
        anomaly(s, e, f"reward failure for {p.sample_id}, which is not finished and unscored")
        return
    smp.status = SampleStatus.FAILED
    s.reward_failures += 1
    s.reward_failures_in_a_row += 1
    s.last_reward_failure = f"{p.sample_id}: {p.error}"
    retire_if_done(s, g)


@handlers.on(ev.SampleCancelled)
def _sample_cancelled(s: RunState, e: ev.Event, p: ev.SampleCancelled) -> None:
    if _late(s, p.group_id, p.sample_id, None):
        return
    g = find_group(s, e, p.group_id)
    if g is None:
        return
    smp = g.samples.get(p.index)
    if smp is None:  # cancelled before it started: a legal end for a never-started sample
        g.samples[p.index] = SampleState(p.sample_id, p.index, SampleStatus.CANCELLED, -1, e.policy_version)
    elif smp.status.is_terminal:
        if p.sample_id in s.reclaimed:  # the rank that lost the group cut its late copy short (SampleCancelled
            s.late_results += 1  # carries no rank; only that rank still holds a reclaimed sample)
        else:
            anomaly(s, e, f"sample {p.sample_id} already {smp.status}")
    else:
        smp.status = SampleStatus.CANCELLED
    retire_if_done(s, g)


def _maybe_scored(g: GroupState) -> None:
    # `scored` counts the samples with a reward (it moves only with one), so fewer than the accepted cannot cover
    # them: the scan over the accepted runs once per group, not once per score
    if (
        g.status in _COMPLETED
        and g.scored >= len(g.accepted)
        and all(g.samples[sample_index(sid)].reward is not None for sid in g.accepted)
    ):
        g.status = _SCORED


@handlers.on(ev.GroupCompleted)
def _group_completed(s: RunState, e: ev.Event, p: ev.GroupCompleted) -> None:
    g = find_group(s, e, p.group_id)
    if g is None:
        return
    if not g.status.is_open:
        anomaly(s, e, f"group {p.group_id} completed while {g.status}")
        return
    for sid in p.accepted:
        smp = g.samples.get(sample_index(sid))
        if smp is None or smp.status != _FINISHED:
            anomaly(s, e, f"group {p.group_id} accepts {sid}, which did not finish")
    if len(p.accepted) < g.required:
        anomaly(s, e, f"group {p.group_id} completed with {len(p.accepted)} < {g.required} required samples")
    g.status, g.accepted, g.bytes = _OUTCOME_STATUS[p.status], list(p.accepted), p.bytes
    if g.admitted_at:
        s.admission.gen_latency_s = moving_average(s.admission.gen_latency_s, max(e.wall_time - g.admitted_at, 0.0))
    s.admission.inflight -= 1
    s.admission.queued_bytes += p.bytes
    s.admission.max_queued_bytes = max(s.admission.max_queued_bytes, s.admission.queued_bytes)
    _maybe_scored(g)


@handlers.on(ev.GroupCancelled)
def _group_cancelled(s: RunState, e: ev.Event, p: ev.GroupCancelled) -> None:
    g = find_group(s, e, p.group_id)
    if g is None:
        return
    if g.status.is_open:
        s.admission.inflight -= 1
    elif g.status.is_queued:
        s.admission.queued_bytes -= g.bytes
    else:
        anomaly(s, e, f"group {p.group_id} cancelled while {g.status}")
        return
    g.status = GroupStatus.CANCELLED
    s.admission.gone_before_training += 1
    retire_if_done(s, g)


@handlers.on(ev.SampleScored)
def _sample_scored(s: RunState, e: ev.Event, p: ev.SampleScored) -> None:
    g = _live_group(s, e, p.group_id, p.sample_id, None)
    if g is None:
        return
    smp = g.samples.get(sample_index(p.sample_id))
    if smp is not None and smp.status == _FAILED and p.sample_id in s.reclaimed:
        s.late_results += 1  # the score of a late result (the reward worker scored it before seeing the reclaim)
        return
    if smp is None or smp.status != _FINISHED:
        anomaly(s, e, f"score for {p.sample_id}, which did not finish")
        return
    if smp.reward is not None:
        anomaly(s, e, f"{p.sample_id} scored twice")
        return
    smp.reward, smp.correct = p.reward, p.correct
    g.scored += 1
    s.reward_failures_in_a_row = 0
    _maybe_scored(g)
    retire_if_done(s, g)
