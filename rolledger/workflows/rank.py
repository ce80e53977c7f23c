"""The rank's decisions: `decide_rank(state, rank, local) -> [RankAction]`, pure and level-triggered.

A rank worker (workers/roles/rank.py) folds the log until it is caught up, asks this module what to do, executes each
action and appends its events, then catches up again before the next decision. The decision is a function of the
folded `RunState` and of `RankLocal` - the few facts only the engine knows (groups running right now, the version it
holds staged, the version it reports serving) - and never of "the event just seen". So a batch of events can never
make a rank act on a state it has already left, deciding twice on one state gives the same actions, executing an
action changes the state so that it is not decided again, and a restarted rank is the same rank. Every action
carries `cause`, the id of the command event it answers, as the reducer recorded it in the state (PrepareRequested,
AdmissionPaused, UpdateCommitted, UpdateAborted, PolicyPublished, RankQuarantined, RunStarted); the interpreter
appends its events with that causation id, so the log links each answer to its command.

A restarted rank is a new incarnation (RankLocal.incarnation, a fresh id per rank process): while the log's last
RankJoined for the rank names another one, the rank first loads the version the log says it holds through the
verified path and announces itself (`Rejoin` -> RankJoined with that version, its live digest and the new
incarnation), and `may_serve` is false until the log shows the current incarnation. Its part in an open update
continues from the log: a version it prepared before the restart is prepared again at the commit (`Commit.reload`).

Also here: `may_take(cfg, load, n, kv_need, kv_budget)`, whether the rank has room for one more group (its
capacity: `rank_capacity`, in groups or in sequences), and `may_serve(state, rank)`, whether the rank's rollout may
start a group. It is false from the moment the
log asks the rank to drain (AdmissionPaused for an update it takes part in, a colocated handoff it has not slept in
yet), so "may I start a group" and "report drained" are decided on the same state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rolledger.schemas.config import RunConfig
from rolledger.schemas.statuses import EngineStatus, RunStatus, UpdateStatus
from rolledger.workflows.state import RankState, RunState, UpdateState

DrainMode = Literal["abort", "wait", "keep"]
WakeTag = Literal["weights", "kv_cache"]


@dataclass(frozen=True, slots=True)
class RankLocal:
    """What the log cannot know: the engine's own facts, read by the interpreter just before each decision."""

    running: int = 0  # groups the engine is generating right now
    engine_paused: bool = False  # the engine's pause flag
    staged_version: int | None = None  # the version the engine holds staged (validated, not swapped in)
    live_version: int | None = None  # the version the engine reports serving (None: not known)
    interruptible: bool = False  # the engine can park a running group and continue it on new weights
    failed_load: int | None = None  # the version a rejoin/reload last failed on: not retried until another is due
    incarnation: str = ""  # this rank process's id; "" (tests, old callers): incarnations are not checked


@dataclass(frozen=True, slots=True)
class Source:
    """Where a version's weights come from: the staged update (uri + manifest), or the initial weights (v0, uri "")."""

    version: int
    uri: str = ""
    manifest_digest: str = ""
    weights_digest: str = ""


# ---------------------------------------------------------------- actions (each carries what its executor needs)
@dataclass(frozen=True, slots=True)
class Join:
    """Announce the rank (RankJoined) with the engine's capabilities and live weights."""

    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class Prepare:
    """Read the staged update, verify every checksum, stage it -> RankPrepared | RankPrepareFailed."""

    version: int
    uri: str
    manifest_digest: str
    weights_digest: str
    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class Pause:
    """Pause the engine without reporting (drain_mode "abort": cut the running groups short)."""

    mode: DrainMode
    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class ReportDrained:
    """No group runs (or the engine parks them): pause the engine in `mode` and say so (EnginePaused)."""

    version: int
    mode: DrainMode
    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class Commit:
    """Swap the staged version in -> RankCommitted, CacheInvalidated (| CommandRefused, HealthFailed). `reload`: the
    engine holds nothing staged for it (a restarted rank): prepare it again through the verified path first."""

    version: int
    uri: str
    manifest_digest: str
    weights_digest: str
    reload: bool = False
    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class Probe:
    """Run the health probe on the committed weights -> HealthPassed | HealthFailed (also when a speculative draft's
    acceptance fell by more than the run's `update.max_spec_acceptance_drop`: workflows/health.py)."""

    version: int
    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class Sleep:
    """Colocated handoff: pause (drain_mode) and sleep at `level` -> EngineSlept."""

    level: int
    drain_mode: DrainMode
    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class Wake:
    """Wake these tags -> EngineWoke (weights before an update reaches the engine, kv_cache after its commit)."""

    tags: tuple[WakeTag, ...]
    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class WakeOnPublished:
    """The update aborted while the rank slept: wake what still sleeps; level 2 dropped the weights, so the published
    version is reloaded through the verified path between the weights and the KV cache."""

    level: int
    tags: tuple[WakeTag, ...]
    source: Source
    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class Resume:
    """Resume generation -> EngineResumed."""

    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class Discard:
    """Drop what the engine holds staged for a version whose transaction no longer needs it."""

    version: int
    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class Rejoin:
    """Quarantined: wake what still sleeps (`wake`: quarantined mid-handoff), load `source` through the verified
    path, swap it in -> RankJoined."""

    source: Source
    wake: tuple[WakeTag, ...] = ()
    cause: str = field(kw_only=True)  # the id of the command event this answers


