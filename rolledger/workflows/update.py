"""The weight-update coordinator: `decide_update(state, now, fence) -> [payloads]`, pure.

The transaction for version v, one at a time:
  UpdateStaged -> PrepareRequested(ranks in service, deadline) -> every rank RankPrepared (each validated the staged
  tensors into an inactive buffer while still serving v-1) -> AdmissionPaused(update) -> every rank drains and
  reports EnginePaused -> UpdateCommitted -> each rank swaps, invalidates caches, runs its health probe ->
  PolicyPublished -> AdmissionResumed(update).
Any RankPrepareFailed, or a missed prepare or drain deadline, gives UpdateAborted: nothing was swapped, every rank
keeps v-1. The abort names the ranks that caused it (`failed_ranks`: those that failed their prepare, or missed the
prepare or the drain deadline), and each of them still in service is quarantined in the same decision
(RankQuarantined): the next update goes ahead on the ranks in service, so one dead rank cannot make every update
abort. A quarantined rank that is alive rejoins by the Rejoin path (workflows/rank.py: it loads the published
version through the verified path and announces itself with RankJoined) and takes part again from the next update.
A staged update with no rank in service waits for one to rejoin (it is not aborted: nobody failed it). After the commit the decision stands (roll forward): a rank that fails its swap or health probe, reports
a digest other than the manifest's, or misses the commit deadline is quarantined, and v is published on the rest.
Every decision carries the fencing token of the coordinator's lease. A coordinator that takes over (a larger token)
finds an open transaction prepared under another token with no decision logged: it aborts it at its deadline, never
commits it; a transaction whose commit is logged is rolled forward by whoever holds the lease.
"""

from __future__ import annotations

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason, UpdateStatus
from rolledger.workflows.state import RunState, UpdateState


def in_service(state: RunState) -> tuple[int, ...]:
    """Ranks that take part in updates: joined and not quarantined."""
    return tuple(sorted(r.rank for r in state.ranks.values() if r.status.in_service))


def about_to_be_quarantined(state: RunState, rank: int, now: float, margin_s: float = 1.0) -> bool:
    """Should this rank start no new group because the open update is about to quarantine it? It failed its prepare,
    or has not prepared and the prepare deadline is less than `margin_s` away (a clock skew allowance): the abort will
    name it and quarantine it, and a group it started meanwhile would run on a rank the log already quarantined.
    The rank's rollout asks this beside `workflows.rank.may_serve`; it narrows that window to the time the rank takes
    to fold its own failure, since a rank can never fence its appends against the coordinator's."""
    u = state.open_update
    if u is None or u.status != UpdateStatus.PREPARING or rank not in u.ranks or rank in u.quarantined:
        return False
    return rank in u.failed or (rank not in u.prepared and now > u.deadline - margin_s)


def decide_update(state: RunState, now: float, fence: int) -> list[ev.Payload]:
    cfg = state.config
    if cfg is None:
        return []
    out: list[ev.Payload] = []
    open_updates = sorted(v for v, u in state.updates.items() if u.open)
    for v in open_updates[:-1]:  # a newer version was staged: the older transaction can no longer win
        if state.updates[v].status.is_undecided:
            out.append(ev.UpdateAborted(version=v, reason=f"superseded by v{open_updates[-1]}", fence=fence))
    if AdmissionReason.UPDATE in state.admission.paused and (
        not open_updates or not state.updates[open_updates[-1]].paused_at
    ):
        # that pause belonged to a transaction already closed: the open one pauses (and times its drain) itself
        out.append(ev.AdmissionResumed(reason=AdmissionReason.UPDATE))
        return out
    if open_updates:
        out.extend(_decide_one(state, state.updates[open_updates[-1]], now, fence))
    else:  # a live rank behind the published version (it rejoined on an older one) is sent to reload it
        for r in sorted(state.ranks.values(), key=lambda r: r.rank):
            if r.status.in_service and r.committed_version != state.policy_version:
                out.append(
                    ev.RankQuarantined(
                        rank=r.rank,
                        version=state.policy_version,
                        reason=f"on v{r.committed_version}, behind the published v{state.policy_version}",
                    )
                )
    return out


def _abort_naming(
    state: RunState, u: UpdateState, reason: str, culprits: tuple[int, ...], fence: int
) -> list[ev.Payload]:
    """Abort v naming the ranks that caused it, and quarantine those still in service, in one decision."""
    out: list[ev.Payload] = [ev.UpdateAborted(version=u.version, reason=reason, failed_ranks=culprits, fence=fence)]
    for r in culprits:
        rank = state.ranks.get(r)
        if rank is not None and rank.status.in_service and r not in u.quarantined:
            out.append(ev.RankQuarantined(rank=r, version=u.version, reason=f"v{u.version} aborted: {reason}"))
    return out


