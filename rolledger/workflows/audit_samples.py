"""The audit's handlers for samples: one version per sample (invariant 1), no generation inside an update window (2),
the published weights and cache generations behind every trajectory (4), every sample reaching a terminal (7), and
every episode's turns (10: workflows/episode.py)."""

from __future__ import annotations

from rolledger.schemas.events import (
    CacheInvalidated,
    Event,
    GroupAdmitted,
    RankQuarantined,
    SampleCancelled,
    SampleFailed,
    SampleFinished,
    SampleStarted,
)
from rolledger.schemas.statuses import CacheKind
from rolledger.schemas.trajectory import Trajectory
from rolledger.schemas.wire import encoded_size
from rolledger.workflows.audit_context import Auditor, RankFacts, Unit, span_versions
from rolledger.workflows.audit_report import WarningKind
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.episode import episode_problems

handlers: Handlers[Auditor, None] = Handlers("audit: samples")

# the CacheInvalidated kinds behind a trajectory's cache_generation and graph_generation
_TOKEN_CACHE_KINDS = frozenset(k for k in CacheKind if k.is_token_cache)
_GRAPH_KINDS = frozenset(k for k in CacheKind if k.is_graph)


@handlers.on(SampleStarted)
def _sample_started(ctx: Auditor, e: Event, p: SampleStarted) -> None:
    prior = ctx.samples.get(p.sample_id)
    if prior is not None and prior.terminal is None:
        ctx.warn(
            WarningKind.RESTART, f"sample {p.sample_id} started again before its first attempt ended", prior.start, e
        )
    ctx.samples[p.sample_id] = Unit(e)
    if p.group_id not in ctx.groups:
        ctx.warn(WarningKind.ORPHAN, f"SampleStarted {p.sample_id} for group {p.group_id} never admitted", e)
    _generation_in_window(ctx, e, p.rank, f"SampleStarted {p.sample_id}")
    _generation_version(ctx, e, p.policy_version, p.weights_digest, p.rank, f"sample {p.sample_id}")


def _generation_in_window(ctx: Auditor, e: Event, rank: int, what: str) -> None:
    ctx.checked[2] += 1
    w = ctx.window
    if w is None:
        return
    stopped = ctx.stopped.get(rank)
    if w.committed is not None:
        ctx.violate(
            2, f"{what} on rank {rank} after v{w.version} was committed and before it was published", w.committed, e
        )
    elif stopped is not None:
        ctx.violate(2, f"{what} on rank {rank} after it stopped for the update ({stopped.type})", stopped, e)


def _generation_version(ctx: Auditor, e: Event, v: int, digest: str, rank: int, what: str) -> None:
    """A sample starts generating on (rank, v, digest): v must be published (3/4), the digest v's, the rank on v."""
    ctx.checked[4] += 1
    if v == 0 and 0 not in ctx.version_digest:
        pass  # the initial weights, before (or without) a RunStarted naming their digest
    elif v not in ctx.version_digest:
        cur = ctx.updates.current(v)
        if cur is not None and cur.aborted is not None:
            ctx.violate(3, f"{what} generated with version {v}, whose update was aborted", cur.aborted, e)
        elif ctx.window is None:
            ctx.violate(4, f"{what} generated with version {v}, which was never published", e)
    elif digest != ctx.version_digest[v]:
        src = ctx.published.get(v) or ctx.run_started
        ctx.violate(
            4, f"{what} on rank {rank} uses weights {digest}, but version {v} is {ctx.version_digest[v]}", src, e
        )
    st = ctx.ranks.get(rank)
    if st is None:
        return
    if st.quarantined is not None:
        if _untouched_by_quarantine(ctx, st, v, digest):
            ctx.warn(
                WarningKind.RACED_QUARANTINE,
                f"{what} started on rank {rank} after its quarantine for an aborted update"
                f" (not yet read by the rank), on the published v{v} it still held untouched",
                st.quarantined,
                e,
                invariant=4,
            )
        else:
            ctx.violate(4, f"{what} generated on quarantined rank {rank}", st.quarantined, e)
    elif st.version != v or st.digest != digest:
        ctx.violate(
            4,
            f"{what} claims version {v}/{digest} but rank {rank} is on {st.version}/{st.digest}",
            st.event,
            e,
        )