@dataclass(frozen=True, slots=True)
class Reload:
    """The engine serves another version than the log says this rank holds (a restarted engine): load the logged
    one through the verified path, silently (the log already says so)."""

    source: Source
    cause: str = field(kw_only=True)  # the id of the command event this answers


RankAction = (
    Join
    | Prepare
    | Pause
    | ReportDrained
    | Commit
    | Probe
    | Sleep
    | Wake
    | WakeOnPublished
    | Resume
    | Discard
    | Rejoin
    | Reload
)

WAKE_ACTIONS = (Wake, WakeOnPublished, Discard)
_TAGS: tuple[WakeTag, ...] = ("weights", "kv_cache")  # wake order  # what a rank whose weights sleep may do


# ---------------------------------------------------------------- derived facts
def source(state: RunState, version: int) -> Source:
    """The weights of a decided version: its staged record, or the initial weights (version 0)."""
    u = state.updates.get(version)
    if version == 0 or u is None:
        return Source(version)
    return Source(version, u.uri, u.manifest_digest, u.weights_digest)


def rejoin_version(state: RunState) -> int:
    """The version a quarantined rank rejoins on: the newest whose commit is decided (roll forward), else the
    published one."""
    decided = [v for v, u in state.updates.items() if UpdateStatus(u.status).is_decided_commit]
    return max([*decided, state.policy_version])


def _version_cause(state: RunState, version: int) -> str:
    """The command that made `version` the one to hold: its UpdateCommitted, or RunStarted for the initial weights."""
    u = state.updates.get(version)
    return u.decided_event if version and u is not None and u.decided_event else state.started_event


def _resume_cause(state: RunState, rank: int) -> str:
    """What releases a paused rank: the close of the newest update it took part in (else the run's start)."""
    closed = [u for v, u in sorted(state.updates.items()) if not u.open and rank in u.ranks and u.closing_event]
    return closed[-1].closing_event if closed else state.started_event


def _discard_cause(state: RunState, rank: int, version: int) -> str:
    """Why a staged version is no longer needed: its transaction closed, the rank was quarantined out of it, or it
    was decided without this rank."""
    u = state.updates.get(version)
    if u is None:
        gone = state.retired_updates.get(version)  # closed, and its record retired
        return gone.closing_event if gone is not None else state.started_event
    if not u.open:
        return u.closing_event
    me = state.ranks.get(rank)
    if rank in u.quarantined and me is not None and me.quarantined_event:
        return me.quarantined_event
    return u.decided_event or u.prepare_event


def _my_update(state: RunState, rank: int) -> UpdateState | None:
    """The open transaction this rank takes part in (not quarantined out of it)."""
    u = state.open_update
    if u is None or rank not in u.ranks or rank in u.quarantined:
        return None
    return u


def _held(state: RunState, rank: int) -> bool:
    """Must generation stay stopped for an update? From the update's pause on (for a rank quarantined out of it and
    rejoined mid-transaction: until the transaction closes), through the commit, until the version is published or
    aborted. On every rank, not only the update's own: a rank that was out of service when the update began and
    rejoined during it generates nothing either until it closes (invariant 2), then reloads the published version."""
    u = state.open_update
    if u is None:
        return False
    if rank in u.ranks and rank in u.quarantined:
        return True
    if u.prepare_event and rank not in u.ranks:
        # out of the transaction (it joined after the update named its ranks): the coordinator does not wait for its
        # drain, so a start decided before it folds the pause could land after the commit; held until it closes
        return True
    return "update" in state.admission.paused or UpdateStatus(u.status).is_decided_commit


