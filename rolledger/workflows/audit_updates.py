"""The audit's handlers for weight updates and engines: fail-closed commits and aborts (invariant 3), one published
state (4), the update window closing at publish or abort and ranks stopping inside it (2)."""

from __future__ import annotations

from rolledger.schemas.events import (
    CacheInvalidated,
    EnginePaused,
    EngineResumed,
    EngineSlept,
    Event,
    HealthFailed,
    HealthPassed,
    Payload,
    PolicyPublished,
    PrepareRequested,
    RankCommitted,
    RankJoined,
    RankPrepared,
    RankPrepareFailed,
    RankQuarantined,
    UpdateAborted,
    UpdateCommitted,
    UpdateStaged,
)
from rolledger.workflows.audit_attempts import UpdateAttempt, UpdateTracker
from rolledger.workflows.audit_context import Auditor, RankFacts, Window
from rolledger.workflows.audit_report import WarningKind
from rolledger.workflows.dispatch import Handlers

handlers: Handlers[Auditor, None] = Handlers("audit: weight updates and engines")


def _track(ctx: Auditor, e: Event, p: Payload) -> None:
    """Events that only move an update attempt along (the checks come at its commit, abort and publication)."""
    ctx.updates.apply(e)


for _tracked in (PrepareRequested, RankPrepared, RankPrepareFailed, HealthPassed, HealthFailed):
    handlers.on(_tracked)(_track)


@handlers.on(UpdateStaged)
def _update_staged(ctx: Auditor, e: Event, p: UpdateStaged) -> None:
    _check_lineage(ctx, e, p)
    cur = ctx.updates.current(p.version)
    if cur is not None and not cur.resolved:
        ctx.warn(
            WarningKind.UNRESOLVED_UPDATE,
            f"v{p.version} staged again before its previous attempt resolved",
            cur.staged,
            e,
        )
    ctx.updates.apply(e)


def _check_lineage(ctx: Auditor, e: Event, p: UpdateStaged) -> None:
    """Invariant 9: the weights a version was trained from (recorded since the manifest carries them) are the
    trainer's last staged version's, or the published ones. A trainer that restarted on the initial checkpoint
    after v2 was published, and staged what it trained from there as v3, fails it."""
    last = ctx.last_staged
    if last is None or last[1].version < p.version:
        ctx.last_staged = (e, p)
    if p.parent_weights_digest is None:
        return  # a log from before lineage was recorded
    ctx.checked[9] += 1
    published_v = max(ctx.published, default=0)
    published = ctx.version_digest.get(published_v)
    allowed = {d for d in (published, last[1].weights_digest if last is not None else None) if d is not None}
    if p.parent_weights_digest not in allowed:
        prev = f"v{last[1].version} {last[1].weights_digest}" if last is not None else "none"
        ctx.violate(
            9,
            f"v{p.version} was trained from weights {p.parent_weights_digest}, neither the trainer's last staged "
            f"version ({prev}) nor the published one (v{published_v} {published})",
            last[0] if last is not None else None,
            e,
        )


@handlers.on(UpdateCommitted)
def _update_committed(ctx: Auditor, e: Event, p: UpdateCommitted) -> None:
    ctx.checked[3] += 1
    before = ctx.updates.current(p.version)
    if before is not None and before.aborted is not None:
        ctx.violate(3, f"v{p.version} committed after it was aborted", before.aborted, e)
    if before is not None and before.committed is not None:
        ctx.warn(WarningKind.DUPLICATE, f"v{p.version} committed twice", before.committed, e, invariant=3)
        return
    a = ctx.updates.route(e)
    assert a is not None
    staged = a.staged.payload if a.staged is not None else None
    if isinstance(staged, UpdateStaged) and staged.manifest_digest != p.manifest_digest:
        ctx.violate(
            3,
            f"v{p.version} committed manifest {p.manifest_digest} but staged {staged.manifest_digest}",
            a.staged,
            e,
        )
    for r in p.ranks:
        prep = a.prepared.get(r)
        if prep is None:
            ctx.violate(3, f"v{p.version} committed without RankPrepared from rank {r}", e)
        elif isinstance(prep.payload, RankPrepared) and prep.payload.manifest_digest != p.manifest_digest:
            ctx.violate(
                3,
                f"v{p.version} committed manifest {p.manifest_digest}, rank {r} prepared "
                f"{prep.payload.manifest_digest}",
                prep,
                e,
            )
    for r, failed in sorted(a.prepare_failed.items()):
        ctx.violate(3, f"v{p.version} committed although rank {r} failed to prepare", failed, e)
    if a.requested is not None and isinstance(a.requested.payload, PrepareRequested):
        left_out = sorted(set(a.requested.payload.ranks) - set(p.ranks))
        if left_out:
            ctx.violate(3, f"v{p.version} committed without requested ranks {left_out}", a.requested, e)
    UpdateTracker.record(a, e)
    if ctx.window is None:
        ctx.warn(
            WarningKind.MALFORMED,
            f"v{p.version} committed while admission was not paused for an update",
            e,
            invariant=2,
        )
        ctx.window = Window(e, p.version)
    elif ctx.window.version is None:
        ctx.window.version = p.version
    ctx.window.committed = e