def _untouched_by_quarantine(ctx: Auditor, st: RankFacts, v: int, digest: str) -> bool:
    """Was the rank quarantined out of an update that aborted (so nothing was swapped: it still holds the published
    weights it held before), and is the sample on exactly those weights? A rank cannot fence its rollout against the
    coordinator's append, so a group it starts before folding that quarantine is benign then, and only then."""
    q = st.quarantined
    if q is None or not isinstance(q.payload, RankQuarantined):
        return False
    attempt = ctx.updates.current(q.payload.version)
    aborted = attempt is not None and attempt.aborted is not None and attempt.committed is None
    return aborted and (st.version, st.digest) == (v, digest) and ctx.version_digest.get(v) == digest


@handlers.on(SampleFinished)
def _sample_finished(ctx: Auditor, e: Event, p: SampleFinished) -> None:
    t = p.trajectory
    sid = t.trajectory_id
    if sid in ctx.finished:
        ctx.warn(WarningKind.DUPLICATE, f"trajectory {sid} finished twice", ctx.finished[sid], e)
    ctx.finished[sid] = e
    unit = ctx.samples.get(sid)
    start = unit.start if unit else None
    if unit is None:
        ctx.warn(WarningKind.ORPHAN, f"SampleFinished {sid} without a SampleStarted", e, invariant=7)
    else:
        ctx.terminal(unit, e, sid)
    _check_versions(ctx, e, t, start)
    _check_published_state(ctx, e, t, start)
    _check_bytes(ctx, e, p)
    _check_episode(ctx, e, t)


def _check_episode(ctx: Auditor, e: Event, t: Trajectory) -> None:
    """Invariant 10: an episode's turns (workflows/episode.episode_problems), and the versions of its policy tokens
    within bounds: none newer than the newest version published when it finished, none older than it started on."""
    task = ctx.cfg.task if ctx.run_started is not None else None  # None: a log without its RunStarted
    if not t.turns and (task is None or task.env is None):
        return
    ctx.checked[10] += 1
    problems = episode_problems(t, task)
    newest = max(ctx.version_digest, default=0)
    for v, _ in span_versions(t):
        if v > newest:
            problems.append(f"tokens on v{v}, newer than the newest published version v{newest}")
        if v < t.policy_version:
            problems.append(f"tokens on v{v}, older than the v{t.policy_version} it started on")
    if problems:
        ctx.violate(10, f"episode {t.trajectory_id}: " + "; ".join(problems), e)