def _sleep_due(state: RunState, me: RankState) -> bool:
    """A colocated handoff waits for this rank to sleep: it has not slept in it, and the trainer has not trained."""
    a = state.admission
    return "handoff" in a.paused and me.slept_in_handoff != a.handoff_step and state.trainer.step <= a.handoff_step


@dataclass(frozen=True, slots=True)
class RankLoad:
    """What a rank's rollout has running, counted under its lock: groups (each from its start to its last sample's
    end), the sequences of those still generating, and the KV tokens they may take at most (each unfinished
    sequence at prompt + max_tokens; 'groups': each group's whole worst case until it ends)."""

    groups: int = 0
    sequences: int = 0
    kv_reserved: int = 0


def seq_limit(cfg: RunConfig) -> int | None:
    """The sequences a rank's engine runs at once, as the config declares it (None: unbounded): `rank_max_seqs`, else
    the simulated engine's `simulated.max_num_seqs`."""
    limit = cfg.rank_max_seqs or (cfg.simulated.max_num_seqs if cfg.engine == "simulated" else 0)
    return limit or None


def may_take(cfg: RunConfig, load: RankLoad, n: int, kv_need: int, kv_budget: float) -> bool:
    """Has the rank room for one more group of `n` samples whose worst case is `kv_need` KV tokens?

    Always when nothing runs (a group that alone exceeds the budget still runs, alone). Else:
    - 'groups' (the default, what every run before rank_capacity decided): a free slot (the caller: one of
      rank_slots) and the running groups' worst case beside this one's within `kv_budget`;
    - 'sequences': fewer than rank_slots groups in flight, the sequences still generating plus `n` within the
      engine's running-sequence limit (`seq_limit`), and the unfinished sequences' worst case beside this group's
      within `kv_budget`: a group whose samples ended but one holds one sequence of the rank's room, not a slot.
    """
    if load.groups == 0:
        return True
    if load.kv_reserved + kv_need > kv_budget:
        return False
    if cfg.rank_capacity == "groups":
        return True
    limit = seq_limit(cfg)
    return load.groups < cfg.rank_slots and (limit is None or load.sequences + n <= limit)


def may_serve(state: RunState, rank: int, live_version: int | None = None, incarnation: str = "") -> bool:
    """May the rank's rollout start a group now? `live_version`: what its engine reports serving; a group never
    starts on other weights than the log says the rank holds (a restarted engine reloads them first).
    `incarnation`: the asking rank process; it serves only once the log holds its own RankJoined."""
    me = state.ranks.get(rank)
    if me is None or not EngineStatus(me.status).may_serve or RunStatus(state.status).is_terminal:
        return False
    if incarnation and me.incarnation != incarnation:
        return False
    if live_version is not None and live_version != me.committed_version:
        return False
    if me.committed_version < state.policy_version and state.open_update is None:
        # behind the published version (it rejoined on an older one while an update it was not part of ran): the
        # coordinator sends it to reload, and a group started first would land after that quarantine (invariant 4)
        return False
    return not _held(state, rank) and not _sleep_due(state, me)


def _keeps_staged(state: RunState, rank: int, version: int) -> bool:
    """Does the transaction of `version` still need what this rank staged for it?"""
    u = state.updates.get(version)
    return (
        u is not None
        and UpdateStatus(u.status).is_open
        and u.status != UpdateStatus.STAGED
        and rank in u.ranks
        and rank not in u.committed
        and rank not in u.failed
        and rank not in u.quarantined
    )