@handlers.on(UpdateAborted)
def _update_aborted(ctx: Auditor, e: Event, p: UpdateAborted) -> None:
    ctx.checked[3] += 1
    a = ctx.updates.route(e)
    assert a is not None
    if a.committed is not None:
        ctx.violate(3, f"v{p.version} aborted after it was committed", a.committed, e)
    UpdateTracker.record(a, e)
    for r, st in sorted(ctx.ranks.items()):
        if st.version == p.version and st.quarantined is None:
            ctx.violate(3, f"v{p.version} aborted but rank {r} is on it", st.event, e)
    ctx.close_window(p.version)


@handlers.on(RankCommitted)
def _rank_committed(ctx: Auditor, e: Event, p: RankCommitted) -> None:
    a = ctx.updates.route(e)
    assert a is not None
    if a.aborted is not None:
        ctx.violate(3, f"rank {p.rank} committed v{p.version}, which was aborted", a.aborted, e)
    elif a.committed is None:
        ctx.violate(3, f"rank {p.rank} committed v{p.version} before UpdateCommitted", e)
    elif isinstance(a.committed.payload, UpdateCommitted) and p.rank not in a.committed.payload.ranks:
        ctx.warn(
            WarningKind.MALFORMED, f"rank {p.rank} committed v{p.version} but is not in its commit", a.committed, e
        )
    UpdateTracker.record(a, e)
    st = ctx.ranks.get(p.rank)
    invalidations = st.invalidations if st else []
    ctx.ranks[p.rank] = RankFacts(p.version, p.weights_digest, e, None, invalidations)


@handlers.on(CacheInvalidated)
def _cache_invalidated(ctx: Auditor, e: Event, p: CacheInvalidated) -> None:
    ctx.updates.apply(e)
    st = ctx.ranks.get(p.rank)
    if st is None:
        ctx.warn(WarningKind.ORPHAN, f"CacheInvalidated for rank {p.rank}, which never joined or committed", e)
        return
    st.invalidations.append(e)


@handlers.on(PolicyPublished)
def _policy_published(ctx: Auditor, e: Event, p: PolicyPublished) -> None:
    ctx.checked[4] += 1
    a = ctx.updates.route(e)
    assert a is not None
    if a.aborted is not None:
        ctx.violate(3, f"v{p.version} published after it was aborted", a.aborted, e)
    elif a.committed is None:
        ctx.violate(3, f"v{p.version} published without UpdateCommitted", e)
    for r in p.ranks:
        if r in a.prepare_failed:
            ctx.violate(4, f"v{p.version} published with rank {r}, which reported a failure", a.prepare_failed[r], e)
        rc = a.rank_committed.get(r)
        if rc is None or not isinstance(rc.payload, RankCommitted):
            ctx.violate(4, f"v{p.version} published for rank {r}, which never committed it", e)
            continue
        if rc.payload.weights_digest != p.weights_digest:
            ctx.violate(
                4,
                f"v{p.version} published with weights {p.weights_digest}, rank {r} committed "
                f"{rc.payload.weights_digest}",
                rc,
                e,
            )
        if r in a.health_failed:
            ctx.violate(4, f"v{p.version} published with rank {r}, whose health check failed", a.health_failed[r], e)
        elif r not in a.health_passed:
            ctx.violate(4, f"v{p.version} published with rank {r}, which never passed a health check", e)
        else:
            hp = a.health_passed[r].payload
            if isinstance(hp, HealthPassed) and hp.weights_digest != p.weights_digest:
                ctx.violate(
                    4,
                    f"rank {r} passed health on weights {hp.weights_digest}, not {p.weights_digest}",
                    a.health_passed[r],
                    e,
                )
        if not a.invalidated.get(r):
            ctx.violate(4, f"v{p.version} published but rank {r} never invalidated its cache for it", rc, e)
    _probes_agree(ctx, e, p, a)
    if a.committed is not None and isinstance(a.committed.payload, UpdateCommitted):
        for r in sorted(set(a.committed.payload.ranks) - set(p.ranks)):
            st = ctx.ranks.get(r)
            if (st is None or st.quarantined is None) and r not in ctx.quarantined_in.get(p.version, set()):
                ctx.violate(
                    4,
                    f"rank {r} committed v{p.version} but was left out of PolicyPublished without quarantine",
                    a.committed,
                    e,
                )
    staged = a.staged.payload if a.staged is not None else None
    if isinstance(staged, UpdateStaged) and staged.weights_digest != p.weights_digest:
        ctx.violate(
            4,
            f"v{p.version} published weights {p.weights_digest} but the trainer staged {staged.weights_digest}",
            a.staged,
            e,
        )
    UpdateTracker.record(a, e)
    if p.version <= ctx.current_version and p.version in ctx.version_digest:
        ctx.warn(WarningKind.MALFORMED, f"v{p.version} published again (current v{ctx.current_version})", e)
    ctx.published[p.version] = e
    ctx.version_digest[p.version] = p.weights_digest
    ctx.current_version = max(ctx.current_version, p.version)
    ctx.close_window(p.version)