def _check_bytes(ctx: Auditor, e: Event, p: SampleFinished) -> None:
    """Invariant 6, per sample: the bytes a finished sample declares are its trajectory's encoded size, recomputed
    here, and within what its group reserved per sample at admission. A log from before samples declared their
    size counts the formula it was written with (`Trajectory.legacy_nbytes`)."""
    t = p.trajectory
    if p.nbytes is None:
        ctx.sample_bytes[t.trajectory_id] = t.legacy_nbytes
        return
    ctx.checked[6] += 1
    nbytes = ctx.sample_bytes[t.trajectory_id] = encoded_size(t)
    if nbytes != p.nbytes:
        ctx.violate(
            6, f"SampleFinished {t.trajectory_id} declares {p.nbytes} bytes; its trajectory encodes to {nbytes}", e
        )
    group = ctx.groups.get(t.group_id)
    admitted = group.admitted.payload if group is not None else None
    if isinstance(admitted, GroupAdmitted) and nbytes > (reserve := admitted.est_bytes // admitted.n):
        ctx.violate(6, f"SampleFinished {t.trajectory_id} holds {nbytes} bytes, over the {reserve} reserved for it", e)


def _check_versions(ctx: Auditor, e: Event, t: Trajectory, start: Event | None) -> None:
    """Invariant 1."""
    ctx.checked[1] += 1
    sid = t.trajectory_id
    spans = span_versions(t)
    versions = sorted({v for v, _ in spans} | {t.policy_version})
    if not (ctx.cfg.interruptible or ctx.cfg.recycle_aborted):
        if len(versions) > 1:
            ctx.violate(1, f"trajectory {sid} holds tokens from versions {versions} in a non-interruptible run", e)
        digests = sorted({d for _, d in spans} | {t.weights_digest})
        if len(digests) > 1:
            ctx.violate(1, f"trajectory {sid} holds tokens from weights {digests}", e)
    elif t.spans:
        pos = 0
        problems = []
        for s in t.spans:
            if s.start != pos or s.end < s.start:
                problems.append(f"span [{s.start},{s.end}) does not follow token {pos}")
            pos = s.end
        if pos != len(t.token_ids):
            problems.append(f"spans cover {pos} of {len(t.token_ids)} tokens")
        vs = [s.policy_version for s in t.spans]
        if vs != sorted(vs):
            problems.append(f"span versions {vs} go backwards")
        if t.spans[0].policy_version != t.policy_version:
            problems.append(f"first span is v{t.spans[0].policy_version}, trajectory says v{t.policy_version}")
        if problems:
            ctx.violate(1, f"trajectory {sid} spans are not a complete stamp: " + "; ".join(problems), e)
    if start is not None and isinstance(start.payload, SampleStarted):
        s0 = start.payload
        first_digest = t.spans[0].weights_digest if t.spans else t.weights_digest
        if s0.policy_version != t.policy_version or s0.weights_digest != first_digest:
            ctx.violate(
                1,
                f"trajectory {sid} says v{t.policy_version}/{first_digest} but its sample started on "
                f"v{s0.policy_version}/{s0.weights_digest}",
                start,
                e,
            )
        if s0.rank != t.rank or s0.group_id != t.group_id:
            ctx.warn(
                WarningKind.PROVENANCE,
                f"trajectory {sid} says rank {t.rank}/group {t.group_id}, its start rank {s0.rank}/group {s0.group_id}",
                start,
                e,
            )


def _check_published_state(ctx: Auditor, e: Event, t: Trajectory, start: Event | None) -> None:
    """Invariant 4 on a trajectory: published digests per span, and the rank's cache/graph generations."""
    sid = t.trajectory_id
    for v, d in span_versions(t)[1:] if t.spans else []:
        if v in ctx.version_digest and d != ctx.version_digest[v]:
            ctx.violate(4, f"trajectory {sid} has a v{v} span on weights {d}, not {ctx.version_digest[v]}", e)
    st = ctx.ranks.get(t.rank)
    if st is None or start is None:
        return
    v = t.policy_version
    pub = ctx.published.get(v)
    if v != 0 and (pub is None or ctx.index(pub) > ctx.index(start)):
        return  # started before v was published: windows and versions are checked elsewhere
    started_at = ctx.index(start)
    before = [i for i in st.invalidations if ctx.index(i) <= started_at]
    during = [i for i in st.invalidations if ctx.index(i) > started_at]
    for kinds, got, label in (
        (_TOKEN_CACHE_KINDS, t.cache_generation, "cache"),
        (_GRAPH_KINDS, t.graph_generation, "graph"),
    ):
        relevant = [
            i
            for i in before
            if isinstance(i.payload, CacheInvalidated)
            and i.payload.kind in kinds
            and (label == "graph" or i.payload.version == v)
        ]
        if not relevant:
            continue
        ctx.checked[4] += 1
        newest: dict[str, Event] = {}
        for i in relevant:
            assert isinstance(i.payload, CacheInvalidated)
            newest[i.payload.kind] = i
        ok = {i.payload.generation for i in newest.values() if isinstance(i.payload, CacheInvalidated)}
        ok |= {
            i.payload.generation for i in during if isinstance(i.payload, CacheInvalidated) and i.payload.kind in kinds
        }
        if got not in ok:
            ctx.violate(
                4,
                f"trajectory {sid} on rank {t.rank} used {label} generation {got}, but the rank's current one "
                f"for v{v} is {sorted(ok)}",
                *newest.values(),
                e,
            )


def _sample_terminal(ctx: Auditor, e: Event, sample_id: str) -> None:
    unit = ctx.samples.get(sample_id)
    if unit is None and isinstance(e.payload, SampleCancelled):
        return  # cancelled before it was dispatched (first_k, a cancelled group): nothing was started
    if unit is None:
        ctx.warn(WarningKind.ORPHAN, f"{e.type} {sample_id} without a SampleStarted", e, invariant=7)
    else:
        ctx.terminal(unit, e, f"sample {sample_id}")


@handlers.on(SampleFailed)
def _sample_failed(ctx: Auditor, e: Event, p: SampleFailed) -> None:
    if p.stage == "reward":  # a finished sample its reward functions could not score: it already reached its end
        if p.sample_id not in ctx.finished:
            ctx.warn(WarningKind.ORPHAN, f"reward failure for {p.sample_id}, which never finished", e, invariant=7)
        return
    _sample_terminal(ctx, e, p.sample_id)


@handlers.on(SampleCancelled)
def _sample_cancelled(ctx: Auditor, e: Event, p: SampleCancelled) -> None:
    _sample_terminal(ctx, e, p.sample_id)
