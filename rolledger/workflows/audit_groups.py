"""The audit's handlers for the run, admission and groups: the update window against admission (invariant 2), the
byte cap at every admission (6), every group reaching a terminal event (7), and consumption within bounds (5)."""

from __future__ import annotations

from rolledger.schemas.events import (
    AdmissionPaused,
    BatchConsumed,
    Event,
    GroupAdmitted,
    GroupCancelled,
    GroupCompleted,
    RunFinished,
    RunStarted,
    SampleFinished,
    TrajectoryDropped,
)
from rolledger.schemas.statuses import AdmissionReason
from rolledger.workflows.audit_context import Auditor, GroupUnit, Window, span_versions
from rolledger.workflows.audit_report import WarningKind
from rolledger.workflows.dispatch import Handlers

handlers: Handlers[Auditor, None] = Handlers("audit: run, admission, groups, trainer")


@handlers.on(RunStarted)
def _run_started(ctx: Auditor, e: Event, p: RunStarted) -> None:
    if ctx.run_started is not None:
        ctx.warn(WarningKind.MALFORMED, f"second RunStarted (first {ctx.run_started.event_id}); the first is kept", e)
        return
    ctx.run_started = e
    ctx.run_id = e.run_id
    ctx.config = p.config
    ctx.version_digest[0] = p.initial_weights_digest


@handlers.on(RunFinished)
def _run_finished(ctx: Auditor, e: Event, p: RunFinished) -> None:
    ctx.run_finished = ctx.run_finished or e


@handlers.on(AdmissionPaused)
def _admission_paused(ctx: Auditor, e: Event, p: AdmissionPaused) -> None:
    if p.reason != AdmissionReason.UPDATE or ctx.window is not None:
        return
    pending = ctx.updates.pending()
    ctx.window = Window(e, pending.version if pending else None)


@handlers.on(GroupAdmitted)
def _group_admitted(ctx: Auditor, e: Event, p: GroupAdmitted) -> None:
    if p.group_id in ctx.groups:
        ctx.warn(WarningKind.MALFORMED, f"group {p.group_id} admitted twice", ctx.groups[p.group_id].admitted, e)
    else:
        ctx.groups[p.group_id] = GroupUnit(e)
    ctx.in_window(e, f"GroupAdmitted {p.group_id}")
    ctx.checked[6] += 1
    declared = ctx.cfg.admission.max_queued_bytes
    problems = []
    if p.byte_cap > declared:
        problems.append(f"byte_cap {p.byte_cap} exceeds the declared max_queued_bytes {declared}")
    if p.queued_bytes > min(p.byte_cap, declared):
        problems.append(f"queued_bytes {p.queued_bytes} > cap {min(p.byte_cap, declared)}")
    if problems:
        ctx.violate(6, f"GroupAdmitted {p.group_id}: " + "; ".join(problems), e)
    if p.prompt_index is not None:
        ctx.bounded_admission = True  # admitted counting every group in flight at its max_tokens (issue 14)
    _check_queue(ctx, e, f"GroupAdmitted {p.group_id}", p.queued_bytes)


def _check_queue(ctx: Auditor, e: Event, what: str, recorded: int | None) -> None:
    """The completed untrained groups' bytes, recomputed from their trajectories, against the cap. Admission that
    counts every group in flight at its `max_tokens` keeps them under it at every event: a violation. An older log's
    admission counted an estimate, which a long generation could outrun: a warning."""
    declared = ctx.cfg.admission.max_queued_bytes
    recomputed = sum(ctx.queued.values())
    if recomputed <= declared:
        return
    detail = f"{what}: completed untrained groups hold {recomputed} bytes by the log (> cap {declared}"
    detail += f"; recorded {recorded})" if recorded is not None else ")"
    if ctx.bounded_admission:
        ctx.violate(6, detail, e)
    else:
        ctx.warn(WarningKind.QUEUED_BYTES, detail, e, invariant=6)


@handlers.on(GroupCompleted)
def _group_completed(ctx: Auditor, e: Event, p: GroupCompleted) -> None:
    g = ctx.groups.get(p.group_id)
    if g is None:
        ctx.warn(WarningKind.ORPHAN, f"GroupCompleted {p.group_id} for a group never admitted", e, invariant=7)
        return
    ctx.terminal(g, e, f"group {p.group_id}")
    if g.completed is None:
        g.completed = e
        nbytes = p.bytes
        if all(tid in ctx.sample_bytes for tid in p.accepted):  # recomputed from what it holds
            nbytes = sum(ctx.sample_bytes[tid] for tid in p.accepted)
            if nbytes != p.bytes:
                ctx.violate(6, f"GroupCompleted {p.group_id} records {p.bytes} bytes; its samples hold {nbytes}", e)
        ctx.queued[p.group_id] = nbytes
        _check_queue(ctx, e, f"GroupCompleted {p.group_id}", None)