def _probes_agree(ctx: Auditor, e: Event, p: PolicyPublished, a: UpdateAttempt) -> None:
    """The health probe is a greedy decode whose digest covers the exact logits: ranks that run the same weights give
    the same digest. Published ranks whose probes differ cannot all run v's weights, whatever digests they claim (a
    rank that kept its old weights still reports the manifest's digest; with two ranks the vote is a tie)."""
    probes: dict[int, tuple[str, Event]] = {}
    for r in p.ranks:
        hp = a.health_passed.get(r)
        if hp is not None and isinstance(hp.payload, HealthPassed) and hp.payload.probe_digest:
            probes[r] = (hp.payload.probe_digest, hp)
    if len({digest for digest, _ in probes.values()}) > 1:
        seen = ", ".join(f"rank {r}: {d[:12]}" for r, (d, _) in sorted(probes.items()))
        ctx.violate(
            4,
            f"v{p.version} published while the ranks' health probes disagree ({seen}): they do not all run its weights",
            *(hp for _, hp in probes.values()),
            e,
        )


@handlers.on(EnginePaused)
def _engine_paused(ctx: Auditor, e: Event, p: EnginePaused) -> None:
    if ctx.window is not None:
        ctx.stopped[p.rank] = e


@handlers.on(EngineSlept)
def _engine_slept(ctx: Auditor, e: Event, p: EngineSlept) -> None:
    ctx.stopped[p.rank] = e


@handlers.on(EngineResumed)
def _engine_resumed(ctx: Auditor, e: Event, p: EngineResumed) -> None:
    ctx.stopped.pop(p.rank, None)


@handlers.on(RankJoined)
def _rank_joined(ctx: Auditor, e: Event, p: RankJoined) -> None:
    ctx.ranks[p.rank] = RankFacts(p.policy_version, p.weights_digest, e)
    # a rank that (re)joins is awake, as the reducer folds it: an EnginePaused its previous process left behind
    # (killed before it resumed) does not stop the new one, which drains for the open update like any other
    ctx.stopped.pop(p.rank, None)
    known = ctx.version_digest.get(p.policy_version)
    if known is not None and known != p.weights_digest:
        ctx.violate(
            4,
            f"rank {p.rank} joined on v{p.policy_version} with weights {p.weights_digest}, not {known}",
            ctx.published.get(p.policy_version) or ctx.run_started,
            e,
        )


@handlers.on(RankQuarantined)
def _rank_quarantined(ctx: Auditor, e: Event, p: RankQuarantined) -> None:
    # remembered per version: a rank may rejoin (RankJoined) before the version is published without it
    ctx.quarantined_in.setdefault(p.version, set()).add(p.rank)
    st = ctx.ranks.get(p.rank)
    if st is None:
        ctx.ranks[p.rank] = RankFacts(p.version, "", e, quarantined=e)
    else:
        st.quarantined = e