def _decide_one(state: RunState, u: UpdateState, now: float, fence: int) -> list[ev.Payload]:
    cfg = state.config
    assert cfg is not None
    up = cfg.update
    if u.status == UpdateStatus.STAGED:
        ranks = in_service(state)
        if not ranks:
            # every rank is quarantined (a rank that failed the last update is rejoining): the update waits for one,
            # and the run ends if none comes back within recovery.no_rank_in_service_s (workflows/coordinator.py).
            # Aborting here would count towards update.max_consecutive_aborts a transaction nobody could take part in
            return []
        return [
            ev.PrepareRequested(
                version=u.version,
                manifest_digest=u.manifest_digest,
                ranks=ranks,
                deadline=now + up.prepare_deadline_s,
                fence=fence,
                uri=u.uri,
                weights_digest=u.weights_digest,
                bytes=u.bytes,
            )
        ]
    if u.status == UpdateStatus.PREPARING:
        if (
            u.fence != fence
        ):  # a coordinator that died mid-transaction: no decision was logged, so abort at its deadline
            if now > u.deadline:
                return [
                    ev.UpdateAborted(
                        version=u.version, reason=f"coordinator with fence {u.fence} lost before deciding", fence=fence
                    )
                ]
            return []
        if u.failed:
            reasons = "; ".join(f"rank {r}: {why}" for r, why in sorted(u.failed.items()))
            return _abort_naming(state, u, reasons, tuple(sorted(u.failed)), fence)
        if not u.all_prepared:
            if now > u.deadline:
                late = tuple(r for r in u.ranks if r not in u.prepared)
                return _abort_naming(state, u, f"prepare deadline passed for ranks {list(late)}", late, fence)
            return []
        if AdmissionReason.UPDATE not in state.admission.paused:
            return [
                ev.AdmissionPaused(
                    reason=AdmissionReason.UPDATE,
                    queued_bytes=state.admission.queued_bytes,
                    lag=state.lag,
                    detail=f"committing v{u.version}",
                )
            ]
        drained = all(state.ranks[r].status.is_stopped for r in u.ranks if r in state.ranks)
        if drained:
            return [
                ev.UpdateCommitted(
                    version=u.version,
                    manifest_digest=u.manifest_digest,
                    ranks=tuple(u.ranks),
                    fence=fence,
                    weights_digest=u.weights_digest,
                )
            ]
        if u.paused_at and now > u.paused_at + up.drain_deadline_s:
            undrained = tuple(r for r in u.ranks if r in state.ranks and not state.ranks[r].status.is_stopped)
            return _abort_naming(state, u, f"drain deadline passed for ranks {list(undrained)}", undrained, fence)
        return []
    # committed -> roll forward
    out: list[ev.Payload] = []
    bad: dict[int, str] = {}
    for r in u.ranks:
        if r in u.quarantined:
            continue
        digest = u.committed.get(r)
        if r in u.failed:
            bad[r] = u.failed[r]
        elif digest is not None and digest != u.weights_digest:
            bad[r] = f"live digest {digest} differs from the manifest's {u.weights_digest}"
        elif r not in u.healthy and now > u.committed_at + up.commit_deadline_s:
            bad[r] = "commit deadline passed"
    probes = {r: d for r, d in u.probe_digests.items() if r not in bad and r not in u.quarantined}
    expected = [r for r in u.ranks if r not in bad and r not in u.quarantined]
    if set(probes) == set(expected) and len(set(probes.values())) > 1:
        # every rank ran the same probe on what should be the same weights, and they disagree: a strict majority
        # names the odd ones out (stale weights that passed their own digest check). A tie names nobody; the
        # trainer's logprob agreement is the check that catches it then.
        values = list(probes.values())
        counts = {d: values.count(d) for d in set(values)}
        majority, votes = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        if votes * 2 > len(values):
            for r, d in probes.items():
                if d != majority:
                    bad[r] = "health probe differs from the other ranks (stale weights?)"
    for r, why in sorted(bad.items()):
        out.append(ev.RankQuarantined(rank=r, version=u.version, reason=why))
    serving = [r for r in u.ranks if r not in bad and r not in u.quarantined]
    if all(r in u.healthy for r in serving) and not bad:  # with every rank quarantined it still closes
        out.append(
            ev.PolicyPublished(version=u.version, weights_digest=u.weights_digest, ranks=tuple(serving), fence=fence)
        )
    return out