@handlers.on(GroupCancelled)
def _group_cancelled(ctx: Auditor, e: Event, p: GroupCancelled) -> None:
    g = ctx.groups.get(p.group_id)
    if g is None:
        ctx.warn(WarningKind.ORPHAN, f"GroupCancelled {p.group_id} for a group never admitted", e, invariant=7)
        return
    if g.completed is not None and g.consumed is None and p.group_id in ctx.queued:
        ctx.queued.pop(p.group_id)  # a completed group withdrawn before training: legal, leaves the queue
        g.completed = None
        g.terminal = e
        return
    ctx.terminal(g, e, f"group {p.group_id}")


@handlers.on(BatchConsumed)
def _batch_consumed(ctx: Auditor, e: Event, p: BatchConsumed) -> None:
    cfg = ctx.cfg
    if not (len(p.group_ids) == len(p.versions) == len(p.lags)):
        ctx.violate(
            5,
            f"BatchConsumed step {p.step}: {len(p.group_ids)} groups, {len(p.versions)} versions, {len(p.lags)} lags",
            e,
        )
    by_group: dict[str, list[str]] = {}
    for tid in p.trajectory_ids:
        fin = ctx.finished.get(tid)
        gid = fin.payload.trajectory.group_id if fin and isinstance(fin.payload, SampleFinished) else None
        gid = gid or tid.rsplit("/", 1)[0]
        by_group.setdefault(gid, []).append(tid)
        if tid in ctx.consumed:
            ctx.warn(WarningKind.DUPLICATE, f"trajectory {tid} consumed twice", ctx.consumed[tid], e)
        ctx.consumed[tid] = e
    for gid, listed in by_group.items():
        if gid not in p.group_ids:
            ctx.violate(5, f"BatchConsumed step {p.step} trains {listed} of group {gid} it does not list", e)
    for i, gid in enumerate(p.group_ids):
        ctx.checked[5] += 1
        g = ctx.groups.get(gid)
        lag = p.lags[i] if i < len(p.lags) else None
        if lag is not None and lag > cfg.admission.max_lag:
            ctx.violate(
                5,
                f"group {gid} consumed at step {p.step} with lag {lag} > max_lag {cfg.admission.max_lag}",
                g.admitted if g else None,
                e,
            )
        if g is None:
            ctx.violate(5, f"BatchConsumed step {p.step} consumes group {gid}, never admitted", e)
            continue
        if g.consumed is not None:
            ctx.warn(WarningKind.DUPLICATE, f"group {gid} consumed twice", g.consumed, e)
        g.consumed = e
        ctx.queued.pop(gid, None)
        comp = g.completed
        if comp is None or not isinstance(comp.payload, GroupCompleted):
            why = f"was cancelled ({g.terminal.event_id})" if g.terminal is not None else "never completed"
            ctx.violate(5, f"group {gid} consumed at step {p.step} but {why}", g.admitted, g.terminal, e)
            continue
        gp = comp.payload
        adm = g.admitted.payload
        assert isinstance(adm, GroupAdmitted)
        required = max(cfg.partial_policy.required(adm.n), adm.partial_policy.required(adm.n))
        real = [a for a in gp.accepted if ctx.finished_in(a, gid)]
        if len(real) < required:
            ctx.violate(
                5,
                f"group {gid} consumed with {len(real)} finished accepted samples of {adm.n}; "
                f"its partial policy requires {required}",
                g.admitted,
                comp,
                e,
            )
        tids = by_group.get(gid) or list(gp.accepted)
        stray = [t for t in tids if t not in gp.accepted or not ctx.finished_in(t, gid)]
        if stray:
            ctx.violate(5, f"group {gid}: consumed {stray} that the group did not accept as finished", comp, e)
        versions = [v for t in tids if t in ctx.finished for v, _ in span_versions(ctx.trajectory(t))]
        if versions:
            proven = ctx.current_version - min(versions)
            if proven > cfg.admission.max_lag:
                ctx.violate(
                    5,
                    f"group {gid} consumed at step {p.step}: its oldest tokens are v{min(versions)} while "
                    f"v{ctx.current_version} is published, lag >= {proven} > max_lag {cfg.admission.max_lag}"
                    + (f" (recorded lag {lag})" if lag is not None else ""),
                    ctx.published.get(ctx.current_version),
                    e,
                )
            if i < len(p.versions) and p.versions[i] != min(versions):
                ctx.warn(
                    WarningKind.PROVENANCE,
                    f"BatchConsumed step {p.step} records group {gid} at v{p.versions[i]}, its oldest tokens "
                    f"are v{min(versions)}",
                    e,
                )


@handlers.on(TrajectoryDropped)
def _trajectory_dropped(ctx: Auditor, e: Event, p: TrajectoryDropped) -> None:
    """Refused at consumption: leaves the queue; a group dropped while still in flight ends there."""
    ctx.queued.pop(p.group_id, None)
    g = ctx.groups.get(p.group_id)
    if g is not None and g.terminal is None:
        g.terminal = e