# ---------------------------------------------------------------- the decider
def decide_rank(state: RunState, rank: int, local: RankLocal) -> list[RankAction]:
    """What rank `rank` does next, from the folded state and the engine's local facts alone."""
    if RunStatus(state.status).is_terminal or state.config is None:
        return []
    me = state.ranks.get(rank)
    if me is None:
        return [Join(cause=state.started_event)]
    out: list[RankAction] = []
    if local.staged_version is not None and not _keeps_staged(state, rank, local.staged_version):
        out.append(Discard(local.staged_version, cause=_discard_cause(state, rank, local.staged_version)))
    if me.status == EngineStatus.QUARANTINED:
        v = rejoin_version(state)
        if local.failed_load == v:
            return out
        asleep = tuple(t for t in _TAGS if t not in me.woke) if me.sleep_level else ()
        return [*out, Rejoin(source(state, v), asleep, cause=me.quarantined_event)]
    if local.incarnation and me.incarnation != local.incarnation:
        # a restarted rank (a fresh engine, nothing staged, nothing asleep): the version the log says it holds,
        # through the verified path, then RankJoined naming this incarnation
        v = me.committed_version
        if local.failed_load == v:
            return out
        return [*out, Rejoin(source(state, v), cause=_version_cause(state, v))]
    if me.status == EngineStatus.ASLEEP:
        return out + _asleep(state, rank, me, local)
    u = _my_update(state, rank)
    if u is not None:
        acts = _in_update(state, rank, me, u, local)
        if acts is not None:
            return out + acts
    if _sleep_due(state, me):
        if local.running:
            return out  # the current group finishes first
        cfg = state.config
        return [*out, Sleep(cfg.sleep_level, cfg.update.drain_mode, cause=state.admission.handoff_event)]
    behind = local.live_version is not None and local.live_version != me.committed_version
    if behind and local.failed_load != me.committed_version:
        return [*out, Reload(source(state, me.committed_version), cause=_version_cause(state, me.committed_version))]
    if (me.status == EngineStatus.PAUSED or local.engine_paused) and not _held(state, rank):
        out.append(Resume(cause=_resume_cause(state, rank)))
    return out


def _in_update(state: RunState, rank: int, me: RankState, u: UpdateState, local: RankLocal) -> list[RankAction] | None:
    """An awake (or paused) rank's part in the open update; None when it has nothing to do in it right now."""
    cfg = state.config
    assert cfg is not None
    status = UpdateStatus(u.status)
    if status == UpdateStatus.PREPARING:
        if rank not in u.prepared and rank not in u.failed:
            return [_prepare(u)]
        if "update" in state.admission.paused and me.drained_for != u.version:
            interruptible = cfg.interruptible and local.interruptible
            if local.running and not interruptible:
                if cfg.update.drain_mode == "abort" and not local.engine_paused:
                    return [Pause("abort", cause=u.paused_event)]
                return []  # wait for the running group to end
            return [ReportDrained(u.version, "keep" if interruptible else cfg.update.drain_mode, cause=u.paused_event)]
        return None if not _held(state, rank) else []
    if status.is_decided_commit:
        if rank in u.failed:
            return []  # the coordinator quarantines it
        if rank not in u.committed:
            if rank not in u.prepared:
                return []  # never commits what it did not prepare (the reducer flags such a commit)
            return [_commit(u, local)]
        if rank not in u.healthy:
            return [Probe(u.version, cause=u.decided_event)]
        return []  # published soon: generation stays stopped until then
    return None


def _asleep(state: RunState, rank: int, me: RankState, local: RankLocal) -> list[RankAction]:
    """A sleeping rank only wakes: its weights before an update reaches the engine, its KV cache after the commit."""
    if me.wake_on_abort:
        tags = tuple(t for t in _TAGS if t not in me.woke)
        return [WakeOnPublished(me.sleep_level, tags, source(state, state.policy_version), cause=me.abort_event)]
    u = _my_update(state, rank)
    if u is None:
        return []  # the trainer's turn
    weights_awake = "weights" in me.woke
    status = UpdateStatus(u.status)
    if status == UpdateStatus.PREPARING and rank not in u.prepared and rank not in u.failed:
        return [_prepare(u)] if weights_awake else [Wake(("weights",), cause=u.prepare_event)]
    if status.is_decided_commit and rank not in u.failed and rank in u.prepared:
        if not weights_awake:
            return [Wake(("weights",), cause=u.decided_event)]
        if rank not in u.committed:
            return [_commit(u, local)]
        return [Wake(("kv_cache",), cause=u.decided_event)]
    return []


def _prepare(u: UpdateState) -> Prepare:
    return Prepare(u.version, u.uri, u.manifest_digest, u.weights_digest, cause=u.prepare_event)


def _commit(u: UpdateState, local: RankLocal) -> Commit:
    reload = local.staged_version != u.version
    return Commit(u.version, u.uri, u.manifest_digest, u.weights_digest, reload=reload, cause=u.decided_event)
